"""``Optimizer.step``'s feeds after their per-call work was cut: the learning-rate array is kept while the
rate stays the same and made anew when it changes; the flat update's feed names are made once. Each step,
with the rate changed between some of them (by ``set_learning_rate`` and by a scheduler), is bit for bit
what onnx.reference computes from the per-parameter optimizer model on the same inputs."""

from __future__ import annotations

import numpy as np
import pytest

from onnxtrain.training.api import LinearLRScheduler
from tests.training.test_flat_update import OPTIMIZERS, _artifacts, _batch, _open, _reference_step

RATES = [0.05, 0.05, 0.2, 0.2, 0.05, 0.0, 0.0, 0.05]


def _check_step(folder, state, module, opt, i, dtype) -> None:
    module(*_batch(i, dtype))
    want = _reference_step(folder, state, opt)
    opt.step()
    module.lazy_reset_grad()
    for p in opt._params:
        np.testing.assert_array_equal(state.parameters[p].data, want[f"{p}.out"], err_msg=f"step {i}: {p}")
        for k, m in opt._opt.moments[p].items():
            np.testing.assert_array_equal(m, want.get(f"{p}.{k}.out", 0), err_msg=f"step {i}: {p}.{k}")


@pytest.mark.parametrize("flat", [None, "0"], ids=["flat", "per-parameter"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_rate_changes_between_steps_reach_the_update(tmp_path, name, dtype, flat) -> None:
    folder = _artifacts(tmp_path, OPTIMIZERS[name](), dtype)
    state, module, opt = _open(folder, flat=flat)
    assert (opt._flat is not None) == (flat is None)
    for i, lr in enumerate(RATES):
        opt.set_learning_rate(lr)
        _check_step(folder, state, module, opt, i, dtype)
    assert opt.step_count == len(RATES)


def test_a_scheduler_changes_the_rate_each_step(tmp_path) -> None:
    folder = _artifacts(tmp_path, OPTIMIZERS["adamw"]())
    state, module, opt = _open(folder)
    opt.set_learning_rate(0.1)
    scheduler = LinearLRScheduler(opt, warmup_step_count=2, total_step_count=6, initial_lr=0.1)
    seen = []
    for i in range(6):
        seen.append(opt.get_learning_rate())
        _check_step(folder, state, module, opt, i, np.float32)
        scheduler.step()
    assert len(set(seen)) >= 4 and seen[3] != seen[4]  # (rates change between most steps)



@pytest.mark.parametrize("flat", [None, "0"], ids=["flat", "per-parameter"])
def test_a_rate_of_minus_zero_after_zero_reaches_the_update(tmp_path, flat) -> None:
    """0.0 and -0.0 compare equal, but the update's bits differ (a -0.0 weight minus -0.0·g is +0.0 where g
    is positive, minus +0.0·g stays -0.0): the kept learning-rate feed follows the sign of a zero rate. The
    weights' bits, signs of zeros included, are onnx.reference's (assert_array_equal takes -0.0 for 0.0)."""
    folder = _artifacts(tmp_path, OPTIMIZERS["sgd"]())
    state, module, opt = _open(folder, flat=flat)
    for i, lr in enumerate([0.0, -0.0, 0.0]):
        for p in ("b1", "b2"):
            state.parameters[p].data[...] = -0.0
        opt.set_learning_rate(lr)
        module(*_batch(i))
        want = _reference_step(folder, state, opt)
        opt.step()
        module.lazy_reset_grad()
        for p in opt._params:
            got = state.parameters[p].data
            assert got.tobytes() == want[f"{p}.out"].astype(got.dtype).tobytes(), f"step {i}: {p}"
        signs = np.signbit(state.parameters["b1"].data)
        assert signs.any() and not signs.all()  # (zeros of both signs)
