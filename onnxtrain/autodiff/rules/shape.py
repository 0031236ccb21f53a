"""Gradient rules of the shape-manipulation ops (same names and order as engine/kernels/shape.py).

Most of these ops only move elements, so their gradient moves ``dY`` back: an inverse reshape or
transpose, a Split for Concat, a Pad for Slice. Ops whose routing is awkward to invert (Slice with
steps, Pad reflect/edge/wrap) use the iota trick of ``route_back``: run the forward op on the flat
positions of ``X`` and scatter ``dY`` to the positions each output element came from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from onnx import TensorProto, numpy_helper

from onnxtrain.autodiff.context import GradCtx, RuleError
from onnxtrain.autodiff.registry import gradient, no_gradient
from onnxtrain.ir.types import np_dtype

I64 = TensorProto.INT64
_BIG = np.iinfo(np.int64).max


# ---- helpers shared with indexing.py ---------------------------------------------------
def const_input(g: GradCtx, i: int) -> np.ndarray | None:
    """The value of forward input ``i`` when it is fixed (an initializer or a Constant), else None."""
    return g.constant_value(i)


def zeros(g: GradCtx, shape: str, value: float = 0.0, elem: int | None = None) -> str:
    """``ConstantOfShape(shape)`` filled with ``value`` of the node's float type (or ``elem``)."""
    dt = np_dtype(g.dtype if elem is None else elem)
    return g.emit("ConstantOfShape", shape, value=numpy_helper.from_array(np.full(1, value, dtype=dt)))


def as_int64(g: GradCtx, name: str) -> str:
    """``name`` cast to int64 when it is known to be int32 (Slice/Gather accept both)."""
    return g.emit("Cast", name, to=I64) if g.elem_type(name) == TensorProto.INT32 else name


def route_back(g: GradCtx, dy: str, forward: Callable[[str], str], repeats: bool) -> str:
    """dX of an op that only copies elements of input 0, by the iota trick.

    ``forward(iota)`` applies the op to ``iota = Reshape(Range(0, Size(X)), Shape(X))``, giving for
    each output element the flat position it was copied from; ``dY`` is then scattered to those
    positions (``reduction="add"`` when ``repeats``: an element copied several times sums its
    gradients). Costs one int64 tensor of X's size.
    """
    sh = g.shape(0)
    n = g.emit("ReduceProd", sh, keepdims=0)
    iota = g.emit("Reshape", g.emit("Range", g.const(0, I64), n, g.const(1, I64)), sh)
    src = g.emit("Reshape", forward(iota), g.ints([-1]))
    flat_zeros = zeros(g, g.emit("Reshape", n, g.ints([1])))
    flat_dy = g.emit("Reshape", dy, g.ints([-1]))
    red = "add" if repeats else None
    return g.emit("Reshape", g.emit("ScatterElements", flat_zeros, src, flat_dy, axis=0, reduction=red), sh)


def trim(*names: str | None) -> list[str | None]:
    """Node inputs without trailing absent (None) optional ones."""
    out = list(names)
    while out and out[-1] is None:
        out.pop()
    return out


def _inputs(g: GradCtx, idx: Sequence[int]) -> list[str | None]:
    """Forward input names (None for absent ones), without trailing absent inputs."""
    return trim(*(g.x(i) if g.has_x(i) else None for i in idx))


def _reshape_back(g: GradCtx) -> None:
    # dX = Reshape(dY, Shape(X)); allowzero keeps literal zero dims of an empty X
    g.set_dx(0, g.emit("Reshape", g.dy(0), g.shape(0), allowzero=1))


# ---- rules -------------------------------------------------------------------------------
@gradient("Reshape", stop=(1,), linear=True)
def reshape_grad(g: GradCtx) -> None:
    _reshape_back(g)


@gradient("Transpose", linear=True)
def transpose_grad(g: GradCtx) -> None:
    perm = g.attr("perm")
    if not perm:  # reversing the axes is its own inverse
        g.set_dx(0, g.emit("Transpose", g.dy(0)))
        return
    g.set_dx(0, g.emit("Transpose", g.dy(0), perm=[int(a) for a in np.argsort(perm)]))


@gradient("Concat", linear=True)
def concat_grad(g: GradCtx) -> None:
    # dX_i = the i-th piece of dY split along the axis with the inputs' sizes
    axis = g.attr("axis")
    n = g.n_inputs
    if n == 1:
        g.set_dx(0, g.dy(0))
        return
    shapes = [g.static_shape(i) for i in range(n)]
    if all(s is not None and -len(s) <= axis < len(s) and s[axis] is not None for s in shapes):
        split = g.ints([s[axis] for s in shapes])  # type: ignore[index]
    else:
        ax = g.ints([axis])
        split = g.emit("Concat", *(g.emit("Gather", g.shape(i), ax) for i in range(n)), axis=0)
    parts = g.emit("Split", g.dy(0), split, axis=axis, outputs=n)
    for i in range(n):
        g.set_dx(i, parts[i])


@gradient("Split", stop=(1,), linear=True)
def split_grad(g: GradCtx) -> None:
    # dX = Concat(dY_0, dY_1, ...) with zeros for outputs that get no gradient
    parts = [g.dy(i) or zeros(g, g.shape(i, output=True)) for i in range(g.n_outputs)]
    g.set_dx(0, parts[0] if len(parts) == 1 else g.emit("Concat", *parts, axis=g.attr("axis")))


def _clamp_index(g: GradCtx, v: str, dims: str, neg_dims: str) -> str:
    """A Slice start/end (step > 0) clamped as the spec does: negatives count from the end, then [0, dim]."""
    v = g.emit("Min", g.emit("Max", v, neg_dims), dims)  # clamp first so adding dim cannot overflow
    return g.emit("Where", g.emit("Less", v, g.const(0, I64)), g.emit("Add", v, dims), v)


def _static_slice_pads(g: GradCtx, starts: np.ndarray, ends: np.ndarray,
                       axes: np.ndarray | None) -> list[int] | None:
    """Full Pad pads undoing a unit-step Slice when X's shape is known, else None."""
    xs = g.static_shape(0)
    if xs is None:
        return None
    rank = len(xs)
    axes_l = list(range(len(starts))) if axes is None else [int(a) % rank for a in axes.reshape(-1)]
    pads = [0] * (2 * rank)
    for a, s, e in zip(axes_l, starts.reshape(-1).tolist(), ends.reshape(-1).tolist()):
        d = xs[a]
        if d is None:
            return None
        s = min(max(s + d if s < 0 else s, 0), d)
        e = max(min(max(e + d if e < 0 else e, 0), d), s)
        pads[a], pads[rank + a] = s, d - e
    return pads


@gradient("Slice", uses=("x1", "x2", "x3", "x4"), stop=(1, 2, 3, 4), linear=True)
def slice_grad(g: GradCtx) -> None:
    dy = g.dy(0)
    steps = const_input(g, 4)
    if g.has_x(4) and (steps is None or np.any(steps != 1)):
        # any steps (negative, > 1): the iota trick; sliced positions are distinct, so no reduction
        args = _inputs(g, (1, 2, 3, 4))
        g.set_dx(0, route_back(g, dy, lambda iota: g.emit("Slice", iota, *args), repeats=False))
        return
    # unit steps: dX = Pad(dY, begin = clamped start, end = dim - clamped end)
    starts, ends, axes = const_input(g, 1), const_input(g, 2), const_input(g, 3)
    if starts is not None and ends is not None and (axes is not None or not g.has_x(3)):
        pads = _static_slice_pads(g, starts, ends, axes)
        if pads is not None:
            g.set_dx(0, g.emit("Pad", dy, g.ints(pads)) if any(pads) else dy)
            return
    sh = g.shape(0)
    if g.has_x(3):
        ax = g.x(3)
    else:
        n = g.static_shape(1)
        if n is not None and n[0] is not None:
            ax = g.ints(range(n[0]))
        else:
            ax = g.emit("Range", g.const(0, I64), g.emit("Size", g.x(1)), g.const(1, I64))
    dims = g.emit("Gather", sh, ax)
    neg_dims = g.emit("Neg", dims)
    s = _clamp_index(g, as_int64(g, g.x(1)), dims, neg_dims)
    e = g.emit("Max", _clamp_index(g, as_int64(g, g.x(2)), dims, neg_dims), s)
    begin, end = s, g.emit("Sub", dims, e)
    # spread the per-axis pads over all axes (ScatterElements accepts negative axes), never Pad's axes
    # input (opset >= 18): onnxruntime 1.32's transpose optimizer permutes the pads of a Pad with axes as
    # if they covered every axis (the graph then fails in a Gather it inserts), and it knows the rank from
    # a Transpose's perm even where the graph declares none
    rank = g.rank(0)
    zr = g.ints([0] * rank) if rank is not None else zeros(g, g.emit("Shape", sh), elem=I64)
    full_b = g.emit("ScatterElements", zr, ax, begin, axis=0)
    full_e = g.emit("ScatterElements", zr, ax, end, axis=0)
    g.set_dx(0, g.emit("Pad", dy, g.emit("Concat", full_b, full_e, axis=0)))


@gradient("Squeeze", stop=(1,), linear=True)
def squeeze_grad(g: GradCtx) -> None:
    _reshape_back(g)


@gradient("Unsqueeze", stop=(1,), linear=True)
def unsqueeze_grad(g: GradCtx) -> None:
    _reshape_back(g)


@gradient("Flatten", linear=True)
def flatten_grad(g: GradCtx) -> None:
    _reshape_back(g)


@gradient("Expand", stop=(1,), linear=True)
def expand_grad(g: GradCtx) -> None:
    # dX = dY summed over the broadcast axes
    g.set_dx(0, g.unbroadcast(g.dy(0), 0))


no_gradient("Shape", "Size", "Constant", "ConstantOfShape", "Range")


@gradient("Tile", uses=("x1",), stop=(1,), linear=True)
def tile_grad(g: GradCtx) -> None:
    # Y viewed as (r0, d0, r1, d1, ...): dX = ReduceSum(Reshape(dY, that), axes of the r_i)
    dy = g.dy(0)
    xs, reps = g.static_shape(0), const_input(g, 1)
    if xs is not None and reps is not None and None not in xs:
        target: list[int] = []
        axes: list[int] = []
        for r, d in zip(reps.reshape(-1).tolist(), xs):
            if r != 1:
                axes.append(len(target))
                target.append(r)
            target.append(d)  # type: ignore[arg-type]
        if not axes:
            g.set_dx(0, dy)
            return
        viewed = g.emit("Reshape", dy, g.ints(target), allowzero=1)  # (its sizes are real: 0 is empty)
        g.set_dx(0, g.reduce("ReduceSum", viewed, axes, keepdims=0))
        return
    rank = g.rank(0)
    if rank is None:
        g.set_dx(0, route_back(g, dy, lambda iota: g.emit("Tile", iota, g.x(1)), repeats=True))
        return
    one = g.ints([1])
    pairs = g.emit("Concat", g.emit("Unsqueeze", g.x(1), one), g.emit("Unsqueeze", g.shape(0), one), axis=1)
    viewed = g.emit("Reshape", dy, g.emit("Reshape", pairs, g.ints([-1])), allowzero=1)
    g.set_dx(0, g.reduce("ReduceSum", viewed, list(range(0, 2 * rank, 2)), keepdims=0))


@gradient("Pad", uses=("x1", "x2", "x3"), stop=(1, 3), linear=True)
def pad_grad(g: GradCtx) -> None:
    dy = g.dy(0)
    mode = g.attr("mode") or "constant"
    axes = g.x(3) if g.has_x(3) else None
    if axes is not None and g.elem_type(g.node.input[3]) != I64:  # (int32 axes beside the int64 starts)
        axes = g.emit("Cast", axes, to=I64)
    if mode != "constant":
        if g.needs_dx(2):  # the constant value is not used by the other modes
            g.set_dx(2, g.zeros_like(g.x(2)))
        # reflect / edge / wrap copy border elements several times: iota trick with scatter-add
        g.set_dx(0, route_back(g, dy, lambda iota: g.emit("Pad", *trim(iota, g.x(1), None, axes), mode=mode),
                               repeats=True))
        return
    # constant: dX = dY with the padding sliced off; negative pads (crops) come back as zero padding
    pads = const_input(g, 1)
    if pads is not None:
        p = pads.reshape(2, -1).astype(np.int64)
        b, e = np.maximum(p[0], 0), np.maximum(p[1], 0)
        out = dy
        if b.any() or e.any():
            ends = [-int(v) if v > 0 else _BIG for v in e]
            out = g.emit("Slice", *trim(dy, g.ints(b.tolist()), g.ints(ends), axes))
        if (p < 0).any():
            out = g.emit("Pad", *trim(out, g.ints(np.maximum(-p, 0).reshape(-1).tolist()), None, axes))
        g.set_dx(0, out)
        _constant_value_grad(g, dy)
        return
    zero = g.const(0, I64)
    pr = g.emit("Reshape", g.x(1), g.ints([2, -1]))
    pos = g.emit("Max", pr, zero)
    b = g.emit("Gather", pos, zero, axis=0)
    e = g.emit("Gather", pos, g.const(1, I64), axis=0)
    ends = g.emit("Where", g.emit("Greater", e, zero), g.emit("Neg", e), g.const(_BIG, I64))
    sliced = g.emit("Slice", *trim(dy, b, ends, axes))
    crop = g.emit("Max", g.emit("Neg", g.x(1)), zero)
    dx = g.emit("Pad", *trim(sliced, crop, None, axes))
    g.set_dx(0, dx)
    _constant_value_grad(g, dy)


def _constant_value_grad(g: GradCtx, dy: str) -> None:
    """The constant value's gradient: dY summed over the cells it fills, picked by padding zeros shaped like
    X with ones (summing those cells alone keeps the sum's rounding theirs; all of dY less X's part lost
    digits on large tensors)."""
    if not g.needs_dx(2):
        return
    zero = numpy_helper.from_array(np.zeros(1, np_dtype(g.dtype)))
    blank = g.emit("ConstantOfShape", g.shape(0), value=zero)
    axes = g.x(3) if g.has_x(3) else None
    filled = g.emit("Pad", *trim(blank, g.x(1), g.const(np.array(1.0)), axes))
    total = g.reduce("ReduceSum", g.emit("Mul", dy, filled), None, keepdims=0)
    g.set_dx(2, g.emit("Reshape", total, g.shape(2)))


def _block_split_shape(g: GradCtx, bs: int) -> str:
    """(N, H, W, b², C/b²) of DepthToSpace's input X (N, C, H, W): the dims themselves, so that a 0 among
    them stays one (``[0, 0, 0, b², -1]`` copies dims and infers C', which ONNX refuses next to a 0)."""
    dims = g.static_shape(0)
    if dims is not None and all(d is not None for d in dims):
        n, c, h, w = dims
        return g.ints([n, h, w, bs * bs, c // (bs * bs)])
    shape = g.shape(0)
    nhw = g.emit("Gather", shape, g.ints([0, 2, 3]), axis=0)
    c = g.emit("Div", g.emit("Gather", shape, g.ints([1]), axis=0), g.ints([bs * bs]))
    return g.emit("Concat", nhw, g.ints([bs * bs]), c, axis=0)


@gradient("DepthToSpace", linear=True)
def depth_to_space_grad(g: GradCtx) -> None:
    bs = g.attr("blocksize")
    # DCR: SpaceToDepth is the exact inverse
    d = g.emit("SpaceToDepth", g.dy(0), blocksize=bs)
    if g.attr("mode") == "CRD":
        # SpaceToDepth orders channels (bi, bj, c); CRD wants (c, bi, bj): move the block axes behind c
        t = g.emit("Transpose", d, perm=[0, 2, 3, 1])  # (N, H, W, b²·C')
        t = g.emit("Reshape", t, _block_split_shape(g, bs), allowzero=1)  # (N, H, W, b², C')
        t = g.emit("Transpose", t, perm=[0, 4, 3, 1, 2])  # (N, C', b², H, W)
        d = g.emit("Reshape", t, g.shape(0))
    g.set_dx(0, d)


@gradient("SpaceToDepth", linear=True)
def space_to_depth_grad(g: GradCtx) -> None:
    if g.attr("mode") == "CRD":  # only in opsets newer than 21
        raise RuleError("SpaceToDepth with mode CRD has no gradient rule yet")
    g.set_dx(0, g.emit("DepthToSpace", g.dy(0), blocksize=g.attr("blocksize"), mode="DCR"))


@gradient("ReverseSequence", uses=("x1",), stop=(1,), linear=True)
def reverse_sequence_grad(g: GradCtx) -> None:
    # reversing the same prefixes again is the inverse permutation
    g.set_dx(0, g.emit("ReverseSequence", g.dy(0), g.x(1), batch_axis=g.attr("batch_axis"),
                       time_axis=g.attr("time_axis")))


no_gradient("EyeLike")


@gradient("Trilu", uses=("x1",), stop=(1,), linear=True)
def trilu_grad(g: GradCtx) -> None:
    # the same triangular mask applied to dY
    g.set_dx(0, g.emit("Trilu", g.dy(0), *_inputs(g, (1,)), upper=g.attr("upper")))



@gradient("CenterCropPad", stop=(1,), linear=True)
def center_crop_pad_grad(g: GradCtx) -> None:
    # a crop keeps X[b : b + t] with b = (d − t)//2 and a pad puts X at Y[b : b + d] with b = (t − d)//2:
    # either way dX is dY center-cropped/padded back to X's sizes, whose offsets are the same b
    axes = g.attr("axes")
    xs = g.static_shape(0)
    rank = len(xs) if xs is not None else g.rank(0)
    idx = list(range(rank)) if axes is None and rank is not None else None if axes is None else list(axes)
    if idx is None:
        raise RuleError("CenterCropPad gradient without axes needs the rank of its input")
    if xs is not None and all(xs[a] is not None for a in idx):
        target = g.ints([xs[a] for a in idx])  # type: ignore[misc]
    else:
        target = g.emit("Gather", g.shape(0), g.ints(idx), axis=0)
    g.set_dx(0, g.emit("CenterCropPad", g.dy(0), target, **({} if axes is None else {"axes": idx})))
