"""A float16 model's gradient graph from ``GradientGraphBuilder`` runs in plain onnxruntime: the scatters that
add (a Gather's gradient, cross-entropy's, a MaxPool's) are written in float32 with Casts around them, as
onnxruntime's CPU provider has no float16 kernel for them. Oracles: numpy (the gradient of a Gather with
repeated indices, summed in float32 and rounded once), onnxtrain's engine on the same graph."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import GradientGraphBuilder, InferenceSession

ort = pytest.importorskip("onnxruntime")


def _embedding_model() -> onnx.ModelProto:
    table = (np.arange(12, dtype=np.float32).reshape(4, 3) / 7).astype(np.float16)
    nodes = [helper.make_node("Gather", ["E", "ids"], ["e"]), helper.make_node("Mul", ["e", "w"], ["ew"]),
             helper.make_node("ReduceSum", ["ew"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"]),
                                       helper.make_tensor_value_info("w", TensorProto.FLOAT16, ["n", 3])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT16, [])],
                          [numpy_helper.from_array(table, "E")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_float16_embeddings_gradient_graph_runs_in_onnxruntime(tmp_path) -> None:
    b = GradientGraphBuilder(_embedding_model().SerializeToString(), {"loss"}, ["E"], "loss")
    b.build()
    b.save(tmp_path / "grad.onnx")
    built = onnx.load(tmp_path / "grad.onnx")
    onnx.checker.check_model(built, full_check=True)
    scatters = [n for n in built.graph.node if n.op_type.startswith("Scatter")]
    assert scatters and all(n.input[0].endswith("/float32") for n in scatters)
    rng = np.random.default_rng(0)
    ids = np.array([1, 1, 3, 1, 0], np.int64)  # repeated rows: their gradients add up
    w = rng.standard_normal((5, 3)).astype(np.float16)
    feeds = {"ids": ids, "w": w}
    want = np.zeros((4, 3), np.float32)
    np.add.at(want, ids, w.astype(np.float32))
    for level in (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
        so = ort.SessionOptions()
        so.graph_optimization_level = level
        got = ort.InferenceSession(built.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
            None, feeds)[1]
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got, want.astype(np.float16))
    ours = InferenceSession(built.SerializeToString()).run(None, feeds)[1]
    np.testing.assert_array_equal(ours, want.astype(np.float16))
