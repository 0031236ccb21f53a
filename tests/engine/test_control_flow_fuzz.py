"""A seeded fuzz of If, Loop and Scan whose bodies are small random graphs
(``tests/engine/control_flow_gen.py``): the engine's outputs against onnxruntime's.

Each seed draws a float32 or float64 model (opset 11 to 21) of one to three control-flow nodes nested up to
three deep, whose bodies read the main graph's inputs and initializers and their enclosing bodies' values,
hold Constants and initializers of their own, and output values as they are; Loops of a trip count, a
condition or both (none, a condition that turns false part way, a trip count of 2**62 that the condition
cuts short), lists appended to, carried values that grow, scan outputs of several shapes and an integer
one; Scans along any axes, in any direction; sometimes a dim of size 0 throughout. The model passes
``onnx.checker`` (full check); onnxruntime runs its spec-equivalent rewrite (``spec_equivalent``: where
onnxruntime 1.32 departs from the spec, README "Limits"), with its graph optimizations off.

The default suite runs the first ``DEFAULT`` seeds, ``ONNXTRAIN_FULL_TESTS=1`` all ``SEEDS``. After the fuzz:
a test per defect it found, on a small model.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxtrain.testing import run_engine
from tests.engine.control_flow_gen import random_case
from tests.tiers import extended

SEEDS, DEFAULT = 600, 150


def _ort(model: onnx.ModelProto, feeds: dict) -> list:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(
        None, feeds)


@pytest.mark.parametrize("seed", [s if s < DEFAULT else extended(s) for s in range(SEEDS)])
def test_fuzz(seed: int) -> None:
    case = random_case(seed)
    onnx.checker.check_model(case.model, full_check=True)
    mine = run_engine(case.model, case.feeds)
    theirs = _ort(case.oracle, case.feeds)
    tol = 1e-12 if case.model.graph.output[0].type.tensor_type.elem_type == TensorProto.DOUBLE else 1e-5
    for out, a, b in zip(case.model.graph.output, mine, theirs):
        assert a.shape == b.shape and a.dtype == b.dtype, f"seed {seed} ({case.desc}) {out.name}: " \
            f"{a.dtype}{list(a.shape)} vs onnxruntime's {b.dtype}{list(b.shape)}"
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=f"seed {seed} ({case.desc}) {out.name}")


# ---- the defects the fuzz found, each on a small model -----------------------------------------------------
def _vi(name: str, shape, et: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, et, shape)


def test_a_loop_of_no_iteration_stacks_an_outer_value_at_its_shape() -> None:
    """A Loop that runs no iteration (its condition false) whose body stacks Tanh(x), x a [2, 3] value of the
    main graph, declaring no shape for it: onnxruntime's load-time shape inference sees x's declared shape,
    so the stack is [0, 2, 3] and the ReduceSum over its axis 0 after the loop is [2, 3] zeros. The engine's
    inference left the body's outer values untyped: [0], and a sum of shape [] (here a loss off by half)."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["c_out"]), helper.make_node("Tanh", ["x"], ["t"])],
        "body", [_vi("i", [], TensorProto.INT64), _vi("c", [], TensorProto.BOOL)],
        [_vi("c_out", [], TensorProto.BOOL), _vi("t", None)])
    nodes = [helper.make_node("Loop", ["", "go"], ["stack"], body=body),
             helper.make_node("ReduceSum", ["stack"], ["s"], axes=[0], keepdims=0),
             helper.make_node("Add", ["s", "x"], ["y"])]
    graph = helper.make_graph(nodes, "g", [_vi("x", [2, 3]), _vi("go", [], TensorProto.BOOL)],
                              [_vi("stack", None), _vi("y", [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 6
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "go": np.array(False)}
    want = _ort(model, feeds)
    assert want[0].shape == (0, 2, 3)
    for a, b in zip(run_engine(model, feeds), want):
        assert a.shape == b.shape
        np.testing.assert_array_equal(a, b)


# ---- where onnxruntime 1.32 departs from the spec (the engine follows it) ----------------------------------
def test_a_loop_reading_an_empty_expanded_value() -> None:
    """A Loop body reading e = Expand(Unsqueeze(x), Shape(y)) of shape [1, 0, 2] (the shape of the
    gradient fuzz's backward loops over a value with an empty dim): onnxruntime 1.32, its graph
    optimizations on, refuses to load the model ("Can't merge shape info ... Inferred=1 Declared=0" for the
    Unsqueeze's output; off, it runs it); it is valid (onnx.checker, strict shape inference), and the
    engine runs it: h + e[0] of [0, 2]."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["c2"]), helper.make_node("Gather", ["e", "i"], ["g"]),
         helper.make_node("Add", ["h", "g"], ["h2"])],
        "body", [_vi("i", [], TensorProto.INT64), _vi("c", [], TensorProto.BOOL), _vi("h", [0, 2])],
        [_vi("c2", [], TensorProto.BOOL), _vi("h2", [0, 2])])
    nodes = [helper.make_node("Constant", [], ["ax"], value=onnx.numpy_helper.from_array(np.array([0, 1]))),
             helper.make_node("Unsqueeze", ["x", "ax"], ["u"]), helper.make_node("Shape", ["y"], ["s"]),
             helper.make_node("Expand", ["u", "s"], ["e"]),
             helper.make_node("Loop", ["n", "", "h0"], ["hf"], body=body)]
    graph = helper.make_graph(nodes, "g", [_vi("x", [2]), _vi("y", [1, 0, 2]), _vi("h0", [0, 2])],
                              [_vi("hf", [0, 2])], [onnx.numpy_helper.from_array(np.array(1), "n")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.shape_inference.infer_shapes(model, strict_mode=True)
    feeds = {"x": np.ones(2, np.float32), "y": np.ones((1, 0, 2), np.float32),
             "h0": np.ones((0, 2), np.float32)}
    with pytest.raises(Exception, match="merge shape info"):  # onnxruntime's Fail
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = run_engine(model, feeds)
    (want,) = _ort(model, feeds)
    assert got.shape == want.shape == (0, 2) and got.dtype == want.dtype
