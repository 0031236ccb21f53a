"""A depthwise Conv's weight gradient read straight from X and dY.

The gradient builder writes a grouped Conv's weight gradient (``weight_grad`` in autodiff/rules/conv.py) as
one Conv whose images are the input channels of a group and whose channels are the batch's planes:
X (N, C, S…) → Reshape (N, G, C/G, L) → Transpose (C/G, G, N, L) → Reshape (C/G, G·N, S…), dY (N, M, O…) →
(N, G, M/G, L′) → (G, M/G, N, L′) → (M, N, O…), Conv(group=G), then a Transpose to (M, C/G, k…). Each
Reshape after a Transpose copies its tensor whole (16 × 96 × 112², MobileNetV2's first strided depthwise
layer at 224 px: 8.5 ms of a 90 ms step). With one input channel a group (a depthwise Conv), that Conv's one
image is X's planes in channel-major order, so the fused step hands X and dY as views in that order to the
depthwise kernels (:func:`onnxtrain.engine.kernels.depthwise.weight_grad_planes`), which copy them into their
own padded, split buffers anyway, block by block; where those decline, the original steps run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from onnxtrain.engine.fusion.common import (
    absorb_crop,
    constant_of,
    consumers,
    crop_axes,
    make_step,
    producers,
    protected_slots,
    run_steps,
    swapped_conv,
    transposes_by,
)
from onnxtrain.engine.kernels import depthwise
from onnxtrain.engine.kernels.conv import conv_geometry
from onnxtrain.engine.registry import Attrs

if TYPE_CHECKING:
    from onnxtrain.engine.plan import Plan, Step

X_PERM = (2, 1, 0)  # (N, G, C/G, L) → (C/G, G, N, L)
DY_PERM = (1, 2, 0)  # (N, G, M/G, L′) → (G, M/G, N, L′)


def fuse_grouped_weight_grads(plan: Plan, steps: list[Step]) -> list[Step]:
    """Transpose(Conv(Reshape(Transpose(Reshape(X))), Reshape(Transpose(Reshape(dY)))), swapping the first
    two axes) as the gradient builder writes a depthwise Conv's weight gradient → one step of (X, dY)."""
    cons, prod, kept = consumers(steps), producers(steps), protected_slots(plan)
    drop: set[int] = set()
    replace: dict[int, Step] = {}
    for k, last in enumerate(steps):
        c = swapped_conv(steps, prod, last)
        group = 1 if c is None else int(steps[c].attrs.get("group") or 1)
        if group < 2:
            continue
        conv = steps[c]
        xa = _laid_out(plan, steps, prod, conv.inputs[0], X_PERM, group)
        da = _laid_out(plan, steps, prod, conv.inputs[1], DY_PERM, group)
        if xa is None or da is None or xa[1] != 1:  # one input channel a group only
            continue
        chain = [*xa[0], *da[0]]
        links = [*zip(xa[0], [*xa[0][1:], c]), *zip(da[0], [*da[0][1:], c]), (c, k)]
        if any(cons.get(steps[a].outputs[0]) != [b] or steps[a].outputs[0] in kept for a, b in links):
            continue
        members = [steps[i] for i in chain] + [conv, last]
        inner = {steps[a].outputs[0] for a, _ in links}
        ins = tuple(dict.fromkeys(s for m in members[:-2] for s in m.inputs if s not in inner))
        # a Slice after it: only the kernel's own taps are computed (its bounds: inputs of the unfused steps)
        at, crop, bounds = absorb_crop(plan, steps, cons, kept, k, members, drop)
        ins = tuple(dict.fromkeys((*ins, *(s for s in bounds if s >= 0))))
        replace[at] = make_step(plan, "FusedDepthwiseWeightGrad", members, ins, members[-1].outputs,
                                _weight_grad(plan, members, ins, group, da[1], (xa[2], da[2]), crop))
        drop.update((*chain, c))
    return [replace.get(k, st) for k, st in enumerate(steps) if k not in drop]


def _laid_out(plan: Plan, steps: list[Step], prod: dict[int, int], slot: int, perm: tuple[int, ...],
              group: int) -> tuple[list[int], int, list[int]] | None:
    """When ``slot`` is Reshape(Transpose(Reshape(T, [0, group, per, -1]), perm), shape) with a constant
    shape: the three steps' indices (first one first), ``per`` and that shape; else None."""
    r2 = prod.get(slot)
    if r2 is None or steps[r2].node.op_type != "Reshape" or len(steps[r2].inputs) != 2:
        return None
    t = prod.get(steps[r2].inputs[0])
    if t is None or not transposes_by(steps[t], perm) or len(steps[t].attrs.get("perm") or []) != 4:
        return None
    r1 = prod.get(steps[t].inputs[0])
    if r1 is None or steps[r1].node.op_type != "Reshape" or len(steps[r1].inputs) != 2:
        return None
    first, second = constant_of(plan, steps[r1].inputs[1]), constant_of(plan, steps[r2].inputs[1])
    if first is None or second is None:
        return None
    first = [int(v) for v in np.asarray(first).reshape(-1)]
    if len(first) != 4 or first[0] != 0 or first[1] != group or first[2] < 1 or first[3] != -1:
        return None
    if int(steps[r1].attrs.get("allowzero") or 0) or int(steps[r2].attrs.get("allowzero") or 0):
        return None
    return [r1, t, r2], first[2], [int(v) for v in np.asarray(second).reshape(-1)]


def _weight_grad(plan: Plan, members: list[Step], ins: tuple[int, ...], group: int, per_group: int,
                 shapes: tuple[list[int], list[int]], crop: dict[int, int] | None) -> Callable:
    """The fused step's kernel; ``crop``: the Slice after the Transpose (the last member) as axis → end, or
    None (then the Conv and the Transpose are the last two members)."""
    conv = members[-3] if crop is not None else members[-2]
    at: Attrs = conv.attrs
    x_at, dy_at = ins.index(members[0].inputs[0]), ins.index(members[3].inputs[0])

    def run(inputs: Sequence[Any], attrs: Attrs) -> Sequence[Any]:
        x, dy = inputs[x_at], inputs[dy_at]
        y = _direct(x, dy, at, group, per_group, shapes, crop)
        if y is not None:
            return (y,)
        env = dict(zip(ins, inputs, strict=True))
        run_steps(plan, members, env)
        return (env[members[-1].outputs[0]],)

    return run


def _direct(x: Any, dy: Any, at: Attrs, group: int, mg: int, shapes: tuple[list[int], list[int]],
            crop: dict[int, int] | None) -> np.ndarray | None:
    """The weight gradient (M, 1, k…) of a depthwise Conv with input ``x`` (N, G, S…) and output gradient
    ``dy`` (N, G·mg, O…) by the depthwise kernels, its kernel axes cut to the ends ``crop`` gives, or None
    where they do not take it (or where the Reshapes' ``shapes`` would not lay them out as (1, G·N, S…) and
    (M, N, O…), or the crop is not of the kernel's axes alone)."""
    if (type(x) is not np.ndarray or type(dy) is not np.ndarray or x.ndim < 3 or dy.ndim != x.ndim
            or x.dtype != dy.dtype or x.shape[0] != dy.shape[0] or x.shape[1] != group
            or dy.shape[1] != group * mg):
        return None
    n, m, sp, osp = x.shape[0], dy.shape[1], x.shape[2:], dy.shape[2:]
    if (shapes[0] not in ([1, -1, *sp], [1, group * n, *sp])
            or shapes[1] not in ([m, -1, *osp], [m, n, *osp])):
        return None
    axes = crop_axes(crop, x.ndim)
    if any(not 2 <= a < x.ndim for a in axes):
        return None
    xs = x.swapaxes(0, 1)
    try:
        g = conv_geometry(at, (1, group * n) + sp, (m, n) + osp)
        if any(axes.get(2 + i, o) < o for i, o in enumerate(g["out"])):
            cut, xs = _cut(at, g, [axes.get(2 + i) for i in range(len(sp))], xs)
            g = conv_geometry(cut, (1, group * n) + xs.shape[2:], (m, n) + osp)
    except ValueError:
        return None  # let the Conv itself say what is wrong
    wv = dy.reshape((n, group, mg) + osp).transpose((1, 2, 0) + tuple(range(3, 3 + len(osp))))
    y = depthwise.weight_grad_planes(xs, wv, g)
    return None if y is None else y.reshape((m, 1) + y.shape[1:])


def _cut(at: Attrs, g: dict[str, Any], limit: list[int | None], xs: np.ndarray) -> tuple[Attrs, np.ndarray]:
    """The weight-gradient Conv of geometry ``g`` (attributes ``at``) made to compute only its first
    ``limit`` outputs per axis (None: all): its end pads less the inputs the dropped outputs alone read, and
    where those pads run out, ``xs`` (group, cg, S…) cut short; returns its attributes and the cut input."""
    nd = g["nd"]
    pe = [int(v) for v in (at.get("pads") or [0] * 2 * nd)[nd:]]
    sizes = list(xs.shape[2:])
    for i, c in enumerate(limit):
        if c is not None and c < g["out"][i]:
            pe[i] -= (g["out"][i] - c) * g["strides"][i]
            if pe[i] < 0:
                sizes[i] += pe[i]
                pe[i] = 0
    pads = [*g["pb"], *pe]
    cut = at.cached(("cut", tuple(pads)), lambda: Attrs(
        {"pads": pads, "strides": g["strides"], "dilations": g["dil"], "group": g["group"]}))
    return cut, xs[(Ellipsis, *(slice(0, s) for s in sizes))]
