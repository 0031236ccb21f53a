"""Host-side loss scaling for mixed precision (spec §8.4): the scale is a graph input fed on every run.

``DynamicLossScaler`` has the arithmetic of onnxruntime's ``amp.loss_scaler.DynamicLossScaler``: start at
2^16; after each optimizer step, a non-finite step halves the scale (not below ``min_loss_scale``) and
restarts the count of clean steps; ``up_scale_window`` (2,000) clean steps in a row double it (not above
``max_loss_scale``, 2^24). The session stays stateless about the scale. Example::

    scaler = DynamicLossScaler()
    for batch in data:
        finite, = sess.run(["all_gradients_finite"], {**batch, "Learning_Rate": lr,
                                                      sess.loss_scale_input_name: scaler.feed()})
        scaler.update_loss_scale(bool(finite))
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxtrain.user_warning import warn


def step_was_finite(train_step_info: Any) -> bool:
    """The truth of a step's finite flag: ``all_gradients_finite`` as fetched (a bool, a [1] array, or the
    one-element list ``run`` returns) or an object with an ``all_finite`` attribute (``TrainStepInfo``).
    ValueError unless it holds exactly one value (a list of one array is truthy whatever the array holds)."""
    flag = getattr(train_step_info, "all_finite", train_step_info)
    if isinstance(flag, (bool, np.bool_)):
        return bool(flag)
    if isinstance(flag, (list, tuple)) and len(flag) == 1:
        flag = flag[0]
    values = np.asarray(flag).reshape(-1)
    if values.size != 1:
        raise ValueError(f"train_step_info: one finite flag wanted (all_gradients_finite), got "
                         f"{values.size} values")
    return bool(values[0])


def _number(name: str, value: Any) -> float:
    """``value`` as a float; TypeError naming argument ``name`` when it is no number (a string: a call in the
    order of onnxruntime's older ``LossScaler(loss_scale_input_name, is_dynamic_scale, ...)``)."""
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}") from None


class LossScaler:
    """A loss scale fed to the graph as a float32 ``[1]`` array; the base class keeps it fixed (static)."""

    def __init__(self, loss_scale: float = 1.0, input_name: str = "loss_scale"):
        loss_scale = _number("loss_scale", loss_scale)
        if not 0 < loss_scale < float("inf"):  # (the first run feeding it refused it)
            raise ValueError(f"loss_scale must be a positive finite number, got {loss_scale}")
        self.loss_scale = float(loss_scale)
        self.initial_loss_scale = float(loss_scale)
        self.input_name = input_name

    def feed(self) -> np.ndarray:
        """The current scale as the graph input expects it: float32, shape [1]."""
        return np.array([self.loss_scale], dtype=np.float32)

    def update(self, train_step_info: Any) -> float:
        """After an optimizer step: ``train_step_info`` is its ``all_gradients_finite`` or an object with an
        ``all_finite`` attribute (onnxruntime's ``TrainStepInfo``); returns the scale for the next step. A
        static scale stays."""
        return self.loss_scale

    def update_loss_scale(self, is_all_finite: Any) -> None:
        """:meth:`update` under the name of onnxruntime's older ``LossScaler`` (no return value); the flag is
        read by :func:`step_was_finite` and given to :meth:`update` as a bool."""
        self.update(step_was_finite(is_all_finite))

    def reset(self) -> None:
        """Back to the initial state: the scale given at construction."""
        self.loss_scale = self.initial_loss_scale


class DynamicLossScaler(LossScaler):
    """The dynamic loss scale of onnxruntime's legacy AMP (same arguments and defaults).

    ``automatic_update`` False keeps the scale fixed: :meth:`update` then returns it unchanged, as
    onnxruntime's code does (its docstring says a manual call is then needed, which its code never obeyed),
    and onnxtrain's own loops (``Optimizer.step()`` of the on-device API, ``onnxtrain train``) leave it alone.
    onnxruntime's docstring says ``automatic_update`` defaults to False while its signature defaults it to
    True; the signature is what ran, and is kept here.
    """

    def __init__(self, automatic_update: bool = True, loss_scale: float = float(1 << 16),
                 up_scale_window: int = 2000, min_loss_scale: float = 1.0,
                 max_loss_scale: float = float(1 << 24), input_name: str = "loss_scale"):
        super().__init__(loss_scale, input_name)
        up_scale_window = _number("up_scale_window", up_scale_window)
        min_loss_scale = _number("min_loss_scale", min_loss_scale)
        max_loss_scale = _number("max_loss_scale", max_loss_scale)
        if not (up_scale_window >= 1 and float(up_scale_window).is_integer()):  # (2.5 was truncated)
            raise ValueError(f"up_scale_window must be a whole number >= 1, got {up_scale_window}")
        if not 0 < min_loss_scale <= max_loss_scale:
            raise ValueError(f"need 0 < min_loss_scale <= max_loss_scale, got {min_loss_scale}, "
                             f"{max_loss_scale}")
        self.automatic_update = bool(automatic_update)
        self.up_scale_window = int(up_scale_window)
        self.min_loss_scale = float(min_loss_scale)
        self.max_loss_scale = float(max_loss_scale)
        self.stable_steps = 0
        self._warned_at_floor = False

    def update(self, train_step_info: Any) -> float:
        """Halve after a non-finite step (its update was skipped); double after a window of clean ones;
        returns the new scale (the same one when ``automatic_update`` is False)."""
        if not self.automatic_update:
            return self.loss_scale
        if step_was_finite(train_step_info):
            self.stable_steps += 1
            if self.stable_steps >= self.up_scale_window:
                self.loss_scale = min(self.max_loss_scale, self.loss_scale * 2)
                self.stable_steps = 0
        else:
            if self.loss_scale <= self.min_loss_scale and not self._warned_at_floor:
                self._warned_at_floor = True
                warn(f"DynamicLossScaler: a step was not finite at the smallest loss scale "
                     f"({self.min_loss_scale:g}): the overflow is not the scaling's; under float16, values "
                     "beyond ±65504 (float32 graph inputs are cast to float16, as in onnxruntime: regression "
                     "targets, unnormalised features) or NaN in the data make every step non-finite, and "
                     "such steps update nothing; scale the data, or use bfloat16")
            self.loss_scale = max(self.min_loss_scale, self.loss_scale / 2)
            self.stable_steps = 0
        return self.loss_scale

    def reset(self) -> None:
        super().reset()
        self.stable_steps = 0

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(loss_scale={self.loss_scale}, stable_steps={self.stable_steps}, "
                f"up_scale_window={self.up_scale_window})")
