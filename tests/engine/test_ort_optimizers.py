"""onnxruntime optimizers the backend turns off where they would load a graph wrong, against torch and
onnxruntime with its optimizations off."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper

from onnxtrain import InferenceSession, SessionOptions
from onnxtrain.engine.ort_optimizers import disabled_optimizers
from onnxtrain.ir.builder import make_model
from onnxtrain.session import TrainingSession
from tests.session.helpers import params

ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")


def _options(backend: str) -> SessionOptions:
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", backend)
    return so


def _transposed_product(b_shape: list) -> onnx.ModelProto:
    a = helper.make_tensor_value_info("a", T.FLOAT, [3, 4])
    b = helper.make_tensor_value_info("b", T.FLOAT, b_shape)
    nodes = [helper.make_node("Transpose", ["a"], ["at"], perm=[1, 0]),
             helper.make_node("MatMul", ["at", "b"], ["y"])]
    y = helper.make_tensor_value_info("y", T.FLOAT, None)
    return make_model(helper.make_graph(nodes, "g", [a, b], [y]), 17)


@pytest.mark.parametrize("b_shape", [[3], ["n"], [3, 2]])
def test_a_transposed_matrix_by_a_vector(b_shape: list) -> None:
    """MatMul(Transpose(A), v) with v 1-D: onnxruntime's MatmulTransposeFusion made it a FusedMatMul whose
    CPU kernel gave wrong values (3.5 off in a (3, 4) Aᵀ·v); the backend turns the fusion off for it (and
    only where the second operand may be 1-D)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.standard_normal((3,) if len(b_shape) == 1 else (3, 2)).astype(np.float32)
    model = _transposed_product(b_shape)
    y = InferenceSession(model.SerializeToString(), _options("onnxruntime")).run(None, {"a": a, "b": b})[0]
    np.testing.assert_allclose(y, a.T @ b, rtol=1e-5, atol=1e-6)
    assert ("MatmulTransposeFusion" in disabled_optimizers(model)) == (len(b_shape) == 1)


def _vector_weight_model() -> onnx.ModelProto:
    """loss = sum((Xᵀ·w + c)²) with a vector weight w and X fed transposed (4, n)."""
    x = helper.make_tensor_value_info("x", T.FLOAT, [4, "n"])
    w = helper.make_tensor("w", T.FLOAT, [4], [0.5, -0.25, 0.75, 0.1])
    c = helper.make_tensor("c", T.FLOAT, [], [0.3])
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
             helper.make_node("MatMul", ["xt", "w"], ["xw"]), helper.make_node("Add", ["xw", "c"], ["y"]),
             helper.make_node("Mul", ["y", "y"], ["sq"]),
             helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0)]
    loss = helper.make_tensor_value_info("loss", T.FLOAT, [])
    graph = helper.make_graph(nodes, "vector_weight", [x], [loss], [w, c])
    return make_model(graph, 17)


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_a_vector_weight_trains_as_in_torch(backend: str) -> None:
    """The legacy session's SGD steps of a model with a 1-D MatMul weight and a transposed input: on the
    backend its forward went through the fused kernel above."""
    rng = np.random.default_rng(1)
    model = _vector_weight_model().SerializeToString()
    sess = TrainingSession(model, params("SGDOptimizer"), _options(backend))
    w = torch.tensor([0.5, -0.25, 0.75, 0.1], dtype=torch.float64, requires_grad=True)
    c = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    lr = 0.01
    for _ in range(3):
        x = rng.standard_normal((4, 5)).astype(np.float32)
        loss = sess.run(["loss"], {"x": x, "Learning_Rate": np.array([lr], np.float32)})[0]
        ref = ((torch.tensor(x.T, dtype=torch.float64) @ w + c) ** 2).sum()
        ref.backward()
        with torch.no_grad():
            for t in (w, c):
                t -= lr * t.grad
                t.grad = None
        np.testing.assert_allclose(loss, ref.item(), rtol=1e-5)
        np.testing.assert_allclose(sess.get_state()["w"], w.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opset", [12, 13])
def test_a_float64_relu_then_clip_loads(opset: int) -> None:
    """A Relu feeding a float64 Clip with a constant lower bound: onnxruntime's FuseReluClip refused the
    bound's type ('Unexpected data type for Clip 'min' input of 11') and the backend could not load the
    model; it turns that rule off, and the values are onnxruntime's with its optimizations off."""
    x = helper.make_tensor_value_info("x", T.DOUBLE, [7])
    bounds = [helper.make_tensor("lo", T.DOUBLE, [], [-1.0]), helper.make_tensor("hi", T.DOUBLE, [], [0.5])]
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Clip", ["r", "lo", "hi"], ["y"])]
    y64 = helper.make_tensor_value_info("y", T.DOUBLE, None)
    model = make_model(helper.make_graph(nodes, "g", [x], [y64], bounds), opset)
    feed = {"x": np.linspace(-2.0, 2.0, 7)}
    y = InferenceSession(model.SerializeToString(), _options("onnxruntime")).run(None, feed)[0]
    plain = ort.SessionOptions()
    plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    oracle = ort.InferenceSession(model.SerializeToString(), plain, providers=["CPUExecutionProvider"])
    ref = oracle.run(None, feed)[0]
    np.testing.assert_array_equal(y, ref)
    assert "FuseReluClip" in disabled_optimizers(model)
    floats = [helper.make_node("Cast", ["x"], ["x32"], to=T.FLOAT), helper.make_node("Relu", ["x32"], ["r"]),
              helper.make_node("Clip", ["r", "lo32"], ["y"])]
    y32 = helper.make_tensor_value_info("y", T.FLOAT, None)
    lo32 = helper.make_tensor("lo32", T.FLOAT, [], [-1.0])
    floats = make_model(helper.make_graph(floats, "g", [x], [y32], [lo32]), opset)
    assert "FuseReluClip" not in disabled_optimizers(floats)


def _pad_between_transposes(opset: int, fed: bool) -> onnx.ModelProto:
    """Transpose → Pad over two of its axes (an axes input) → Transpose back."""
    x = helper.make_tensor_value_info("x", T.FLOAT, [2, 3, 4, 5])
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 3, 1]),
             helper.make_node("Pad", ["t", "pads", "", "axes"], ["p"]),
             helper.make_node("Transpose", ["p"], ["y"], perm=[0, 3, 1, 2])]
    pads = helper.make_tensor("pads", T.INT64, [4], [1, 2, 0, 3])
    axes = helper.make_tensor("axes", T.INT64, [2], [1, 3])
    inputs = [x, helper.make_tensor_value_info("pads", T.INT64, [4])] if fed else [x]
    y = helper.make_tensor_value_info("y", T.FLOAT, None)
    return make_model(helper.make_graph(nodes, "g", inputs, [y], [axes] if fed else [pads, axes]), opset)


@pytest.mark.parametrize("opset", [18, 21])
@pytest.mark.parametrize("fed", [False, True])
def test_a_pad_over_some_axes_between_transposes_runs(opset: int, fed: bool) -> None:
    """onnxruntime 1.32's transpose optimizer, moving a Transpose through a Pad that has an axes input,
    permutes the pads as if they covered every axis: the Gather it inserts failed at run time ('indices
    element out of data bounds') at every optimization level, on the backend too. The backend turns it
    off for graphs with such a Pad and a Transpose; the values are onnxruntime's with its optimizations
    off."""
    model = _pad_between_transposes(opset, fed)
    x = np.random.default_rng(2).standard_normal((2, 3, 4, 5)).astype(np.float32)
    feed = {"x": x, **({"pads": np.array([1, 2, 0, 3], np.int64)} if fed else {})}
    y = InferenceSession(model.SerializeToString(), _options("onnxruntime")).run(None, feed)[0]
    plain = ort.SessionOptions()
    plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    oracle = ort.InferenceSession(model.SerializeToString(), plain, providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(y, oracle.run(None, feed)[0])
    # no Transpose, or a Pad of every axis: the optimizer stays on
    untransposed = onnx.ModelProto()
    untransposed.CopyFrom(model)
    for n in untransposed.graph.node:
        if n.op_type == "Transpose":
            n.op_type = "Identity"
            del n.attribute[:]
    assert "TransposeOptimizer" in disabled_optimizers(model)
    assert "TransposeOptimizer" not in disabled_optimizers(untransposed)
    whole = onnx.ModelProto()
    whole.CopyFrom(model)
    del whole.graph.node[1].input[2:]
    assert "TransposeOptimizer" not in disabled_optimizers(whole)
