"""AdamOptimizer of the legacy session (spec §7.3): weight-decay modes 0 (decay before) and 1 (after)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from onnxtrain.ir.builder import NodeWriter
from onnxtrain.ir.types import held
from onnxtrain.optim.base import (
    Optimizer,
    StateSpec,
    WeightSlot,
    compute_type,
    fattr,
    iattr,
    scalar,
    switch_refused,
)


def bias_corrections(w: NodeWriter, t: str, alpha: float, beta: float, on: bool, et: int) -> tuple[str, str]:
    """(1 − α^t, 1 − β^t) as scalars of type ``et``, or ones when bias correction is off.

    Computed in float64 and rounded once: 1 − 0.999^t loses five digits in float32 at small t. Both on
    one vector [α, β] (each element's Pow is its own: the same values as two scalar chains), then split.
    The count is made a pair too, as each scalar chain raised its base by an exponent of its own: the
    numpy engine's Pow by one exponent takes t = 2 and 3 as products, (α·α)·α (onnxruntime's bits), which
    are not always numpy's float64 power on AVX-512 hosts (0.882³, 0.991³).
    """
    if not on:
        one = scalar(w, 1.0, et)
        return one, one
    # (a Concat: an Expand, a shaping node, had the onnxruntime backend infer the flat update graph's types,
    # which held 600 MiB over the transformer's 534,026 values before ir.builder._propagates)
    tf = w.one("Cast", w.one("Concat", t, t, axis=0), to=TensorProto.DOUBLE)
    c = _corrections(w, w.const(np.array([held(alpha, et), held(beta, et)]), TensorProto.DOUBLE), tf)
    if et != TensorProto.DOUBLE:
        c = w.one("Cast", c, to=et)
    c1, c2 = w.emit("Split", [c, w.ints([1, 1])], 2, axis=0)
    return c1, c2


def _corrections(w: NodeWriter, bases: str, tf: str) -> str:
    """1 − bases^tf for float64 counts ``tf`` (broadcast), and 1 where the count is ≤ 0 (onnxruntime's
    compute_bias_correction_coefficient: a count of 0 loaded into the state steps uncorrected, not by 0/0)."""
    one = scalar(w, 1.0, TensorProto.DOUBLE)
    c = w.one("Sub", one, w.one("Pow", bases, tf))
    return w.one("Where", w.one("Greater", tf, scalar(w, 0.0, TensorProto.DOUBLE)), c, one)


def shared_bias_corrections(
    w: NodeWriter, items: list[tuple[str, float, float, bool]], et: int, lr: str | None = None,
    joined: str | None = None,
) -> list[tuple[str | None, str, str | None]]:
    """:func:`bias_corrections` for many weights at once: ``items`` are (count, α, β, on) per weight.

    The counts of the weights with correction on, concatenated twice (``joined`` when the caller has that
    Concat already), take [α…, β…] to their powers in one vector (its values are those of the per-weight
    form: each element's Pow is its own), and Splits hand each weight its pair: a dozen nodes in all
    instead of seven per weight, which on small models is much of the update's time. Given ``lr`` (of
    type ``et``), the third value is each weight's step lr·sqrt(c2)/c1, also split from one vector, and
    the first is None (nobody reads it); the third is None where a weight's correction is off or it is
    the only one: its caller computes it.
    """
    on = [i for i, (_, _, _, flag) in enumerate(items) if flag]
    out: list[tuple[str | None, str, str | None]] = [
        (*bias_corrections(w, t, a, b, False, et), None) for t, a, b, _ in items
    ]
    if len(on) == 1:
        t, a, b, _ = items[on[0]]
        out[on[0]] = (*bias_corrections(w, t, a, b, True, et), None)
    elif on:
        dbl = TensorProto.DOUBLE
        n = len(on)
        counts = [items[i][0] for i in on]
        if joined is None:
            joined = w.one("Concat", *counts, *counts, axis=0)
        tf = w.one("Cast", joined, to=dbl)
        bases = w.const(np.array([held(items[i][k], et) for k in (1, 2) for i in on]), dbl)
        c = _corrections(w, bases, tf)
        if et != dbl:
            c = w.one("Cast", c, to=et)
        c1v, c2v = w.emit("Split", [c, w.ints([n, n])], 2, axis=0)
        sizes = w.ints([1] * n)
        c2s = w.emit("Split", [c2v, sizes], n, axis=0)
        if lr is None:
            c1s: list[str | None] = list(w.emit("Split", [c1v, sizes], n, axis=0))
            steps: list[str | None] = [None] * n
        else:
            c1s = [None] * n
            steps = list(w.emit("Split", [step_size(w, lr, c1v, c2v), sizes], n, axis=0))
        for i, c1, c2, st in zip(on, c1s, c2s, steps):
            out[i] = (c1, c2, st)
    return out


def step_size(w: NodeWriter, lr: str, c1: str, c2: str) -> str:
    """Adam's bias-corrected step lr·sqrt(c2)/c1 (on scalars or on vectors of them)."""
    return w.one("Div", w.one("Mul", lr, w.one("Sqrt", c2)), c1)


def next_counts(w: NodeWriter, counts: list[str], names: list[str], joined: str | None = None) -> list[str]:
    """count + 1 for each of ``counts`` (int64 [1] tensors), as one Add on their concatenation (``joined``:
    the Concat of ``counts`` twice that :func:`shared_bias_corrections` read, reused; its second half is
    stepped too and dropped)."""
    if len(counts) == 1:
        return w.emit("Add", [counts[0], w.ints([1])], names)
    n = len(counts)
    if joined is None:
        stepped = w.one("Add", w.one("Concat", *counts, axis=0), w.ints([1]))
        return w.emit("Split", [stepped, w.ints([1] * n)], names, axis=0)  # sizes given: any opset
    stepped = w.one("Add", joined, w.ints([1]))
    return w.emit("Split", [stepped, w.ints([1] * n + [n])], [*names, w.names("counts_again")], axis=0)[:n]


def _given(name: str | None) -> str:
    """``name``, which the caller knows is set."""
    assert name is not None
    return name


def moments(w: NodeWriter, g: str, m1: str, m2: str, alpha: float, beta: float, et: int) -> tuple[str, str]:
    """m1 = α·m1 + (1−α)·g,  m2 = β·m2 + ((1−β)·g)·g (α and β as onnxruntime holds them: :func:`held`; the
    product in onnxruntime's order, finite up to |g| ≈ 5.8e20)."""
    alpha, beta = held(alpha, et), held(beta, et)
    # the gradient's terms come first in node order, each moment's product just before the Add that reads it
    # (same operands and values): onnxruntime's arena then held 1.5 MiB less for the MLP's update graph
    g1 = w.one("Mul", g, scalar(w, 1 - alpha, et))
    m1n = w.one("Add", w.one("Mul", m1, scalar(w, alpha, et)), g1)
    g2 = w.one("Mul", w.one("Mul", g, scalar(w, 1 - beta, et)), g)  # (g·g first overflowed from |g| ≈ 1.8e19)
    m2n = w.one("Add", w.one("Mul", m2, scalar(w, beta, et)), g2)
    return m1n, m2n


class Adam(Optimizer):
    name = "AdamOptimizer"
    FLOAT_ATTRS = {"alpha": 0.9, "beta": 0.999, "lambda": 0.0, "epsilon": 1e-8, "max_norm_clip": 1.0}
    INT_ATTRS = {"do_bias_correction": 1, "weight_decay_mode": 0}
    SWITCHES = ("do_bias_correction", "weight_decay_mode")
    uses_norm = True

    def state(self, slots: list[WeightSlot]) -> list[StateSpec]:
        out = []
        for s in slots:
            out += self.moment_specs(s)
            out.append(StateSpec(f"Update_Count_{s.name}", s.name, "Update_Count", np.ones([1], np.int64)))
        return out

    def emit(
        self, w: NodeWriter, slots: list[WeightSlot], lr: str, state: dict[str, str]
    ) -> tuple[dict[str, str], dict[str, str]]:
        new_w: dict[str, str] = {}
        new_s: dict[str, str] = {}
        counts = [state[f"Update_Count_{s.name}"] for s in slots]
        corrections: dict[str, tuple[str, str, str | None]] = {}
        groups: dict[int, list[WeightSlot]] = {}  # by type, each sharing one vector of step sizes
        for s in slots:
            groups.setdefault(compute_type(s.elem_type), []).append(s)
        joined = None  # the counts' Concat, shared by the corrections and the next counts when both read all
        if len(groups) == 1 and len(slots) > 1 and all(iattr(s, self, "do_bias_correction") for s in slots):
            joined = w.one("Concat", *counts, *counts, axis=0)
        for et, group in groups.items():
            items = [
                (state[f"Update_Count_{s.name}"], fattr(s, self, "alpha"), fattr(s, self, "beta"),
                 bool(iattr(s, self, "do_bias_correction")))
                for s in group
            ]
            lr_et = lr if et == TensorProto.FLOAT else w.one("Cast", lr, to=et)
            corrections.update(zip((s.name for s in group),
                                   shared_bias_corrections(w, items, et, lr_et, joined=joined)))
        for s in slots:
            weight, g, et = self.operands(w, s)
            a, b = fattr(s, self, "alpha"), fattr(s, self, "beta")
            lam, eps = fattr(s, self, "lambda"), fattr(s, self, "epsilon")
            mode = iattr(s, self, "weight_decay_mode")
            if mode not in (0, 1):
                raise switch_refused(s.name, "weight_decay_mode", mode)
            m1, m2 = state[f"Moment_1_{s.name}"], state[f"Moment_2_{s.name}"]
            m1v, m2v = self.load_moment(w, m1, et), self.load_moment(w, m2, et)
            lr_t = lr if et == TensorProto.FLOAT else w.one("Cast", lr, to=et)
            c1, c2, shared_step = corrections[s.name]
            m1n, m2n = moments(w, g, m1v, m2v, a, b, et)
            step = shared_step if shared_step is not None else step_size(w, lr_t, _given(c1), c2)
            keep = (w.one("Sub", scalar(w, 1.0, et), w.one("Mul", lr_t, scalar(w, lam, et)))
                    if lam else None)  # 1 − lr·λ
            # u = lr·sqrt(c2)/c1 · m1/(sqrt(m2) + ε'), the bias corrections in scalars. Mode 0's
            # Δ = −lr·((m1/c1) / (sqrt(m2/c2) + ε) + λ·w) is w' = w·(1 − lr·λ) − u with ε' = ε·sqrt(c2): the
            # same value, two passes over the weight fewer than that form. Mode 1 (ε' = ε):
            # w' = (w − u) − lr·λ·(w − u) = (w − u)·(1 − lr·λ), the factor a scalar: one pass instead of two
            eps_t = scalar(w, eps, et) if mode == 1 else w.one("Mul", w.one("Sqrt", c2), scalar(w, eps, et))
            u = w.one("Mul", step, w.one("Div", m1n, w.one("Add", w.one("Sqrt", m2n), eps_t)))
            if mode == 0:
                wn = w.one("Sub", weight if keep is None else w.one("Mul", weight, keep), u)
            else:
                wn = w.one("Sub", weight, u)
                if keep is not None:
                    wn = w.one("Mul", wn, keep)
            out = w.names(f"{s.name}_Adam_out")
            new_w[s.name] = (w.emit("Identity", [wn], [out]) if et == s.elem_type
                             else w.emit("Cast", [wn], [out], to=s.elem_type))[0]
            new_s[m1] = self.store_moment(w, m1n, w.names(f"Moment_1_{s.name}_Out"), et)
            new_s[m2] = self.store_moment(w, m2n, w.names(f"Moment_2_{s.name}_Out"), et, second=True)
        stepped = next_counts(w, counts, [w.names(f"{s.grad}_Step_Out") for s in slots], joined=joined)
        new_s.update(zip(counts, stepped))
        return new_w, new_s
