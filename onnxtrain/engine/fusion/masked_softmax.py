"""A Softmax over a Where that masks scores with -inf (causal attention) as one step that never builds the
masked tensor.

A causal decoder exports ``Softmax(Where(mask, -inf, scores))``. Unfused, the Where writes a masked copy of
the scores, and the Softmax takes exp of it without the shift by the row maxima when the test
:func:`~onnxtrain.engine.kernels.normalization.exp_is_safe` allows (-inf entries, whose exp is exactly 0,
are let through). Fused, the step makes the same test on the scores themselves (which covers the masked
copy), takes their exp, multiplies the masked entries by 0 and the others by 1, and divides by the row
sums: the same numbers in the same order, so the same bits, without the masked copy. Only -inf qualifies
as the fill: a finite one (the dtype's lowest, say) sends the unfused Softmax onto its shifted path, whose
bits the fused step would not reproduce. Measured on the GPT decoder's attention (16 × 4 × 64 × 64
scores): 409 → 183 µs for the pair.

Whenever the inputs are not what the step was made for (scores that are not safe, a softmax axis that is
not the last, a mask that would broadcast the scores to a larger shape) it runs the two original steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from onnxtrain.engine.fusion.common import (
    FLOATS,
    broadcasts_onto,
    constant_of,
    consumers,
    make_step,
    producers,
    protected_slots,
)
from onnxtrain.engine.kernels.normalization import exp_is_safe, row_sum
from onnxtrain.engine.parallel import for_rows
from onnxtrain.engine.registry import Attrs

if TYPE_CHECKING:
    from onnxtrain.engine.plan import Plan, Step


def fuse_masked_softmax(plan: Plan, steps: list[Step]) -> list[Step]:
    """``Softmax(Where(c, -inf, x))`` or ``Softmax(Where(c, x, -inf))``, the -inf a constant scalar and the
    Where read by the Softmax alone → one step."""
    cons, prod, kept = consumers(steps), producers(steps), protected_slots(plan)
    drop: set[int] = set()
    replace: dict[int, Step] = {}
    for k, soft in enumerate(steps):
        if soft.node.op_type != "Softmax" or not soft.inputs or soft.inputs[0] < 0:
            continue
        s = soft.inputs[0]
        m = prod.get(s)
        if m is None or m in drop or cons.get(s) != [k] or s in kept:
            continue
        where = steps[m]
        if where.node.op_type != "Where" or len(where.inputs) != 3 or min(where.inputs) < 0:
            continue
        for side in (1, 2):  # side: the Where input holding the fill
            fill = constant_of(plan, where.inputs[side])
            if fill is not None and _is_minus_inf(fill):
                replace[k] = make_step(plan, "MaskedSoftmax", [where, soft], where.inputs, soft.outputs,
                                       _masked_softmax(plan, where, soft, side, fill.dtype, fill.ndim))
                drop.add(m)
                break
    return [replace.get(k, st) for k, st in enumerate(steps) if k not in drop]


def _is_minus_inf(fill: np.ndarray) -> bool:
    """True for a float32 or float64 scalar -inf."""
    return fill.size == 1 and fill.dtype in FLOATS and bool(fill.reshape(()) == -np.inf)


def _masked_softmax(
    plan: Plan, where: Step, soft: Step, side: int, dtype: np.dtype, fill_rank: int
) -> Callable:
    """The fused step's kernel; ``side`` 1: the fill replaces the scores where c is true, 2: where false.
    A fill of higher rank than the scores (a [1, 1, 1] -inf) adds axes to the Where: the nodes run then."""

    def run(inputs: Sequence[Any], attrs: Attrs) -> Sequence[Any]:
        c, a, b = inputs
        x = b if side == 1 else a
        if (
            type(x) is np.ndarray and type(c) is np.ndarray and c.dtype == np.bool_
            and x.dtype == dtype and x.ndim >= max(fill_rank, 1) and x.flags.c_contiguous and x.size
            and -x.ndim <= soft.attrs["axis"] < x.ndim  # (out of range: the Softmax kernel's error)
            and soft.attrs["axis"] % x.ndim == x.ndim - 1
            and broadcasts_onto(c.shape, x.shape)
        ):
            n = x.shape[-1]
            if exp_is_safe(x, n):
                keep = (np.logical_not(c) if side == 1 else c).astype(dtype)
                y = np.empty_like(x)
                per_sample = keep.ndim == x.ndim and keep.shape[0] > 1

                def rows(lo: int, hi: int) -> None:
                    yb = y[lo:hi]
                    np.exp(x[lo:hi], out=yb)
                    yb *= keep[lo:hi] if per_sample else keep
                    y2 = yb.reshape(-1, n)
                    y2 /= row_sum(y2)

                if x.ndim == 1:  # one row: its axis 0 is the softmax's, not to be split
                    rows(0, n)
                else:
                    for_rows(x.shape[0], x.size, rows)
                return (y,)
        return plan._call(soft, plan._call(where, [c, a, b]))

    return run
