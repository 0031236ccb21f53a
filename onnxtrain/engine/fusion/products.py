"""Per-channel sums of products: ``ReduceSum(Mul(a, b))`` (or ``ReduceMean``) over every axis but axis 1,
whose product nothing else reads, becomes one step that sums a·b per channel by BLAS dot products
(:func:`onnxtrain.engine.kernels.reduce.channel_axes_sum`) without writing the product: BatchNorm's gradient
takes Σ dY·(X − mean) and Σ (X − mean)² that way, each a pass and an activation-sized array fewer. The sums
differ from the unfused ones by rounding only (each product is no longer rounded before it is added); a sum
that comes out infinite or NaN is made again by the original steps, whose order of the same terms may not
overflow (and whose NaN is the unfused plan's)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from onnxtrain.engine.fusion.common import (
    consumers,
    keeps_dims,
    make_step,
    producers,
    protected_slots,
    run_steps,
    static_axes,
)
from onnxtrain.engine.kernels.reduce import channel_axes_sum
from onnxtrain.engine.registry import Attrs
from onnxtrain.ir.graphs import DEFAULT_DOMAINS

if TYPE_CHECKING:
    from onnxtrain.engine.plan import Plan, Step

REDUCTIONS = ("ReduceSum", "ReduceMean")


def fuse_channel_dots(plan: Plan, steps: list[Step]) -> list[Step]:
    """Each ``ReduceSum``/``ReduceMean`` of a ``Mul`` that only it reads, with axes known now → one step."""
    cons, prod, kept = consumers(steps), producers(steps), protected_slots(plan)
    drop: set[int] = set()
    replace: dict[int, Step] = {}
    for k, red in enumerate(steps):
        if red.node.op_type not in REDUCTIONS or red.node.domain not in DEFAULT_DOMAINS or red.inputs[0] < 0:
            continue
        axes = static_axes(plan, red)
        s = red.inputs[0]
        m = prod.get(s)
        if axes is None or m is None or m in drop or s in kept or cons.get(s) != [k]:
            continue
        mul = steps[m]
        if (mul.node.op_type != "Mul" or mul.node.domain not in DEFAULT_DOMAINS or len(mul.inputs) != 2
                or min(mul.inputs) < 0):
            continue
        keepdims = keeps_dims(red)
        ins = (*mul.inputs, *red.inputs[1:])
        fn = channel_dot_kernel(plan, [mul, red], ins, axes, keepdims, red.node.op_type == "ReduceMean")
        replace[k] = make_step(plan, "ChannelDot", [mul, red], ins, red.outputs, fn)
        drop.add(m)
    return [replace.get(k, st) for k, st in enumerate(steps) if k not in drop]


def channel_dot_kernel(plan: Plan, members: list[Step], ins: Sequence[int], axes: list[int], keepdims: bool,
                       mean: bool) -> Callable[[Sequence[Any], Attrs], Sequence[Any]]:
    """The fused step's kernel: per-channel dot products for contiguous float32/64 operands of one shape
    reduced over every axis but 1; the original two steps for anything else."""
    out = members[-1].outputs[0]

    def run(inputs: Sequence[Any], attrs: Attrs) -> Sequence[Any]:
        a, b = inputs[0], inputs[1]
        if (type(a) is np.ndarray and type(b) is np.ndarray and a.shape == b.shape and a.dtype == b.dtype
                and a.size):
            y = channel_axes_sum(a, axes, keepdims, other=b)
            if y is not None and np.isfinite(y).all():  # (C values: a check of microseconds)
                if mean:
                    y /= a.size // a.shape[1]
                return (y,)
        env = dict(zip(ins, inputs))
        run_steps(plan, members, env)
        return (env[out],)

    return run
