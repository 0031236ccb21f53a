"""Sequences of on-device mixed-precision steps (``Module`` with a ``DynamicLossScaler``, ``Optimizer`` of
AdamW with ClipGradNorm, ``LinearLRScheduler``) against a float64 numpy reimplementation: the gradient
buffers hold the sum of the micro-batches' loss-scaled gradients; the optimizer model unscales, clips by the
global norm of the unscaled gradients (on-device spec §1.8, onnxblock's ClipGradNorm) and skips a step whose
gradients are not all finite (parameters, moments and ``step_count`` kept, so the learning-rate schedule,
read from ``step_count``, does not advance); the scaler follows onnxruntime's ``DynamicLossScaler``. A
checkpoint saved after a skipped step resumes the run identically (the scaler's state included).
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
from onnx import numpy_helper

from onnxtrain.graph_transforms.loss_scaler import DynamicLossScaler
from onnxtrain.training import artifacts, onnxblock
from onnxtrain.training.api import CheckpointState, LinearLRScheduler, Module, Optimizer
from tests.session.test_loss_scaling_sequences import HALF_MAX, tanh_model

MAX_NORM, WD, LR0, EPS = 0.5, 0.01, 0.05, 1e-6
MICRO = 2
NAMES = ["W1", "W2", "b"]


def _batch(k: int, big: float | None) -> tuple[np.ndarray, np.ndarray]:
    """Batch ``k``; ``big`` (1e5: inf once cast to float16; inf for bfloat16) in one feature if given."""
    rng = np.random.default_rng(200 + k)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    if big is not None:
        x[3, 0] = big
    return x, rng.integers(0, 3, 8)


class Reference:
    """The on-device step in float64 (AdamW mode 1 or SGD, with ClipGradNorm, loss scaling, skipped steps)."""

    def __init__(self, opt: str, dtype: str) -> None:
        self.opt, self.limit = opt, HALF_MAX[dtype]
        self.w = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in tanh_model().graph.initializer}
        self.m = {k: np.zeros_like(v) for k, v in self.w.items()}
        self.v = {k: np.zeros_like(v) for k, v in self.w.items()}
        self.grad = {k: np.zeros_like(v) for k, v in self.w.items()}
        self.steps = 0
        self.overflowed = False
        self.scale, self.stable = 2.0**9, 0  # onnxruntime's DynamicLossScaler(2^9, window 2, max 2^10)

    def forward_backward(self, x: np.ndarray, y: np.ndarray, scale: float) -> float:
        with np.errstate(invalid="ignore", over="ignore"):  # (an inf input: NaN, as the module's)
            return self._forward_backward(x, y, scale)

    def _forward_backward(self, x: np.ndarray, y: np.ndarray, scale: float) -> float:
        w, n = self.w, len(y)
        x = x.astype(np.float64)
        a = np.tanh(x @ w["W1"])
        logits = a @ w["W2"] + w["b"]
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        loss = float(-np.log(p[np.arange(n), y]).mean())
        d = p.copy()
        d[np.arange(n), y] -= 1
        d *= scale / n
        da = d @ w["W2"].T
        dh = da * (1 - a * a)
        g = {"b": d.sum(0), "W2": a.T @ d, "W1": x.T @ dh}
        biggest = max(float(np.abs(t).max()) for t in [x, logits, d, da, dh, *g.values()])
        assert abs(np.log2(biggest / self.limit)) > np.log2(1.02)  # no decision within rounding of the limit
        self.overflowed |= not biggest <= self.limit
        for k in g:
            self.grad[k] += g[k]
        return loss

    def lr(self) -> float:
        """LinearLRScheduler(warm-up 2, total 12, initial 0.05) at the count of applied steps."""
        s, warm, total = self.steps, 2, 12
        return LR0 * (s / warm if s < warm else max(0.0, (total - s) / (total - warm)))

    def step(self) -> bool:
        scale, lr = self.scale, self.lr()
        norm = np.sqrt(sum(float((g * g).sum()) for g in self.grad.values()))
        finite = not self.overflowed and np.isfinite(norm)
        if finite:
            coef = min(MAX_NORM / (norm / scale + EPS), 1.0)  # ClipGradNorm of the unscaled gradients
            t = self.steps + 1
            lr_t = lr * np.sqrt(1 - 0.999**t) / (1 - 0.9**t)
            for k in self.w:
                g = self.grad[k] / scale * coef
                self.grad[k] = g * scale  # the buffers hold the clipped gradients, loss-scaled
                if self.opt == "SGD":
                    self.w[k] = self.w[k] - lr * g
                    continue
                self.m[k] = 0.9 * self.m[k] + 0.1 * g
                self.v[k] = 0.999 * self.v[k] + 0.001 * g * g
                self.w[k] = self.w[k] - lr_t * self.m[k] / (np.sqrt(self.v[k]) + EPS)
                self.w[k] = self.w[k] - lr * WD * self.w[k]
            self.steps += 1
            self.stable += 1
            if self.stable >= 2:
                self.scale, self.stable = min(2.0**10, 2 * self.scale), 0
        else:
            self.scale, self.stable = max(1.0, self.scale / 2), 0
        self.overflowed = False
        return finite


def _folder(tmp_path, opt: str, dtype: str) -> str:
    d = str(tmp_path / f"{opt}_{dtype}")
    os.makedirs(d)
    clip = onnxblock.optim.ClipGradNorm(MAX_NORM)
    block = (onnxblock.optim.AdamW(weight_decay=WD, eps=EPS, clip_grad=clip) if opt == "AdamW"
             else onnxblock.optim.SGD(clip_grad=clip))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        artifacts.generate_artifacts(tanh_model(), requires_grad=NAMES, loss=None, optimizer=block,
                                     artifact_directory=d, mixed_precision=dtype)
    return d


def _open(folder: str, checkpoint: str) -> tuple[CheckpointState, Module, Optimizer, LinearLRScheduler]:
    state = CheckpointState.load_checkpoint(checkpoint)
    scaler = DynamicLossScaler(loss_scale=2.0**9, up_scale_window=2, max_loss_scale=2.0**10)
    module = Module(os.path.join(folder, "training_model.onnx"), state, loss_scaler=scaler)
    opt = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    sched = LinearLRScheduler(opt, warmup_step_count=2, total_step_count=12, initial_lr=LR0)
    return state, module, opt, sched


def _compare(state: CheckpointState, opt: Optimizer, ref: Reference, where: str) -> None:
    atol = 2e-3 if ref.limit == HALF_MAX["float16"] else 6e-3  # bfloat16 keeps 8 bits of a gradient
    for k in NAMES:
        p = state.parameters[k]
        np.testing.assert_allclose(p.data, ref.w[k], rtol=2e-2, atol=atol, err_msg=f"{k} {where}")
        np.testing.assert_allclose(p.grad, ref.grad[k], rtol=2e-2, atol=2e-3 * ref.scale,
                                   err_msg=f"{k}.grad {where}")
    assert opt.step_count == ref.steps, where


@pytest.mark.parametrize("opt,dtype", [("AdamW", "float16"), ("SGD", "float16"), ("AdamW", "bfloat16")])
def test_sequence_with_overflows_and_resume(opt: str, dtype: str, tmp_path) -> None:
    """Ten steps of two micro-batches, three with a micro-batch holding a value beyond the half type's range;
    a checkpoint after the second skipped step resumes beside the first run."""
    folder = _folder(tmp_path, opt, dtype)
    big = 1e5 if dtype == "float16" else np.inf
    forced = {(2, 1), (5, 0), (6, 0)}  # (step, micro-batch)
    ref = Reference(opt, dtype)
    state, module, opt, sched = _open(folder, os.path.join(folder, "checkpoint"))
    runs = [(state, module, opt, sched)]
    flags = []
    for step in range(10):
        for micro in range(MICRO):
            x, y = _batch(10 * step + micro, big if (step, micro) in forced else None)
            want = ref.forward_backward(x, y, ref.scale)
            for _, m, _, _ in runs:
                assert m.loss_scaler.loss_scale == ref.scale
                loss = m(x, y)
                if np.isfinite(want) and not ref.overflowed:
                    np.testing.assert_allclose(loss, want, rtol=2e-2)
        finite = ref.step()
        flags.append(finite)
        for st, m, o, sc in runs:
            o.step()
            assert o.last_step_finite == finite, step
            assert (m.loss_scaler.loss_scale, m.loss_scaler.stable_steps) == (ref.scale, ref.stable), step
            if not finite:  # the step kept the (non-finite) gradients: compare before the reset
                assert any(not np.isfinite(st.parameters[k].grad).all() for k in NAMES)
            else:
                _compare(st, o, ref, f"step {step}")
            m.lazy_reset_grad()
            sc.step()
            np.testing.assert_allclose(o.get_learning_rate(), ref.lr(), rtol=1e-6, err_msg=f"lr after {step}")
        ref.grad = {k: np.zeros_like(v) for k, v in ref.grad.items()}
        if step == 5:  # after a skipped step: save, reload, continue beside the first run
            path = str(tmp_path / "mid.ckpt")
            CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)
            runs.append(_open(folder, path))
    assert flags == [True, True, False, True, True, False, False, True, True, True]
    assert len(runs) == 2
