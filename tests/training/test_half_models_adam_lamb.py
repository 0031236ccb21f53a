"""Adam and Lamb of the legacy session on a model whose own weights are float16 or bfloat16 (no mixed
precision), with and without clipping and accumulation: each step widens the half weight and gradient to
float32, keeps float32 moments, and rounds the new weight to its type once (onnxruntime's Adam and Lamb
kernels compute in float and cast on store; the CPU ones take float only).

Oracle: torch in float32 on the step's inputs read from the session (weights, float32 moments, counts), with
the legacy formulas (Adam mode 0, bias correction on, ε·sqrt(1 − β₂ᵗ) on the uncorrected root; Lamb without
bias correction, trust ratio ‖w‖/‖d‖) and the global-norm clipping divisor max(1, ‖g‖/max_norm) in float32
(‖g‖ the session's global_gradient_norm, which is float64's within float32 rounding). The new weight is
within one unit of the half type's last place of the oracle's (the float32 operations' order differs);
moments within float32 rounding of their terms. Gradients of norm up to
2.5e5 (past float16's 65504) give a finite global norm equal to float64's within float32 rounding."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import SessionOptions, TrainingParameters, TrainingSession

NP = {TensorProto.FLOAT16: np.float16, TensorProto.BFLOAT16: ml_dtypes.bfloat16}
N = 4096


def F32(x: float) -> float:  # noqa: N802 - the kernels' float attribute, as a Python float
    return float(np.float32(x))


def _model(et: int, w: np.ndarray) -> onnx.ModelProto:
    """loss = ReduceSum(W · G): W's gradient is the feed G, exactly."""
    nodes = [helper.make_node("Mul", ["W", "G"], ["p"]),
             helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "wg", [helper.make_tensor_value_info("G", et, [N])],
                          [helper.make_tensor_value_info("loss", et, [])], [numpy_helper.from_array(w, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _ulps(got: np.ndarray, want: np.ndarray) -> int:
    """The largest distance in units of the half type's last place (same-sign values; 0 ↔ −0 is 0)."""
    def key(a: np.ndarray) -> np.ndarray:
        i = a.view(np.uint16).astype(np.int64)
        return np.where(i >= 0x8000, 0x8000 - i, i)
    return int(np.abs(key(got) - key(want)).max())


def _clip(g: torch.Tensor, norm: np.ndarray | None) -> torch.Tensor:
    """g over the legacy clipping divisor max(1, ‖g‖ / 1.0), float32, of the session's norm (checked against
    float64's apart: summation orders differ in float32's last places)."""
    if norm is None:
        return g
    n = torch.tensor(np.float32(norm).reshape(()))
    return g / torch.where(n > 1.0, n, torch.ones(()))


def _adam(w: torch.Tensor, g: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, t: int, lr: float,
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a, b, eps = F32(0.9), F32(0.999), F32(1e-8)  # float attributes of the kernel
    m1 = a * m1 + (1 - a) * g
    m2 = b * m2 + (1 - b) * g * g
    c1, c2 = 1 - a ** t, 1 - b ** t
    step = lr * np.sqrt(c2) / c1
    return w - step * m1 / (torch.sqrt(m2) + eps * np.sqrt(c2)), m1, m2


def _lamb(w: torch.Tensor, g: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, lr: float,
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a, b, eps = F32(0.9), F32(0.999), F32(1e-6)
    m1 = a * m1 + (1 - a) * g
    m2 = b * m2 + (1 - b) * g * g
    d = m1 / (torch.sqrt(m2) + eps)
    ratio = torch.linalg.vector_norm(w) / torch.linalg.vector_norm(d)
    return w - lr * ratio * d, m1, m2


CASES = [
    # (type, optimizer, clip, accumulation steps, backend, gradient scale)
    (TensorProto.FLOAT16, "AdamOptimizer", True, 1, "numpy", 0.1),
    (TensorProto.FLOAT16, "AdamOptimizer", True, 1, "numpy", 4000.0),  # ‖g‖ ≈ 2.5e5, past 65504
    (TensorProto.FLOAT16, "AdamOptimizer", False, 2, "numpy", 1e-3),
    (TensorProto.FLOAT16, "AdamOptimizer", True, 2, "onnxruntime", 0.1),
    (TensorProto.BFLOAT16, "AdamOptimizer", True, 2, "numpy", 4000.0),
    (TensorProto.BFLOAT16, "AdamOptimizer", False, 1, "numpy", 1e-3),
    (TensorProto.FLOAT16, "LambOptimizer", True, 1, "numpy", 4000.0),
    (TensorProto.FLOAT16, "LambOptimizer", False, 2, "onnxruntime", 1e-3),
    (TensorProto.BFLOAT16, "LambOptimizer", True, 2, "numpy", 0.1),
]
FP16_MOMENTS = [  # use_fp16_moments: moments kept in float16, read widened, stored rounded once
    (TensorProto.FLOAT16, "AdamOptimizer", True, 1, "numpy", 1e-3),
    (TensorProto.FLOAT16, "LambOptimizer", False, 2, "onnxruntime", 0.1),
    (TensorProto.BFLOAT16, "AdamOptimizer", True, 2, "numpy", 0.1),
]


@pytest.mark.parametrize(("et", "opt", "clip", "acc", "backend", "scale", "fp16_moments"),
                         [(*c, False) for c in CASES] + [(*c, True) for c in FP16_MOMENTS])
def test_half_weights_step_in_float32_and_round_once(et: int, opt: str, clip: bool, acc: int, backend: str,
                                                     scale: float, fp16_moments: bool) -> None:
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
        if et == TensorProto.BFLOAT16:
            pytest.skip("onnxruntime's CPU package has no bfloat16 kernels: the backend refuses the model")
    half = NP[et]
    rng = np.random.default_rng(11)
    w0 = (rng.standard_normal(N) * 0.05).astype(np.float32).astype(half)
    p = TrainingParameters()
    p.loss_output_name, p.training_optimizer_name = "loss", opt
    p.enable_grad_norm_clip = clip
    p.use_fp16_moments = fp16_moments
    kept = np.float16 if fp16_moments else np.float32
    if acc > 1:
        p.gradient_accumulation_steps, p.gradient_accumulation_mode = acc, "auto"
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", backend)
    sess = TrainingSession(_model(et, w0).SerializeToString(), p, so)
    lr = 1e-3
    feeds = {"Learning_Rate": np.array([lr], np.float32)}
    moments = ("Moment_1_W", "Moment_2_W")
    for t in range(1, 4):
        before = sess.get_state()
        assert before["W"].dtype == half
        assert all(before[k].dtype == kept for k in moments)  # float32 moments unless use_fp16_moments
        gs = [(rng.standard_normal(N) * scale).astype(np.float32).astype(half) for _ in range(acc)]
        norm = None
        for k, g in enumerate(gs):
            fetch = ["loss", "global_gradient_norm"] if clip and k == acc - 1 else ["loss"]
            out = sess.run(fetch, {"G": g, **feeds})
            if len(out) == 2:
                norm = out[1]
        # the update's gradient: the micro-steps' float32 sum × 1/N, rounded to the weight's type
        mean = (sum(g.astype(np.float32) for g in gs) * np.float32(1 / acc)).astype(half)
        g32 = torch.tensor(mean.astype(np.float32))
        if clip:
            want_norm = float(np.sqrt(np.sum(mean.astype(np.float64) ** 2)))
            assert norm is not None and norm.dtype == np.float32 and np.isfinite(norm).all()
            assert float(norm) == pytest.approx(want_norm, rel=1e-5)
        g32 = _clip(g32, norm if clip else None)
        w32 = torch.tensor(before["W"].astype(np.float32))
        m1, m2 = (torch.tensor(before[k].astype(np.float32)) for k in moments)
        if opt == "AdamOptimizer":
            assert int(before["Update_Count_W"][0]) == t
            w_new, m1n, m2n = _adam(w32, g32, m1, m2, t, lr)
        else:
            w_new, m1n, m2n = _lamb(w32, g32, m1, m2, lr)
        after = sess.get_state()
        assert after["W"].dtype == half
        want = w_new.numpy().astype(half)
        assert np.count_nonzero(want.view(np.uint16) != before["W"].view(np.uint16)) > N // 4
        assert _ulps(after["W"], want) <= 1, (t, _ulps(after["W"], want))
        if fp16_moments:  # rounded once to float16, a second moment at least float16's smallest value
            tiny = float(np.finfo(np.float16).smallest_subnormal)
            for k, v in zip(moments, (m1n.numpy(), np.maximum(m2n.numpy(), tiny))):
                assert after[k].dtype == np.float16
                assert _ulps(after[k], v.astype(np.float16)) <= 1, (k, t)
            continue
        # moments within float32 rounding of their two terms (the first moment's may cancel)
        terms = (np.abs(F32(0.9) * m1.numpy()) + np.abs(F32(0.1) * g32.numpy()),
                 F32(0.999) * m2.numpy() + F32(1e-3) * g32.numpy() ** 2)
        for k, v, size in zip(moments, (m1n, m2n), terms):
            off = np.abs(after[k].astype(np.float64) - v.numpy()) - 4 * 2.0**-24 * size
            assert off.max() <= 0, (k, t, off.max())
