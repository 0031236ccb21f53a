"""Gradients over an empty batch (the last, empty, slice of a data split; a filtered batch): a training-mode
BatchNormalization's scale got NaN (its 1/σ over nothing times a sum over nothing), so one empty step made
the scale, then every weight, NaN; GlobalMaxPool's gradient graph could not run (a Reshape's -1 with
nothing to divide). Oracles: torch autograd (weight gradients 0 over an empty batch) and plain onnxruntime
running the same gradient graphs."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import onnxtrain
from onnxtrain.autodiff import build_gradient_model
from tests.session.helpers import backend_options, params

torch = pytest.importorskip("torch")
CPU = ["CPUExecutionProvider"]
S0, B0 = np.array([1.0, 1.5, 0.5], np.float32), np.array([0.1, -0.2, 0.3], np.float32)


def _batch_norm() -> onnx.ModelProto:
    stats = {"s": S0, "b": B0, "rm": np.zeros(3, np.float32), "rv": np.ones(3, np.float32)}
    g = helper.make_graph(
        [helper.make_node("BatchNormalization", ["x", "s", "b", "rm", "rv"], ["y", "rm_o", "rv_o"],
                          training_mode=1),
         helper.make_node("Mul", ["y", "y"], ["y2"]),
         helper.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0)],
        "g", [helper.make_tensor_value_info("x", T.FLOAT, ["B", 3])],
        [helper.make_tensor_value_info("loss", T.FLOAT, [])],
        [numpy_helper.from_array(v, k) for k, v in stats.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 15)], ir_version=9)


@pytest.mark.parametrize("batch", [0, 4])
def test_batch_norm_weight_gradients_over_an_empty_batch_are_zero(batch: int) -> None:
    x = np.random.default_rng(0).standard_normal((batch, 3)).astype(np.float32)
    ts, tb = torch.tensor(S0, requires_grad=True), torch.tensor(B0, requires_grad=True)
    (torch.nn.functional.batch_norm(torch.tensor(x), None, None, ts, tb, training=True) ** 2).sum().backward()
    gm = build_gradient_model(_batch_norm(), "loss", ["s", "b"]).SerializeToString()
    for session in (onnxtrain.InferenceSession(gm), ort.InferenceSession(gm, providers=CPU)):
        s_grad, b_grad = session.run(["s_grad", "b_grad"], {"x": x})
        np.testing.assert_allclose(s_grad, ts.grad.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(b_grad, tb.grad.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_a_legacy_step_over_an_empty_batch_keeps_the_weights(backend: str) -> None:
    s = onnxtrain.TrainingSession(_batch_norm().SerializeToString(), params(), backend_options(backend))
    s.run(["loss"], {"x": np.zeros((0, 3), np.float32), "Learning_Rate": np.array([0.1], np.float32)})
    np.testing.assert_array_equal(s.get_state()["s"], S0)
    np.testing.assert_array_equal(s.get_state()["b"], B0)


@pytest.mark.parametrize("batch", [0, 2])
def test_global_max_pool_gradient_runs_over_an_empty_batch(batch: int) -> None:
    w = np.array([0.5, -1.0, 2.0], np.float32)
    g = helper.make_graph(
        [helper.make_node("GlobalMaxPool", ["x"], ["p"]), helper.make_node("Flatten", ["p"], ["f"]),
         helper.make_node("MatMul", ["f", "w"], ["z"]),
         helper.make_node("ReduceSum", ["z"], ["loss"], keepdims=0)],
        "g", [helper.make_tensor_value_info("x", T.FLOAT, ["N", 2, 3, 3])],
        [helper.make_tensor_value_info("loss", T.FLOAT, [])],
        [numpy_helper.from_array(np.tile(w[:2, None], (1, 3)).astype(np.float32), "w")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    gm = build_gradient_model(model, "loss", ["x", "w"])
    onnx.checker.check_model(gm, full_check=True)
    x = np.random.default_rng(1).standard_normal((batch, 2, 3, 3)).astype(np.float32)
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(numpy_helper.to_array(g.initializer[0]),
                                                               requires_grad=True)
    (torch.nn.functional.adaptive_max_pool2d(tx, 1).flatten(1) @ tw).sum().backward()
    data = gm.SerializeToString()
    for session in (onnxtrain.InferenceSession(data), ort.InferenceSession(data, providers=CPU)):
        x_grad, w_grad = session.run(["x_grad", "w_grad"], {"x": x})
        np.testing.assert_allclose(x_grad, tx.grad.numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(w_grad, tw.grad.numpy(), rtol=1e-6, atol=1e-6)


def test_average_pool_over_no_position_is_a_gradient_error_naming_the_node() -> None:
    """A static spatial size the kernel does not fit (0 here): a bare IndexError from the rule before."""
    from onnxtrain.autodiff import GradientError

    g = helper.make_graph([helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[2], name="pool"),
                           helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)], "g",
                          [helper.make_tensor_value_info("x", T.FLOAT, [1, 2, 0])],
                          [helper.make_tensor_value_info("loss", T.FLOAT, [])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with pytest.raises(GradientError, match=r"node 'pool' \(AveragePool\): the pooled output has no "
                                            r"positions \(spatial size \[0\], kernel \[2\]\)"):
        build_gradient_model(model, "loss", ["x"])
