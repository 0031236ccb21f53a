"""What an optimizer is to the training-graph builder: state it keeps and ONNX nodes that update it.

An optimizer emits, for each weight, standard ONNX nodes that take the weight, its gradient, the
learning rate and its state tensors, and produce the new weight and new state. The session holds
the state outside the graph and swaps the new arrays in after each run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from onnx import TensorProto, helper

from onnxtrain.errors import FailValueError, InvalidGraph, RuntimeException
from onnxtrain.ir.builder import NodeWriter
from onnxtrain.ir.builder import half_widened as compute_type  # (the type a weight's update computes in)
from onnxtrain.user_warning import warn


class SwitchRefused(FailValueError, RuntimeException):
    """An on/off attribute (``SWITCHES``, Adam's ``weight_decay_mode``) other than 0 or 1: onnxtrain's
    ``FailValueError``, and a ``RuntimeException`` as onnxruntime-training 1.16.3's optimizer kernel raised
    it when the session was made."""


def switch_refused(weight: str, key: str, value: Any) -> SwitchRefused:
    return SwitchRefused(f"optimizer_int_attributes_map[{weight!r}][{key!r}] must be 0 or 1, got {value!r}")


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
    """A state tensor: store name, the weight it belongs to ('' when shared), key and initial value (a
    moment's is a read-only broadcast of one zero, which takes no memory: a state takes a copy);
    ``elementwise`` when it holds a value per element of its weight (a moment, not a step counter: ZeRO
    splits those with the weight)."""

    name: str
    weight: str
    key: str
    initial: np.ndarray
    elementwise: bool = False


class Optimizer:
    """Base class: subclasses define ``FLOAT_ATTRS``/``INT_ATTRS`` (name → default) and ``emit``."""

    name = ""
    FLOAT_ATTRS: dict[str, float] = {}
    INT_ATTRS: dict[str, int] = {}
    # int attributes that are on/off switches: another value than 0 or 1 is refused (check_attrs), as
    # onnxruntime-training 1.16.3's kernels refuse it ("do_bias_correction must be either 0 or 1")
    SWITCHES: tuple[str, ...] = ()
    uses_norm = False  # whether the global gradient norm (clipping) is wired into the update

    def __init__(self, moment_dtype: Any = np.float32) -> None:
        """``moment_dtype``: the dtype its moments are kept in (float16 with ``use_fp16_moments``; the
        update's arithmetic stays in the weight's type, float32 for half weights, with casts on load and
        store, spec §8.5). A float64 weight's moments are float64 unless float16 is asked for."""
        self.moment_dtype = np.dtype(moment_dtype)
        if self.moment_dtype not in (np.dtype(np.float32), np.dtype(np.float16)):
            raise ValueError(f"optimizer moments are kept in float32 or float16, not {self.moment_dtype}")

    def kept_dtype(self, elem_type: int) -> np.dtype:
        """The dtype the moments of a weight of type ``elem_type`` are kept in."""
        if elem_type == TensorProto.DOUBLE and self.moment_dtype == np.float32:
            return np.dtype(np.float64)
        return self.moment_dtype

    def operands(self, w: NodeWriter, s: WeightSlot) -> tuple[str, str, int]:
        """(weight, gradient over its divisor, compute type) of ``s`` as its update reads them: a float16
        or bfloat16 weight steps in float32 (onnxruntime's Adam and Lamb kernels take half weights with
        float moments and compute in float; in float16, Adam's ε = 1e-8 is 0 and (1 − β)·g² underflows for
        |g| < 2.5e-3, which made a step m1 / 0)."""
        ct = compute_type(s.elem_type)
        if ct == s.elem_type:
            weight, g = s.name, s.grad
        else:
            weight, g = w.one("Cast", s.name, to=ct), w.one("Cast", s.grad, to=ct)
        return weight, (g if s.divisor is None else w.one("Div", g, s.divisor)), ct

    def load_moment(self, w: NodeWriter, name: str, elem_type: int) -> str:
        """A kept moment as a value of the weight's type ``elem_type`` (a Cast when stored narrower)."""
        if helper.np_dtype_to_tensor_dtype(self.kept_dtype(elem_type)) == elem_type:
            return name
        return w.one("Cast", name, to=elem_type)

    def moment_specs(self, s: WeightSlot) -> list[StateSpec]:
        """Zeroed first and second moments of weight ``s``, in the type they are kept in."""
        kept = self.kept_dtype(s.elem_type)
        return [StateSpec(f"{key}_{s.name}", s.name, key, _zeros(s.shape, kept), elementwise=True)
                for key in ("Moment_1", "Moment_2")]

    def store_moment(self, w: NodeWriter, value: str, out: str, elem_type: int,
                     second: bool = False) -> str:
        """The new moment ``value`` (of type ``elem_type``) as graph value ``out``, in its kept type. A
        ``second`` moment (squares) kept in float16 is at least float16's smallest positive value: one that
        rounded to 0 while the first moment did not made the step m / (√0 + ε), a million times too large
        (the digits MLP diverged with ``use_fp16_moments``)."""
        to = helper.np_dtype_to_tensor_dtype(self.kept_dtype(elem_type))
        if to == elem_type:
            return w.emit("Identity", [value], [out])[0]
        if second and to == TensorProto.FLOAT16:
            tiny = float(np.finfo(np.float16).smallest_subnormal)
            value = w.one("Max", value, w.const(tiny, elem_type))
        return w.emit("Cast", [value], [out], to=to)[0]

    def check_attrs(self, weights: Iterable[str], floats: Mapping[str, Mapping[str, Any]],
                    ints: Mapping[str, Mapping[str, Any]]) -> None:
        """Refuse an attribute this optimizer reads that is given in the map of the other type (onnxruntime
        set it on its optimizer node, which then failed the schema's type check); warn once per map about
        names it does not read at all (onnxruntime's builders ignored those: a script may share one
        attribute function between optimizers); refuse a ``SWITCHES`` attribute other than 0 or 1."""
        maps = (("optimizer_attributes_map", floats, self.FLOAT_ATTRS),
                ("optimizer_int_attributes_map", ints, self.INT_ATTRS))
        for (label, m, known), (other_label, _, other) in zip(maps, maps[::-1]):
            for w in weights:
                misplaced = sorted(k for k in m.get(w, {}) if k not in known and k in other)
                if misplaced:
                    kind = "an int" if other is self.INT_ATTRS else "a float"
                    raise InvalidGraph(
                        f"{label}: {misplaced[0]!r} of weight {w!r} is {kind} attribute of {self.name}: "
                        f"give it in {other_label} (mismatched attribute type, as onnxruntime refuses it)")
            where = [w for w in weights if any(k not in known for k in m.get(w, {}))]
            if where:
                keys = sorted({k for w in where for k in m[w] if k not in known})
                warn(f"{label}: {self.name} does not read {', '.join(map(repr, keys))} from this map (given "
                     f"for {len(where)} weight(s), e.g. {where[0]!r}); ignored, as onnxruntime's optimizer "
                     f"builders ignored them; {self.name} reads {sorted(known) or 'none'} here")
        for key in self.SWITCHES:
            for w in weights:
                v = ints.get(w, {}).get(key, self.INT_ATTRS[key])
                if v not in (0, 1):
                    raise switch_refused(w, key, v)

    def state(self, slots: list[WeightSlot]) -> list[StateSpec]:
        return []

    def emit(
        self, w: NodeWriter, slots: list[WeightSlot], lr: str, state: dict[str, str]
    ) -> tuple[dict[str, str], dict[str, str]]:
        """Emit the update; returns (weight → new weight value, state name → new state value)."""
        raise NotImplementedError


# (low, high, high included) of the attributes whose values outside wreck training (NaN weights), as torch's
# optimizers refuse them: the moments' decay rates below 1, a weight decay and an epsilon of at least 0
_RANGES = {"alpha": (0.0, 1.0, False), "beta": (0.0, 1.0, False), "lambda": (0.0, math.inf, False),
           "epsilon": (0.0, math.inf, False)}


def fattr(slot: WeightSlot, opt: Optimizer, key: str) -> float:
    """Float attribute ``key`` of ``slot``'s update (the optimizer's default unless the map sets it); a
    ValueError naming the map entry for a value out of the attribute's range."""
    value = float(slot.float_attrs.get(key, opt.FLOAT_ATTRS[key]))
    if key in _RANGES:
        lo, hi, closed = _RANGES[key]
        if not (lo <= value < hi or (closed and value == hi)):
            raise ValueError(f"optimizer_attributes_map[{slot.name!r}][{key!r}] = {value} is out of range: "
                             f"{opt.name}'s {key} takes values in [{lo:g}, {hi:g}{']' if closed else ')'}")
    return value


def iattr(slot: WeightSlot, opt: Optimizer, key: str) -> int:
    return int(slot.int_attrs.get(key, opt.INT_ATTRS[key]))


def scalar(w: NodeWriter, value: float, elem_type: int = TensorProto.FLOAT) -> str:
    return w.const(np.asarray(value), elem_type)


def _zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Zeros of ``shape`` as a read-only broadcast of one value: an update graph built for its layout alone
    (the legacy session's halves, a flat update) then holds no weight-sized arrays (4.5 MiB of the MLP's
    peak RSS on the onnxruntime backend)."""
    return np.broadcast_to(np.zeros((), dtype), shape)
