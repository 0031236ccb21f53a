"""Legacy optimizers on edge models against float64 formulas written from onnxruntime's kernels.

onnxruntime's AdamOptimizer and LambOptimizer kernels take float16 weights with float moments and compute
the step in float (orttraining/training_ops/cuda/optimizer/adam_impl.cu, lamb_impl.cu: the ``T4``/``T2``
compute types), casting only the new weight back to float16. The oracle here does the same in float64.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingSession
from tests.session.helpers import backend_options, params

LR = 0.01
NAMES = ("W", "b")


def _half_model(w0: np.ndarray, b0: np.ndarray):
    """loss = mean((x·Wᵀ + b)²), everything float16."""
    g = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "b"], ["lo"], transB=1),
         helper.make_node("Mul", ["lo", "lo"], ["l2"]),
         helper.make_node("ReduceMean", ["l2"], ["loss"], keepdims=0)], "half",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["N", 3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT16, [])],
        [numpy_helper.from_array(w0, "W"), numpy_helper.from_array(b0, "b")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _grads(w: np.ndarray, b: np.ndarray, x: np.ndarray) -> dict[str, np.ndarray]:
    """d mean((x·Wᵀ + b)²) / d(W, b) in float64."""
    lo = x @ w.T + b
    d = 2.0 * lo / lo.size
    return {"W": d.T @ x, "b": d.sum(0)}


def _adam(w, g, m1, m2, t, lr, a=0.9, b=0.999, eps=1e-8):
    """Adam mode 0 with bias correction, α and β as the kernel's float32 attributes."""
    a, b = float(np.float32(a)), float(np.float32(b))
    m1 = a * m1 + (1 - a) * g
    m2 = b * m2 + (1 - b) * g * g
    c1, c2 = 1 - a**t, 1 - b**t
    return w - lr * (m1 / c1) / (np.sqrt(m2 / c2) + eps), m1, m2


def _lamb(w, g, m1, m2, lr, a=0.9, b=0.999, eps=1e-6):
    """Lamb without bias correction (the legacy builder's default) and unbounded trust ratio."""
    a, b = float(np.float32(a)), float(np.float32(b))
    m1 = a * m1 + (1 - a) * g
    m2 = b * m2 + (1 - b) * g * g
    d = m1 / (np.sqrt(m2) + eps)
    wn, dn = np.linalg.norm(w), np.linalg.norm(d)
    ratio = wn / dn if wn > 0 and dn > 0 else 1.0
    return w - lr * ratio * d, m1, m2


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
@pytest.mark.parametrize("opt", ["AdamOptimizer", "LambOptimizer"])
@pytest.mark.parametrize("clip", [None, 1e-4])
def test_half_weights_step_in_float_with_float_moments(opt: str, backend: str, clip: float | None) -> None:
    """Small gradients (|g| ≈ 1e-3) of a float16 model: (1 − β)·g² is below float16's range and Adam's
    epsilon (1e-8) is 0 in float16, so an update computed in float16 divided m1 by 0 (inf weights on the
    numpy engine). The step must follow the float formulas, 5 steps, with and without a clipping limit
    that the gradients exceed (the divisor then N / max_norm_clip)."""
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((2, 3)).astype(np.float16)
    b0 = np.full(2, 0.5, np.float16)
    kw = {"enable_grad_norm_clip": clip is not None}
    if clip is not None:
        kw["optimizer_attributes_map"] = {n: {"max_norm_clip": clip} for n in NAMES}
    model = _half_model(w0, b0)
    sess = TrainingSession(model.SerializeToString(), params(opt, **kw), backend_options(backend))
    m1 = {"W": np.zeros((2, 3)), "b": np.zeros(2)}
    m2 = {"W": np.zeros((2, 3)), "b": np.zeros(2)}
    clipped = False
    for t in range(1, 6):
        x = (rng.standard_normal((8, 3)) * 1e-3).astype(np.float16)
        before = {k: v.astype(np.float64) for k, v in sess.get_state().items() if k in NAMES}
        g = _grads(before["W"], before["b"], x.astype(np.float64))
        if clip is not None:
            norm = np.sqrt(sum(np.sum(v * v) for v in g.values()))
            if norm > clip:
                clipped = True
                g = {k: v * (clip / norm) for k, v in g.items()}
        sess.run(["loss"], {"x": x, "Learning_Rate": np.array([LR], np.float32)})
        state = sess.get_state()
        for k in NAMES:
            if opt == "AdamOptimizer":
                want, m1[k], m2[k] = _adam(before[k], g[k], m1[k], m2[k], t, LR)
            else:
                want, m1[k], m2[k] = _lamb(before[k], g[k], m1[k], m2[k], LR)
            got = state[k]
            assert got.dtype == np.float16
            assert np.isfinite(got).all(), f"step {t}: {k} = {got}"
            # the float16 forward pass gives gradients within ~1e-3 relative; the weight rounds to float16
            np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-3, atol=2e-3,
                                       err_msg=f"step {t}, {k}")
            np.testing.assert_allclose(state[f"Moment_1_{k}"], m1[k], rtol=2e-2, atol=1e-9,
                                       err_msg=f"step {t}, Moment_1_{k}")
            np.testing.assert_allclose(state[f"Moment_2_{k}"], m2[k], rtol=5e-2, atol=1e-14,
                                       err_msg=f"step {t}, Moment_2_{k}")
            m1[k], m2[k] = (state[f"Moment_{i}_{k}"].astype(np.float64) for i in (1, 2))
    assert clipped == (clip is not None)
