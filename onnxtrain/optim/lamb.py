"""LambOptimizer of the legacy session (spec §7.4): trust ratio, non-finite guards, one shared Step."""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx import TensorProto

from onnxtrain.ir.builder import NodeWriter
from onnxtrain.optim.adam import moments, shared_bias_corrections
from onnxtrain.optim.base import Optimizer, StateSpec, WeightSlot, compute_type, fattr, scalar


class Lamb(Optimizer):
    name = "LambOptimizer"
    FLOAT_ATTRS = {
        "alpha": 0.9,
        "beta": 0.999,
        "lambda": 0.0,
        "epsilon": 1e-6,
        "max_norm_clip": 1.0,
        "ratio_min": float("-inf"),
        "ratio_max": float("inf"),
    }
    INT_ATTRS = {"do_bias_correction": 0}  # the legacy builder's default, not the op schema's
    SWITCHES = ("do_bias_correction",)
    uses_norm = True

    def state(self, slots: list[WeightSlot]) -> list[StateSpec]:
        out = [StateSpec("Step", "", "Step", np.ones([1], np.int64))]
        for s in slots:
            out += self.moment_specs(s)
        return out

    def _global(self, slots: list[WeightSlot], key: str) -> Any:
        """ratio_min/ratio_max/do_bias_correction are global, as in onnxruntime's Lamb builder: the first
        weight's value (its default when that weight does not set one), which every other weight that sets
        the key must repeat."""
        def given(s: WeightSlot) -> Any:
            return (s.int_attrs if key in self.INT_ATTRS else s.float_attrs).get(key)

        value = given(slots[0]) if slots else None
        if value is None:
            value = self.INT_ATTRS.get(key, self.FLOAT_ATTRS.get(key))
        for s in slots[1:]:
            v = given(s)
            if v is None:
                continue
            # floats compared as the float32 attributes the graph holds (0.1 and np.float32(0.1) agree)
            if (v != value) if key in self.INT_ATTRS else (np.float32(v) != np.float32(value)):
                raise ValueError(
                    f"LambOptimizer: {key} is shared by all weights and taken from the first, "
                    f"{slots[0].name!r} ({value}); weight {s.name!r} sets {v}: give every weight that sets "
                    f"{key} the first one's value"
                )
        return value

    def _corrections(self, w: NodeWriter, slots: list[WeightSlot], t: str,
                     on: bool) -> dict[str, tuple[str, str]]:
        """Each weight's bias corrections (c1, c2) for the shared step ``t``, one vector per compute type."""
        groups: dict[int, list[WeightSlot]] = {}
        for s in slots:
            groups.setdefault(compute_type(s.elem_type), []).append(s)
        out: dict[str, tuple[str, str]] = {}
        for et, group in groups.items():
            items = [(t, fattr(s, self, "alpha"), fattr(s, self, "beta"), on) for s in group]
            for s, (c1, c2, _) in zip(group, shared_bias_corrections(w, items, et)):
                assert c1 is not None
                out[s.name] = (c1, c2)
        return out

    def emit(
        self, w: NodeWriter, slots: list[WeightSlot], lr: str, state: dict[str, str]
    ) -> tuple[dict[str, str], dict[str, str]]:
        new_w: dict[str, str] = {}
        new_s: dict[str, str] = {}
        t = state["Step"]
        rmin, rmax = float(self._global(slots, "ratio_min")), float(self._global(slots, "ratio_max"))
        bias = bool(self._global(slots, "do_bias_correction"))
        corrections = self._corrections(w, slots, t, bias)
        for s in slots:
            weight, g, et = self.operands(w, s)
            a, b = fattr(s, self, "alpha"), fattr(s, self, "beta")
            lam, eps = fattr(s, self, "lambda"), fattr(s, self, "epsilon")
            m1, m2 = state[f"Moment_1_{s.name}"], state[f"Moment_2_{s.name}"]
            m1v, m2v = self.load_moment(w, m1, et), self.load_moment(w, m2, et)
            lr_t = lr if et == TensorProto.FLOAT else w.one("Cast", lr, to=et)
            c1, c2 = corrections[s.name]
            m1n, m2n = moments(w, g, m1v, m2v, a, b, et)
            # d = λ·w + (m1/c1) / (sqrt(m2/c2) + ε); where d is not finite: d = 0 and the moments stay
            d = w.one(
                "Div",
                w.one("Div", m1n, c1),
                w.one("Add", w.one("Sqrt", w.one("Div", m2n, c2)), scalar(w, eps, et)),
            )
            if lam:
                d = w.one("Add", d, w.one("Mul", weight, scalar(w, lam, et)))
            bad = not_finite(w, d)
            zero = scalar(w, 0.0, et)
            d = w.one("Where", bad, zero, d)
            m1n = w.one("Where", bad, m1v, m1n)
            m2n = w.one("Where", bad, m2v, m2n)
            # η = lr·max(ratio_min, min(ratio_max, ‖w‖/‖d‖)) when both norms are nonzero, else lr: in
            # onnxruntime's order, so ratio_min wins when it exceeds ratio_max (ONNX's Clip gives ratio_max)
            wn2 = w.one("ReduceL2", weight, keepdims=0)
            dn2 = w.one("ReduceL2", d, keepdims=0)
            ratio = w.one("Div", wn2, dn2)
            if rmax != float("inf"):
                ratio = w.one("Min", ratio, scalar(w, min(rmax, 3.0e38), et))
            if rmin != float("-inf"):
                ratio = w.one("Max", ratio, scalar(w, max(rmin, -3.0e38), et))
            both = w.one("And", w.one("Greater", wn2, zero), w.one("Greater", dn2, zero))
            eta = w.one("Mul", lr_t, w.one("Where", both, ratio, scalar(w, 1.0, et)))
            cand = w.one("Sub", weight, w.one("Mul", eta, d))
            if et != s.elem_type:  # a half weight: finite in float32 may round to inf in its own type
                cand = w.one("Cast", cand, to=s.elem_type)
            keep = not_finite(w, cand)
            new_w[s.name] = w.emit("Where", [keep, s.name, cand], [w.names(f"{s.name}_Lamb_out")])[0]
            new_s[m1] = self.store_moment(w, m1n, w.names(f"Moment_1_{s.name}_Out"), et)
            new_s[m2] = self.store_moment(w, m2n, w.names(f"Moment_2_{s.name}_Out"), et, second=True)
        new_s[t] = w.emit("Add", [t, w.ints([1])], [w.names("Step_Out")])[0]
        return new_w, new_s


def not_finite(w: NodeWriter, x: str) -> str:
    """Where ``x`` is inf or NaN: ``IsNaN(x − x)`` (exact: x − x is 0 for a finite x), which takes float16
    and bfloat16 at the opsets where ``IsInf`` does not (before 20)."""
    return w.one("IsNaN", w.one("Sub", x, x))
