"""The on-device AdamW block (onnxtrain/training/onnxblock/optim/optim.py) steps float16 and bfloat16
parameters in float32 arithmetic, as onnxruntime's optimizer kernels do (its CPU AdamWOptimizer takes float
only), and as the legacy session's Adam does since f90074c: computed in float16, eps=1e-8 is 0 (an element
whose gradient is 0 got 0/(0+0) = NaN) and (1-β2)·g² underflows for |g| < 7.7e-3 (with the default eps=1e-6
m was then divided by ε alone: this MLP's weights moved up to 0.55 in 3 steps at lr 1e-3, not 3e-3). The
moments stay in the parameter's type, as the block and the checkpoint keep them (a float16 second moment at
least float16's smallest positive value, as the legacy session stores one); only the stored values are
rounded.

Oracle: AdamW as the block follows it (Hugging Face variant, onnxruntime's mode 1) in float64 from each
step's half inputs, with float32 betas, rounded to the parameter's type where the fix stores (within one step
of that type, beyond a bound on float32 arithmetic's error, which matters where m's two terms cancel)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from onnxtrain.training import artifacts, onnxblock
from tests.training.test_flat_update import _model, _open

PARAMS = ["W1", "b1", "W2", "b2", "W3"]
TINY16 = float(np.finfo(np.float16).smallest_subnormal)
F32 = 2.0 ** -24  # float32's unit roundoff

BLOCKS = {
    "default": (lambda: artifacts.OptimType.AdamW, dict(betas=(0.9, 0.999), eps=1e-6, wd=0.0, bc=True)),
    "eps1e-8": (lambda: onnxblock.optim.AdamW(eps=1e-8),
                dict(betas=(0.9, 0.999), eps=1e-8, wd=0.0, bc=True)),
    "decay-uncorrected": (lambda: onnxblock.optim.AdamW(bias_correction=False, betas=(0.8, 0.99), eps=1e-8,
                                                        weight_decay=0.05),
                          dict(betas=(0.8, 0.99), eps=1e-8, wd=0.05, bc=False)),
}


def _oracle(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, lr: float, t: int,
            hp: dict[str, Any]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(new value rounded to the parameter's type, bound on the float32 arithmetic's error before rounding)
    of the weight and both moments."""
    dt = p.dtype
    b1, b2 = (float(np.float32(b)) for b in hp["betas"])
    p, g, m, v = (x.astype(np.float64) for x in (p, g, m, v))
    lr = float(np.float32(lr))
    m_terms = np.abs(b1 * m) + np.abs((1 - b1) * g)
    v_terms = b2 * v + (1 - b2) * g * g
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    lr_t = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t) if hp["bc"] else lr
    step = lr_t * m / (np.sqrt(v) + float(np.float32(hp["eps"])))
    # the step's own relative error (from m's, whose terms may cancel) and that of p − step
    p_err = np.abs(step) * (F32 * 8 + F32 * m_terms / np.maximum(np.abs(m), 1e-300)) + F32 * np.abs(p)
    p = (p - step) * (1 - lr * hp["wd"])
    if dt == np.float16:  # a float16 second moment is kept at least float16's smallest positive value
        v = np.maximum(v, TINY16)
    return [(p.astype(dt), 2 * p_err), (m.astype(dt), 2 * F32 * m_terms), (v.astype(dt), 4 * F32 * v_terms)]


def _batch(rng: np.random.Generator, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """Small inputs (gradients of 1e-5..1e-2) with x[:, 0] = 0 (W1's first row: gradient 0)."""
    x = (rng.standard_normal((16, 6)) * 1e-2).astype(dtype)
    x[:, 0] = 0
    return x, rng.integers(0, 3, 16).astype(np.int64)


def _spacing(x: np.ndarray) -> np.ndarray:
    """The distance from each float16 (bfloat16) value to the next one away from 0, in float64."""
    return np.abs((x.view(np.int16) + np.int16(1)).view(x.dtype).astype(np.float64) - x.astype(np.float64))


# onnxruntime cannot load the bfloat16 training model (no bfloat16 NegativeLogLikelihoodLoss)
@pytest.mark.parametrize("backend,dtype", [(None, np.float16), ("onnxruntime", np.float16),
                                           (None, ml_dtypes.bfloat16)])
@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_half_adamw_steps_follow_float64_formulas(tmp_path: Path, name: str, backend: str | None,
                                                  dtype: Any) -> None:
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    make, hp = BLOCKS[name]
    artifacts.generate_artifacts(_model(dtype), requires_grad=PARAMS,
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=make(),
                                 artifact_directory=str(tmp_path))
    runs = {}
    for flat in (None, "0"):  # the flat-buffer update and the per-parameter model
        state, module, opt = _open(str(tmp_path), backend, flat)
        opt.set_learning_rate(1e-3)
        rng = np.random.default_rng(7)
        for step in range(1, 5):
            module(*_batch(rng, dtype))
            before = {p: (state.parameters[p].data.copy(), state.parameters[p].grad.copy(),
                          *(opt._opt.moments[p][k].copy() if k in opt._opt.moments.get(p, {})
                            else np.zeros_like(state.parameters[p].data)
                            for k in ("momentum0", "momentum1"))) for p in PARAMS}
            opt.step()
            module.lazy_reset_grad()
            assert np.count_nonzero(before["W1"][1][0]) == 0  # the zero gradients are there
            for p in PARAMS:
                want = _oracle(*before[p], 1e-3, step, hp)
                got = (state.parameters[p].data, opt._opt.moments[p]["momentum0"],
                       opt._opt.moments[p]["momentum1"])
                for label, (w, err), h in zip(("weight", "momentum0", "momentum1"), want, got):
                    assert h.dtype == dtype
                    assert np.isfinite(h.astype(np.float64)).all(), (p, label, step)
                    # float32 arithmetic rounded to the parameter's type: at most one step of that type
                    # from the float64 value rounded, beyond float32's own error
                    off = np.abs(h.astype(np.float64) - w.astype(np.float64)) - _spacing(w) - err
                    assert off.max() <= 0, (p, label, step, off.max())
                # an AdamW step moves an element by at most about lr·(1−β1)/sqrt(1−β2) (3.2e-3) + decay
                assert np.abs(state.parameters[p].data.astype(float) - before[p][0]).max() < 5e-3
        runs[flat] = {p: state.parameters[p].data.copy() for p in PARAMS}
    for p in PARAMS:  # the flat update gives the per-parameter model's bits
        assert np.array_equal(runs[None][p].view(np.int16), runs["0"][p].view(np.int16)), p
