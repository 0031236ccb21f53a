"""Gradient graphs of the autodiff fuzzes run on onnxtrain's onnxruntime backend (its graph optimizations on),
against torch autograd and the numpy engine, and the onnxruntime optimizers the backend turns off for the
graphs among them that those optimizers load wrong."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain import InferenceSession, SessionOptions
from onnxtrain.autodiff import build_gradient_model
from onnxtrain.ir.builder import make_model

ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")


def _backend() -> SessionOptions:
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    return so


def _run(model: onnx.ModelProto, feeds: dict) -> dict:
    sess = InferenceSession(model.SerializeToString(), _backend())
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


# ---- FuseReluClip: a Clip bound that constant folding makes a float64 constant --------------------------
def _relu_clip(bound: str) -> onnx.ModelProto:
    """loss = Σ u·Clip(Relu(x·w), lo, 2) in float64, lo = 0.5 reached through ``bound`` (Expand to shape [],
    Identity or Cast of an initializer): only onnxruntime's constant folding makes it a constant."""
    inits = [numpy_helper.from_array(np.array(0.5), "half"), numpy_helper.from_array(np.array(2.0), "two"),
             numpy_helper.from_array(np.array([0.3, -1.2, 0.8, 1.5]), "w"),
             numpy_helper.from_array(np.array([1.0, 0.5, -0.7, 1.3]), "u"),
             numpy_helper.from_array(np.zeros(0, np.int64), "scalar")]
    lo = {"Expand": helper.make_node("Expand", ["half", "scalar"], ["lo"]),
          "Identity": helper.make_node("Identity", ["half"], ["lo"]),
          "Cast": helper.make_node("Cast", ["half"], ["lo"], to=T.DOUBLE)}[bound]
    nodes = [lo, helper.make_node("Mul", ["x", "w"], ["xw"]), helper.make_node("Relu", ["xw"], ["r"]),
             helper.make_node("Clip", ["r", "lo", "two"], ["y"]), helper.make_node("Mul", ["y", "u"], ["yu"]),
             helper.make_node("ReduceSum", ["yu"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "relu_clip", [helper.make_tensor_value_info("x", T.DOUBLE, [4])],
                              [helper.make_tensor_value_info("loss", T.DOUBLE, [])], inits)
    return make_model(graph, 17)


@pytest.mark.parametrize("bound", ["Expand", "Identity", "Cast"])
def test_relu_then_clip_by_a_folded_float64_bound(bound: str) -> None:
    """onnxruntime's FuseReluClip refused the model at load ("Unexpected data type for Clip 'min' input of
    11") when the float64 bound only became a constant by folding (the fuzz's gradient graphs of a Clip whose
    bound is an Expand of a constant, seeds 1897 and 1983): the forward and its gradient graph, on the
    backend, against torch."""
    model = _relu_clip(bound)
    x = np.array([0.9, 0.2, -1.0, 1.6])
    w = torch.tensor([0.3, -1.2, 0.8, 1.5], dtype=torch.float64, requires_grad=True)
    u = torch.tensor([1.0, 0.5, -0.7, 1.3], dtype=torch.float64)
    loss = (torch.clamp(torch.relu(torch.as_tensor(x) * w), 0.5, 2.0) * u).sum()
    loss.backward()
    np.testing.assert_allclose(_run(model, {"x": x})["loss"], loss.item(), rtol=1e-12)
    got = _run(build_gradient_model(model, "loss", ["w"]), {"x": x})
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-12)
    np.testing.assert_allclose(got["w_grad"], w.grad.numpy(), rtol=1e-12, atol=1e-15)
