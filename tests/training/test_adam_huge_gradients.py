"""Adam's second moment forms ((1 − β₂)·g)·g, as onnxruntime-training's kernel and torch's addcmul do: g·g
first overflowed float32 from |g| ≈ 1.8e19, the moment became inf for good and the weight never moved again
(AdamW of the on-device API and the legacy session's Adam alike). Checked against the float64 formula, which
onnxruntime-training 1.19.2 follows to 1e-6 here (0.4, 0.333, 0.281, 0.2388 for the first weight)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain

_W0 = np.array([0.5, -0.25], np.float32)
_GRADS = (1e20, 1.0, 1.0, 1.0)


def _model() -> onnx.ModelProto:
    """loss = Σ W·C: the gradient of W is C, fed."""
    g = helper.make_graph([helper.make_node("Mul", ["W", "C"], ["P"]),
                           helper.make_node("ReduceSum", ["P"], ["loss"], keepdims=0)], "g",
                          [helper.make_tensor_value_info("C", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          [numpy_helper.from_array(_W0, "W")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _adamw_float64(lr: float = 0.1, eps: float = 1e-8) -> list[np.ndarray]:
    w, m, v, out = _W0.astype(np.float64), 0.0, 0.0, []
    for t, g in enumerate(_GRADS, 1):
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
        w = w - lr * np.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t) * m / (np.sqrt(v) + eps)
        out.append(w)
    return out


def test_on_device_adamw_keeps_stepping_after_a_huge_gradient(tmp_path) -> None:
    from onnxtrain.training import api, artifacts, onnxblock

    artifacts.generate_artifacts(_model(), requires_grad=["W"], loss=None,
                                 optimizer=onnxblock.optim.AdamW(eps=1e-8), artifact_directory=tmp_path)
    state = api.CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    module = api.Module(str(tmp_path / "training_model.onnx"), state)
    opt = api.Optimizer(str(tmp_path / "optimizer_model.onnx"), module)
    opt.set_learning_rate(0.1)
    for g, want in zip(_GRADS, _adamw_float64()):
        module(np.full(2, g, np.float32))
        opt.step()
        module.lazy_reset_grad()
        np.testing.assert_allclose(state.parameters["W"].data, want, rtol=1e-5)


@pytest.mark.parametrize("options", [{"legacy_cpu_adam": True}, {"enable_grad_norm_clip": False}])
def test_legacy_adam_keeps_a_finite_second_moment(options) -> None:
    p = onnxtrain.TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "AdamOptimizer"
    for k, v in options.items():
        setattr(p, k, v)
    sess = onnxtrain.TrainingSession(_model().SerializeToString(), p)
    seen = []
    for g in _GRADS:
        sess.run(["loss"], {"C": np.full(2, g, np.float32), "Learning_Rate": np.array([0.1], np.float32)})
        seen.append(sess.get_state()["W"].copy())
    moment = sess.get_state()["Moment_2_W"]
    beta = float(np.float32(0.999))  # (as onnxruntime holds it)
    want = (1 - beta) * 1e40
    for _ in _GRADS[1:]:
        want = beta * want + (1 - beta)
    np.testing.assert_allclose(moment, [want, want], rtol=1e-5)  # (inf before)
    assert np.all(np.diff(np.stack(seen)[:, 0]) < 0), seen  # every step moves the weight down (it stopped)
