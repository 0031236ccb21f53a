"""Legacy sessions of float64 models with the default settings (gradient-norm clipping on): the norm,
the clipping and the accumulation barrier are computed in float64, Adam's moments kept in float64, and
the steps equal float64 numpy references to float64 precision (a float32 step or moment could not)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain import RunOptions, TrainingSession
from tests.session.helpers import adam_ref, params

LR = np.array([0.1], np.float32)
W0 = np.linspace(-1.0, 1.5, 6).reshape(3, 2)


def _model() -> onnx.ModelProto:
    """loss = Σ (x·W)², x [4, 3] and W [3, 2] of float64."""
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
         helper.make_node("ReduceSumSquare", ["h"], ["loss"], keepdims=0, name="square_sum")], "f64",
        [helper.make_tensor_value_info("x", T.DOUBLE, [4, 3])],
        [helper.make_tensor_value_info("loss", T.DOUBLE, [])],
        [numpy_helper.from_array(W0.copy(), "W")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _grad(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return 2 * x.T @ (x @ w)  # d Σ (xW)² / dW


def _batches(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.standard_normal((4, 3)) for _ in range(n)]


def test_sgd_step_and_norm_are_float64() -> None:
    sess = TrainingSession(_model().SerializeToString(), params(weights_to_train={"W"}))
    assert {o.name: o.type for o in sess.get_outputs()}["global_gradient_norm"] == "tensor(double)"
    w = W0.copy()
    for x in _batches(3):
        g = _grad(x, w)
        loss, norm = sess.run(["loss", "global_gradient_norm"], {"x": x, "Learning_Rate": LR})
        assert loss.dtype == norm.dtype == np.float64
        np.testing.assert_allclose(loss, ((x @ w) ** 2).sum(), rtol=1e-13)
        np.testing.assert_allclose(norm, np.sqrt((g * g).sum()), rtol=1e-13)
        w = w - float(LR[0]) * g  # SGD does not clip
    np.testing.assert_allclose(sess.get_state()["W"], w, rtol=1e-13)


@pytest.mark.parametrize("steps", [1, 2])
def test_adam_with_clipping_and_accumulation_is_float64(steps: int) -> None:
    """Adam clips by the global norm (max_norm_clip 1: every step here is clipped); with two accumulation
    steps the update reads the mean of two micro-batches' gradients."""
    sess = TrainingSession(_model().SerializeToString(), params("AdamOptimizer", weights_to_train={"W"},
                                                                 gradient_accumulation_steps=steps))
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    w, m1, m2 = W0.copy(), np.zeros_like(W0), np.zeros_like(W0)
    batches = _batches(3 * steps)
    for t in range(3):
        micro = batches[t * steps:(t + 1) * steps]
        for x in micro[:-1]:
            flag = sess.run(["Group_Accumulated_Gradients"], {"x": x, "Learning_Rate": LR}, ro)[0]
            assert flag.tolist() == [True]
        sess.run(["loss"], {"x": micro[-1], "Learning_Rate": LR})
        g = sum(_grad(x, w) for x in micro) / steps
        norm = np.sqrt((g * g).sum())
        assert norm > 1.0
        w, m1, m2 = adam_ref(w, g / norm, m1, m2, t + 1, float(LR[0]), f32=False)
    state = sess.get_state()
    np.testing.assert_allclose(state["W"], w, rtol=1e-13)
    assert state["Moment_1_W"].dtype == state["Moment_2_W"].dtype == np.float64  # as torch keeps them
    np.testing.assert_allclose(state["Moment_1_W"], m1, rtol=1e-13)
    np.testing.assert_allclose(state["Moment_2_W"], m2, rtol=1e-13)


def test_float32_moments_saved_before_load_into_float64_ones() -> None:
    """A float64 weight's Adam moments were kept in float32 before; such a saved state still loads (the
    float32 values cast up without loss), and a float64 state loads as it is."""
    sess = TrainingSession(_model().SerializeToString(), params("AdamOptimizer", weights_to_train={"W"}))
    m1 = np.linspace(0, 1, 6, dtype=np.float32).reshape(3, 2)
    sess.load_state({"Moment_1_W": m1})
    got = sess.get_state()["Moment_1_W"]
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, m1.astype(np.float64))
