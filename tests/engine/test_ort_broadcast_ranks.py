"""Lower-rank broadcasting operands given the output's rank for onnxruntime
(onnxtrain/engine/ort_broadcast_ranks.py): the rewritten graph gives onnxruntime's own values for the graph as
it was, bit for bit."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.engine.ort_rewrites import rewrite_for_onnxruntime
from onnxtrain.ir.builder import static_shape, value_types

ort = pytest.importorskip("onnxruntime")
F = TensorProto.FLOAT


def run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def update_like(opset: int) -> tuple[onnx.ModelProto, dict]:
    """A 1×1 convolution weight's update: products and sums with run-time and constant scalars, a Where,
    a variadic Max and a comparison, over a (16, 8, 1, 1) weight and a (32, 1) column."""
    nodes = [
        helper.make_node("Mul", ["w", "lr"], ["step"]),  # run-time scalar
        helper.make_node("Sub", ["w", "step"], ["w1"]),
        helper.make_node("Add", ["w1", "eps"], ["w2"]),  # constant scalar
        helper.make_node("Div", ["half", "w2"], ["w3"]),  # constant of shape [1], first operand
        helper.make_node("Max", ["w3", "floor", "lr"], ["w4"]),
        helper.make_node("Greater", ["col", "lr"], ["mask"]),
        helper.make_node("Where", ["mask", "col", "eps"], ["col2"]),
        helper.make_node("Mul", ["row", "lr"], ["row2"]),  # last axis 8: left alone
    ]
    inputs = [helper.make_tensor_value_info(n, F, s)
              for n, s in (("w", [16, 8, 1, 1]), ("lr", []), ("col", ["N", 1]), ("row", [4, 8]))]
    outputs = [helper.make_tensor_value_info(n, F, s) for n, s in (("w4", [16, 8, 1, 1]), ("col2", ["N", 1]),
                                                                    ("row2", [4, 8]))]
    inits = [numpy_helper.from_array(np.array(1e-3, np.float32), "eps"),
             numpy_helper.from_array(np.array([0.5], np.float32), "half"),
             numpy_helper.from_array(np.array([[-2.0]], np.float32), "floor")]
    model = helper.make_model(helper.make_graph(nodes, "update", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", opset)])
    rng = np.random.default_rng(0)
    feeds = {"w": rng.standard_normal((16, 8, 1, 1)).astype(np.float32), "lr": np.array(0.3, np.float32),
             "col": rng.standard_normal((32, 1)).astype(np.float32),
             "row": rng.standard_normal((4, 8)).astype(np.float32)}
    return model, feeds


@pytest.mark.parametrize("opset", [11, 17])
def test_operands_take_the_output_rank_with_the_same_bits(opset: int) -> None:
    model, feeds = update_like(opset)
    new = rewrite_for_onnxruntime(model)
    assert new is not model
    onnx.checker.check_model(new, full_check=True)
    types = value_types(new)
    for n in new.graph.node:
        out = static_shape(types, n.output[0])
        if n.op_type == "Unsqueeze" or not out or out[-1] != 1:
            continue
        assert {len(static_shape(types, i)) for i in n.input if i} == {len(out)}, n.name
    row = next(n for n in new.graph.node if n.output[0] == "row2")
    assert list(row.input) == ["row", "lr"]
    # one Unsqueeze per run-time value and rank, shared by the nodes reading it: lr at rank 4 and at rank 2
    unsqueezed = [(n.input[0], len(static_shape(types, n.output[0]))) for n in new.graph.node
                  if n.op_type == "Unsqueeze"]
    assert sorted(unsqueezed) == [("lr", 2), ("lr", 4)]
    read = {i for n in new.graph.node for i in n.input}
    assert [t.name for t in new.graph.initializer if t.name not in read] == []
    for want, got in zip(run(model, feeds), run(new, feeds)):
        assert want.shape == got.shape
        np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))


def test_a_fed_initializer_stays_fed() -> None:
    """An initializer that is also a graph input may be fed: it goes through an Unsqueeze, not a copy."""
    model, feeds = update_like(17)
    model.graph.input.append(helper.make_tensor_value_info("eps", F, []))
    new = rewrite_for_onnxruntime(model)
    feeds["eps"] = np.array(0.25, np.float32)
    unsqueezed = {n.input[0] for n in new.graph.node if n.op_type == "Unsqueeze"}
    assert {"lr", "eps"} <= unsqueezed
    for want, got in zip(run(model, feeds), run(new, feeds)):
        np.testing.assert_array_equal(got, want)


def test_unknown_ranks_and_small_outputs_are_left_alone() -> None:
    nodes = [helper.make_node("Mul", ["a", "s"], ["y"]), helper.make_node("Add", ["b", "s"], ["z"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", F, None),
                                       helper.make_tensor_value_info("b", F, [4, 1]),
                                       helper.make_tensor_value_info("s", F, [])],
                          [helper.make_tensor_value_info(n, F, None) for n in ("y", "z")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    assert rewrite_for_onnxruntime(model) is model
