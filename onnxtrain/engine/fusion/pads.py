"""A Sum of zero-padded tensors that tile one axis, as the pieces written side by side.

The gradient of a Gather at a constant index (q, k and v taken from one projection) is the output
gradient padded with zeros back to the data's shape, and a tensor gathered at every index of an axis gets
the Sum of those padded tensors: three Pads writing mostly zeros, then two additions over the whole
tensor. When the pads, read at run time, place the pieces side by side along one axis with nothing
left over, the fused step writes each piece plus 0 into its place instead (adding 0 turns -0.0 into +0.0,
as the additions of zeros did): the same bits, one pass instead of five. float16 pieces (whose Sum adds in
float32 and rounds once: the piece plus 0 again) are looked up in the results of numpy's float16 ``x + 0``
for every float16 (half_cast.by_table).

Anything else (pads on several axes, gaps or overlaps, a non-zero or non-constant padding, other dtypes)
runs the original Pad and Sum steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from onnxtrain.engine.fusion.common import (
    FLOATS,
    constant_of,
    consumers,
    make_step,
    producers,
    protected_slots,
)
from onnxtrain.engine.kernels import half_cast
from onnxtrain.engine.registry import Attrs
from onnxtrain.ir.graphs import DEFAULT_DOMAINS

if TYPE_CHECKING:
    from onnxtrain.engine.plan import Plan, Step


def fuse_pad_sums(plan: Plan, steps: list[Step]) -> list[Step]:
    """``Sum(Pad(x0, p0), Pad(x1, p1), ...)`` with constant zero padding, each Pad read by the Sum alone →
    one step that concatenates the pieces when the pads tile one axis."""
    cons, prod, kept = consumers(steps), producers(steps), protected_slots(plan)
    drop: set[int] = set()
    replace: dict[int, Step] = {}
    for k, total in enumerate(steps):
        if total.node.op_type != "Sum" or len(total.inputs) < 2 or min(total.inputs) < 0:
            continue
        pads = [prod.get(s) for s in total.inputs]
        if len(set(pads)) != len(pads) or any(
            m is None or m in drop or not _zero_pad(plan, steps[m]) or cons.get(s) != [k] or s in kept
            for m, s in zip(pads, total.inputs)
        ):
            continue
        members = [steps[m] for m in pads]  # type: ignore[index]
        ins = tuple(s for st in members for s in st.inputs[:2])
        replace[k] = make_step(plan, "PadsConcat", [*members, total], ins, total.outputs,
                               _pads_concat(plan, members, total))
        drop.update(pads)  # type: ignore[arg-type]
    return [replace.get(k, st) for k, st in enumerate(steps) if k not in drop]


def _zero_pad(plan: Plan, st: Step) -> bool:
    """A Pad (opset 11 on) in constant mode whose padding value is absent or a constant 0, on every axis."""
    if st.node.op_type != "Pad" or st.node.domain not in DEFAULT_DOMAINS or len(st.inputs) < 2:
        return False
    if (st.attrs.get("mode") or "constant") != "constant" or min(st.inputs[:2]) < 0:
        return False
    if len(st.inputs) > 3 and st.inputs[3] >= 0:  # axes
        return False
    if len(st.inputs) > 2 and st.inputs[2] >= 0:
        v = constant_of(plan, st.inputs[2])  # +0.0 only: the fused concat adds 0.0, which drops a -0.0 fill
        return v is not None and v.size == 1 and not v.reshape(-1).view(np.uint8).any()
    return True


def _tiles(xs: Sequence[np.ndarray], pads: Sequence[Any]) -> tuple[list[np.ndarray], int] | None:
    """The pieces in axis order and the axis, when ``pads`` place the float arrays ``xs`` side by side along
    one axis, covering it with no gap or overlap, and pad no other axis; else None."""
    x0 = xs[0]
    if type(x0) is not np.ndarray or (x0.dtype not in FLOATS and x0.dtype != half_cast.HALF) or x0.ndim == 0:
        return None
    r = x0.ndim
    placed: list[tuple[int, np.ndarray]] = []
    axis = None
    size = None
    for x, p in zip(xs, pads):
        p = np.asarray(p).reshape(-1)
        if type(x) is not np.ndarray or x.dtype != x0.dtype or x.ndim != r:
            return None
        if p.size != 2 * r or (p < 0).any():
            return None
        moved = [a for a in range(r) if p[a] or p[r + a]]
        if len(moved) > 1:
            return None
        a = moved[0] if moved else axis if axis is not None else 0
        if axis is None:
            axis = a
        if a != axis or any(x.shape[b] != x0.shape[b] for b in range(r) if b != a):
            return None
        n = int(p[a]) + x.shape[a] + int(p[r + a])
        if size is None:
            size = n
        if n != size:
            return None
        placed.append((int(p[a]), x))
    placed.sort(key=lambda t: t[0])
    at = 0
    for begin, x in placed:
        if begin != at:
            return None
        at += x.shape[axis]  # type: ignore[index]
    if at != size:
        return None
    return [x for _, x in placed], axis  # type: ignore[return-value]


def _plus_zero(x: np.ndarray) -> np.ndarray:
    """``x + 0``: -0.0 made +0.0, as the Sum's additions of the zero padding make it."""
    return np.add(x, 0.0)


def _pads_concat(plan: Plan, members: list[Step], total: Step) -> Callable:
    """The fused step's kernel: inputs are (x0, pads0, x1, pads1, ...)."""

    def run(inputs: Sequence[Any], attrs: Attrs) -> Sequence[Any]:
        xs, ps = inputs[0::2], inputs[1::2]
        tiles = _tiles(xs, ps)
        if tiles is not None:
            pieces, axis = tiles
            shape = list(pieces[0].shape)
            shape[axis] = sum(x.shape[axis] for x in pieces)
            y = np.empty(shape, pieces[0].dtype)
            at = 0
            half = y.dtype == half_cast.HALF and y.size >= half_cast.TABLE_MIN
            for x in pieces:  # each piece + 0 into its place: -0.0 + 0.0 = +0.0, as the Sum's additions give
                n = x.shape[axis]
                place = y[(slice(None),) * axis + (slice(at, at + n),)]
                if half:  # numpy's float16 add converts every value: a lookup in its results instead
                    half_cast.by_table(_plus_zero, x, out=place)
                else:
                    np.add(x, 0.0, out=place)
                at += n
            return (y,)
        padded = [plan._call(st, [x, p, *(None,) * (len(st.inputs) - 2)])[0]
                  for st, x, p in zip(members, xs, ps)]
        return plan._call(total, padded)

    return run
