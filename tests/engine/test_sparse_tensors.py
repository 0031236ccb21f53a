"""Sparse tensors (``graph.sparse_initializer``, ``Constant``'s ``sparse_value``, COO indices flat or per
axis, in the main graph and in a body) are made dense at load, as onnxruntime makes them: they were "not
produced by any earlier node" (numpy engine, legacy session), "not a value of the graph"
(GradientGraphBuilder) or "Constant with sparse_value is not supported". Oracles: onnxruntime's outputs
(it fails on the sparse Constant in a body: "Unsupported type proto value case"), the dense product, the
gradient's formula and a float64 SGD step."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain

_X = np.arange(6, dtype=np.float32).reshape(2, 3)
_DENSE = np.array([[1.5, 0.0], [0.0, -2.0], [0.0, 3.0]], np.float32)


def _sparse(flat: bool) -> onnx.SparseTensorProto:
    values = numpy_helper.from_array(np.array([1.5, -2.0, 3.0], np.float32), "W")
    indices = np.array([0, 3, 5]) if flat else np.array([[0, 0], [1, 1], [2, 1]])
    return helper.make_sparse_tensor(values, numpy_helper.from_array(indices.astype(np.int64), "W_i"), [3, 2])


def _model(kind: str) -> bytes:
    """loss = Σ x @ W, W sparse: an initializer (indices flat or per axis), a Constant, or a Constant in an
    If branch."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"]),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])]
    out_w = helper.make_tensor_value_info("W", TensorProto.FLOAT, [3, 2])
    if kind == "constant":
        nodes.insert(0, helper.make_node("Constant", [], ["W"], sparse_value=_sparse(True)))
    elif kind == "constant in a body":
        branch = helper.make_graph([helper.make_node("Constant", [], ["W"], sparse_value=_sparse(False))],
                                   "b", [], [out_w])
        nodes.insert(0, helper.make_node("If", ["c"], ["W"], then_branch=branch, else_branch=branch))
        inputs.append(helper.make_tensor_value_info("c", TensorProto.BOOL, []))
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2]),
                                               helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    if kind.startswith("initializer"):
        g.sparse_initializer.append(_sparse(kind == "initializer, flat indices"))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    # (ONNX's shape inference gives sparse tensors no rank: the full check refuses the MatMul after them)
    onnx.checker.check_model(m)
    return m.SerializeToString()


_KINDS = ["initializer, flat indices", "initializer, indices per axis", "constant", "constant in a body"]


def _feeds(kind: str) -> dict[str, np.ndarray]:
    return {"x": _X, **({"c": np.array(True)} if kind == "constant in a body" else {})}


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
@pytest.mark.parametrize("kind", _KINDS)
def test_sparse_tensors_run_as_onnxruntime_runs_them(kind, backend) -> None:
    want = _X @ _DENSE
    if kind != "constant in a body":
        ran = ort.InferenceSession(_model(kind), providers=["CPUExecutionProvider"]).run(["y"], _feeds(kind))
        np.testing.assert_allclose(ran[0], want, rtol=1e-6)
    options = onnxtrain.SessionOptions()
    options.add_session_config_entry("onnxtrain.backend", backend)
    got = onnxtrain.InferenceSession(_model(kind), options).run(["y"], _feeds(kind))[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("kind", _KINDS[:2])
def test_a_sparse_initializer_is_differentiated_and_trained(kind) -> None:
    builder = onnxtrain.GradientGraphBuilder(_model(kind), {"loss"}, {"W"}, "loss")
    builder.build()
    onnx.checker.check_model(onnx.load_from_string(builder.get_model()), full_check=True)
    grad = onnxtrain.InferenceSession(builder.get_model()).run(["W_grad"], {"x": _X})[0]
    want = np.repeat(_X.sum(0)[:, None], 2, axis=1)  # d/dW Σ x @ W = Σ_rows x, for each column
    np.testing.assert_array_equal(grad, want)
    p = onnxtrain.TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    sess = onnxtrain.TrainingSession(_model(kind), p)
    sess.run(None, {"x": _X, "Learning_Rate": np.array([0.1], np.float32)})
    np.testing.assert_allclose(sess.get_state()["W"], _DENSE.astype(np.float64) - 0.1 * want, rtol=1e-6)
