"""``LinearLRScheduler``: linear warm-up then linear decay to zero (spec §4.2).

With ``s`` the optimizer's completed steps, ``W`` the warm-up and ``T`` the total step count::

    factor(s) = s / max(1, W)                      if s < W
              = max(0, (T - s) / max(1, T - W))    otherwise
    lr        = initial_lr * factor(s)

Arguments are in the documented order (warm-up, total). onnxruntime-training 1.19.2's Python
wrapper passed them swapped to its binding; ``swap_warmup_and_total=True`` reproduces that.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxtrain.training.api.optimizer import Optimizer, learning_rate_value


def _count(name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def linear_factor(step: int, warmup: int, total: int) -> float:
    """The learning-rate factor after ``step`` completed steps (float32 arithmetic, as onnxruntime)."""
    f32 = np.float32
    if step < warmup:
        return float(f32(step) / f32(max(1, warmup)))
    return float(max(f32(0.0), f32(total - step) / f32(max(1, total - warmup))))


class LinearLRScheduler:
    """Sets the optimizer's learning rate from its step count; call :meth:`step` after each update.

    Construction sets the optimizer's initial learning rate to ``initial_lr`` and applies one
    scheduler step, so with a warm-up the first update uses lr 0.

    Example::

        scheduler = LinearLRScheduler(optimizer, warmup_step_count=2, total_step_count=10, initial_lr=0.1)
        for x, y in batches:
            module(x, y); optimizer.step(); module.lazy_reset_grad(); scheduler.step()
    """

    def __init__(self, optimizer: Optimizer, warmup_step_count: int, total_step_count: int,
                 initial_lr: float, *, swap_warmup_and_total: bool = False) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be an Optimizer, got {type(optimizer).__name__}")
        warmup = _count("warmup_step_count", warmup_step_count)
        total = _count("total_step_count", total_step_count)
        if swap_warmup_and_total:
            warmup, total = total, warmup
        self._optimizer = optimizer
        self.warmup_step_count, self.total_step_count = warmup, total
        optimizer._set_initial_lr(learning_rate_value(initial_lr))
        self.step()

    def step(self) -> None:
        """Recompute the learning rate from the optimizer's completed steps (advances nothing itself)."""
        opt = self._optimizer
        factor = linear_factor(opt.step_count, self.warmup_step_count, self.total_step_count)
        with np.errstate(invalid="ignore"):  # an infinite initial rate times a factor 0 is NaN, as there
            opt.set_learning_rate(float(np.float32(opt._initial_lr) * np.float32(factor)))

    def get_learning_rate(self) -> float:
        """The optimizer's current learning rate."""
        return self._optimizer.get_learning_rate()
