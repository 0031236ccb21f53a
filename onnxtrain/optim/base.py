"""What an optimizer is to the training-graph builder: state it keeps and ONNX nodes that update it.

An optimizer emits, for each weight, standard ONNX nodes that take the weight, its gradient, the
learning rate and its state tensors, and produce the new weight and new state. The session holds
the state outside the graph and swaps the new arrays in after each run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from onnx import TensorProto

from onnxtrain.ir.builder import NodeWriter


@dataclass
class WeightSlot:
    """One trained weight as the update graph sees it."""

    name: str
    grad: str  # gradient value, already averaged over accumulation steps
    shape: tuple[int, ...]
    elem_type: int
    float_attrs: dict[str, float] = field(default_factory=dict)
    int_attrs: dict[str, int] = field(default_factory=dict)
    divisor: str | None = None  # per-weight gradient divisor (loss scale / clipping), a [1] or scalar value


@dataclass
class StateSpec:
    """A state tensor: store name, the weight it belongs to ('' when shared), key and initial value."""

    name: str
    weight: str
    key: str
    initial: np.ndarray


class Optimizer:
    """Base class: subclasses define ``FLOAT_ATTRS``/``INT_ATTRS`` (name → default) and ``emit``."""

    name = ""
    FLOAT_ATTRS: dict[str, float] = {}
    INT_ATTRS: dict[str, int] = {}
    uses_norm = False  # whether the global gradient norm (clipping) is wired into the update

    def check_attrs(self, weight: str, floats: dict[str, Any], ints: dict[str, Any]) -> None:
        for k in floats:
            if k not in self.FLOAT_ATTRS:
                raise ValueError(
                    f"optimizer_attributes_map[{weight!r}]: {self.name} has no float attribute {k!r}; "
                    f"known: {sorted(self.FLOAT_ATTRS)}"
                )
        for k in ints:
            if k not in self.INT_ATTRS:
                raise ValueError(
                    f"optimizer_int_attributes_map[{weight!r}]: {self.name} has no int attribute "
                    f"{k!r}; known: {sorted(self.INT_ATTRS)}"
                )

    def state(self, slots: list[WeightSlot], moment_dtype: Any = np.float32) -> list[StateSpec]:
        return []

    def emit(
        self, w: NodeWriter, slots: list[WeightSlot], lr: str, state: dict[str, str]
    ) -> tuple[dict[str, str], dict[str, str]]:
        """Emit the update; returns (weight → new weight value, state name → new state value)."""
        raise NotImplementedError


def fattr(slot: WeightSlot, opt: Optimizer, key: str) -> float:
    return float(slot.float_attrs.get(key, opt.FLOAT_ATTRS[key]))


def iattr(slot: WeightSlot, opt: Optimizer, key: str) -> int:
    return int(slot.int_attrs.get(key, opt.INT_ATTRS[key]))


def scalar(w: NodeWriter, value: float, elem_type: int = TensorProto.FLOAT) -> str:
    return w.const(np.asarray(value), elem_type)
