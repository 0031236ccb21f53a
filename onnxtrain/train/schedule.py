"""Learning-rate schedules: a pure function of the optimizer step, so a resumed run gets the same rates."""

from __future__ import annotations

import math


def learning_rate(step: int, total: int, base_lr: float, kind: str = "constant", warmup_steps: int = 0,
                  final_lr_ratio: float = 0.0) -> float:
    """The rate for optimizer step ``step`` (0-based) of ``total``.

    Linear warm-up from ``base_lr / warmup_steps`` to ``base_lr`` over the first ``warmup_steps``
    steps, then ``constant``, ``linear`` or ``cosine`` decay to ``base_lr × final_lr_ratio`` at the
    last step.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if kind == "constant":
        return base_lr
    span = max(total - warmup_steps - 1, 1)
    t = min(max(step - warmup_steps, 0) / span, 1.0)
    final = base_lr * final_lr_ratio
    if kind == "linear":
        return final + (base_lr - final) * (1.0 - t)
    if kind == "cosine":
        return final + (base_lr - final) * 0.5 * (1.0 + math.cos(math.pi * t))
    raise ValueError(f"unknown schedule kind {kind!r}; expected constant, linear or cosine")
