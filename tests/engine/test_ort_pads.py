"""A Sum of zero Pads laying pieces side by side, as one Concat for onnxruntime
(onnxtrain/engine/ort_pads.py): onnxruntime's values for the graph given, and the cases left alone."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.engine.ort_rewrites import rewrite_for_onnxruntime

ort = pytest.importorskip("onnxruntime")


def pads_model(spans: list[tuple[int, int, int]], axis: int = 0, rank: int = 3, pads_as: str = "Concat",
               extra_reader: bool = False, value: float | None = None, mode: str = "constant",
               piece_dims: list | None = None) -> onnx.ModelProto:
    """Pieces p{i} (size ``s`` on ``axis``, 4 × "B" elsewhere) padded with (begin, end) = spans[i] along
    ``axis`` and summed; the pads a Concat of Constants (as the autodiff writes them) or an initializer."""
    nodes, inits, inputs = [], [], []
    for i, (begin, size, end) in enumerate(spans):
        dims = list(piece_dims or [4, "B", 5][:rank])
        dims[axis] = size
        inputs.append(helper.make_tensor_value_info(f"p{i}", TensorProto.FLOAT, dims))
        pads = np.zeros(2 * rank, np.int64)
        pads[axis], pads[rank + axis] = begin, end
        if pads_as == "Concat":
            parts = []
            for j, v in enumerate(pads):
                nodes.append(helper.make_node("Constant", [], [f"c{i}_{j}"],
                                              value=numpy_helper.from_array(np.array([v], np.int64))))
                parts.append(f"c{i}_{j}")
            nodes.append(helper.make_node("Concat", parts, [f"pads{i}"], axis=0))
        else:
            inits.append(numpy_helper.from_array(pads, f"pads{i}"))
        ins = [f"p{i}", f"pads{i}"]
        if value is not None:
            inits.append(numpy_helper.from_array(np.array(value, np.float32), f"v{i}"))
            ins.append(f"v{i}")
        nodes.append(helper.make_node("Pad", ins, [f"padded{i}"], name=f"pad{i}", mode=mode))
    nodes.append(helper.make_node("Sum", [f"padded{i}" for i in range(len(spans))], ["y"], name="sum"))
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if extra_reader:
        outs.append(helper.make_tensor_value_info("padded0", TensorProto.FLOAT, None))
    g = helper.make_graph(nodes, "pads", inputs, outs, inits)
    return onnx.shape_inference.infer_shapes(
        helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9))


def feeds(model: onnx.ModelProto, batch: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for v in model.graph.input:
        shape = [d.dim_value if d.HasField("dim_value") else batch for d in v.type.tensor_type.shape.dim]
        x = rng.standard_normal(shape).astype(np.float32)
        x.reshape(-1)[0] = -0.0  # a -0.0 stays -0.0 in the Concat, +0.0 in the Sum
        out[v.name] = x
    return out


def run(model: onnx.ModelProto, f: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, f)


@pytest.mark.parametrize("spans,axis,pads_as", [
    ([(0, 1, 2), (1, 1, 1), (2, 1, 0)], 0, "Concat"),     # q, k and v of one projection
    ([(2, 1, 0), (0, 1, 2), (1, 1, 1)], 0, "Concat"),     # in any order
    ([(0, 2, 3), (2, 3, 0)], 2, "initializer"),           # uneven pieces on the last axis
])
def test_tiling_pads_become_one_concat(spans, axis, pads_as) -> None:
    model = pads_model(spans, axis, pads_as=pads_as)
    new = rewrite_for_onnxruntime(model)
    onnx.checker.check_model(new, full_check=True)
    ops = [n.op_type for n in new.graph.node]
    assert ops == ["Concat"], ops  # the Pads and what computed their pads are gone
    assert not new.graph.initializer
    f = feeds(model)
    want, got = run(model, f)[0], run(new, f)[0]
    np.testing.assert_array_equal(got, want)  # equal as numbers (-0.0 == +0.0)
    assert np.signbit(got).sum() == np.signbit(want).sum() + sum(1 for _ in spans)  # the -0.0s kept


@pytest.mark.parametrize("kwargs", [
    {"spans": [(0, 1, 2), (1, 1, 1)]},                           # a gap at the end
    {"spans": [(0, 1, 2), (0, 1, 2), (2, 1, 0)]},                # overlapping pieces
    {"spans": [(0, 1, 1), (1, 1, 0)], "extra_reader": True},      # a Pad read elsewhere
    {"spans": [(0, 1, 1), (1, 1, 0)], "value": 1.0},              # not zero pads
    {"spans": [(0, 1, 1), (1, 1, 0)], "mode": "edge"},
    {"spans": [(0, 1, 1), (1, 1, 0)], "piece_dims": [4, "B", None]},  # other dims not known equal
])
def test_other_pads_are_left_alone(kwargs) -> None:
    model = pads_model(**kwargs)
    new = rewrite_for_onnxruntime(model)
    assert "Sum" in [n.op_type for n in new.graph.node]
    f = feeds(model)
    for a, b in zip(run(model, f), run(new, f)):
        np.testing.assert_array_equal(a, b)


def test_unnamed_pads_elsewhere_stay() -> None:
    """Nodes without names: only the tiling Pads go, not another unnamed Pad."""
    model = pads_model([(0, 1, 1), (1, 1, 0)])
    for n in model.graph.node:
        n.name = ""
    model.graph.input.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 2]))
    model.graph.initializer.append(numpy_helper.from_array(np.array([1, 0, 1, 0], np.int64), "zpads"))
    model.graph.node.append(helper.make_node("Pad", ["z", "zpads"], ["zp"]))
    model.graph.output.append(helper.make_tensor_value_info("zp", TensorProto.FLOAT, [4, 2]))
    new = rewrite_for_onnxruntime(model)
    assert [n.op_type for n in new.graph.node] == ["Concat", "Pad"]
    f = feeds(model)
    for a, b in zip(run(model, f), run(new, f)):
        np.testing.assert_array_equal(a, b)
