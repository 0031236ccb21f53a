"""A training-mode BatchNormalization hands its batch statistics to the gradient that recomputes them.

Standard ONNX has no output for a BatchNormalization's batch mean and variance (opset 14 dropped them), so
its gradient graph recomputes both from X: ``ReduceMean(X)`` over every axis but 1, ``D = X − mean`` and
``ReduceMean(D·D)`` (:func:`onnxtrain.autodiff.rules.normalization.batch_norm_grad`). The forward kernel
has just computed the same two sums the same way (per-channel BLAS sums of the same arrays, divided by the
same count), so this pass drops the two reductions and makes the forward step write them into the slots
they filled: two passes over X and D fewer per BatchNorm in a CNN's backward, the same bits.

The values are handed over only where they are those bits: X a C-contiguous float32/float64 array of rank
3 or more with more than one value per (image, channel) plane, and the reductions over every axis but 1
(checked at run time). Anything else runs the dropped steps' own kernels inside the fused step, so the
fusion changes nothing a graph computes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from onnxtrain.engine.fusion.common import (
    FLOATS,
    consumers,
    keeps_dims,
    make_step,
    protected_slots,
    static_axes,
)
from onnxtrain.engine.fusion.products import channel_dot_kernel
from onnxtrain.engine.kernels.normalization import batch_norm_training, batch_normalization
from onnxtrain.engine.registry import Attrs
from onnxtrain.ir.graphs import DEFAULT_DOMAINS

if TYPE_CHECKING:
    from onnxtrain.engine.plan import Plan, Step


def share_batch_statistics(plan: Plan, steps: list[Step]) -> list[Step]:
    """Each training-mode BatchNormalization step whose input a later ``ReduceMean`` over every axis but 1
    averages (and, when the gradient goes on to it, whose ``ReduceMean(D·D)`` of ``D = X − mean`` gives the
    variance) → one step that also writes those means."""
    cons, kept = consumers(steps), protected_slots(plan)
    drop: set[int] = set()
    replace: dict[int, Step] = {}
    for k, bn in enumerate(steps):
        if bn.fn is not batch_normalization or not bn.attrs.get("training_mode") or bn.inputs[0] < 0:
            continue
        x = bn.inputs[0]
        found = _mean_of(plan, steps, cons, x, k, drop)
        if found is None:
            continue
        m, axes, keepdims = found
        var = _variance_of(plan, steps, cons, kept, x, steps[m], axes, drop)
        members = [bn, steps[m]] + ([steps[i] for i in var] if var else [])  # (the Sub stays a step)
        outs = (*bn.outputs, steps[m].outputs[0]) + ((steps[var[2]].outputs[0],) if var else ())
        mean_axes = tuple(steps[m].inputs[1:])
        var_axes = tuple(steps[var[2]].inputs[1:]) if var else ()
        fn = _kernel(plan, members, axes, keepdims, len(bn.inputs), len(mean_axes))
        named = [m for m in members[1:] if m.node.op_type != "Sub"] + [bn]  # the step is named after bn
        replace[k] = make_step(plan, "BatchNormalizationStats", named, (*bn.inputs, *mean_axes, *var_axes),
                               outs, fn)
        drop.add(m)
        if var:
            drop.update((var[1], var[2]))
    if not replace:
        return steps
    return [replace.get(k, st) for k, st in enumerate(steps) if k not in drop]


def _mean_of(plan: Plan, steps: list[Step], cons: dict[int, list[int]], x: int, after: int,
             drop: set[int]) -> tuple[int, list[int], bool] | None:
    """(index, axes, keepdims) of the first ReduceMean after step ``after`` of slot ``x`` over every axis
    but 1 (of a rank its axes imply), or None."""
    for m in cons.get(x, ()):
        st = steps[m]
        if (m <= after or m in drop or st.node.op_type != "ReduceMean"
                or st.node.domain not in DEFAULT_DOMAINS):
            continue
        axes = static_axes(plan, st)
        rank = len(axes) + 1 if axes else 0
        if (axes and rank >= 3 and all(-rank <= a < rank for a in axes)
                and sorted(a % rank for a in axes) == [0, *range(2, rank)]):
            return m, axes, keeps_dims(st)
    return None


def _variance_of(plan: Plan, steps: list[Step], cons: dict[int, list[int]], kept: set[int], x: int,
                 mean: Step, axes: list[int], drop: set[int]) -> tuple[int, int, int] | None:
    """(Sub, Mul, ReduceMean) step indices of ``ReduceMean(D·D)`` with ``D = Sub(x, mean)``, over the same
    axes and fusable as a per-channel dot product (:func:`onnxtrain.engine.fusion.products.fuse_channel_dots`
    would take it: the Mul read by the reduction alone), or None. The mean must keep its axes: one of shape
    (C,) is subtracted along X's last axis, not per channel, so that variance is not the forward's."""
    if not keeps_dims(mean):
        return None
    for s in cons.get(mean.outputs[0], ()):
        sub = steps[s]
        if (sub.node.op_type != "Sub" or sub.node.domain not in DEFAULT_DOMAINS
                or sub.inputs[:2] != (x, mean.outputs[0]) or s in drop):
            continue
        d = sub.outputs[0]
        for p in cons.get(d, ()):
            mul = steps[p]
            if (mul.node.op_type != "Mul" or mul.node.domain not in DEFAULT_DOMAINS or mul.inputs != (d, d)
                    or p in drop or mul.outputs[0] in kept or len(cons.get(mul.outputs[0], ())) != 1):
                continue
            r = cons[mul.outputs[0]][0]
            red = steps[r]
            if (red.node.op_type != "ReduceMean" or red.node.domain not in DEFAULT_DOMAINS or r in drop
                    or red.inputs[0] != mul.outputs[0]):
                continue
            red_axes = static_axes(plan, red)
            if (red_axes is not None and sorted(red_axes) == sorted(axes)
                    and keeps_dims(red) == keeps_dims(mean)):
                return s, p, r
    return None


def _kernel(plan: Plan, members: list[Step], axes: list[int], keepdims: bool, n_bn: int,
            n_axes: int) -> Callable[[Sequence[Any], Attrs], Sequence[Any]]:
    """The fused step's kernel: the BatchNorm's outputs, then the mean (and the variance) in the dropped
    reductions' shape and dtype; the dropped steps' own kernels where the forward's sums are not theirs.
    Its inputs: the BatchNorm's, then the mean's axes input (if any), then the variance's."""
    bn, mean_step = members[0], members[1]
    var = len(members) > 2
    dot = None
    if var:
        mul, red = members[3], members[4]
        dot = channel_dot_kernel(plan, [mul, red], (*mul.inputs, *red.inputs[1:]), axes, keepdims, True)

    def run(inputs: Sequence[Any], attrs: Attrs) -> Sequence[Any]:
        x = inputs[0]
        bn_in = list(inputs[:n_bn])
        if _hands_over(x, axes):
            outs, bm, bv = batch_norm_training(bn_in, bn.attrs)
            shape = (1, x.shape[1]) + (1,) * (x.ndim - 2) if keepdims else (x.shape[1],)
            return (*outs, bm.reshape(shape)) + ((bv.reshape(shape),) if var else ())
        outs = plan._call(bn, bn_in)
        mean = plan._call(mean_step, [x, *inputs[n_bn:n_bn + n_axes]])[0]
        if dot is None:
            return (*outs, mean)
        d = plan._call(members[2], [x, mean])[0]
        return (*outs, mean, dot([d, d, *inputs[n_bn + n_axes:]], attrs)[0])

    return run


def _hands_over(x: Any, axes: list[int]) -> bool:
    """True when the forward kernel's batch sums of ``x`` are, bit for bit, what the reductions over
    ``axes`` would give: both go by :func:`onnxtrain.engine.kernels.reduce.channel_sum`."""
    return (type(x) is np.ndarray and x.dtype in FLOATS and x.ndim >= 3 and x.ndim == len(axes) + 1
            and x.flags.c_contiguous and x.size > x.shape[0] * x.shape[1])
