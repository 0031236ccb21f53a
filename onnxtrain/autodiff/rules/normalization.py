"""Gradient rules of softmax and the normalizations (same names as engine/kernels/normalization.py).

The standardizing normalizations (Layer, Batch, Instance, Group) share one backward: with
xhat = (X − mean)·r over the normalized axes, r = 1/sqrt(var + eps) and gS = dY·scale,
``dX = r·(gS − mean(gS) − xhat·mean(gS·xhat))``, dScale = Σ dY·xhat and dBias = Σ dY over the
other axes. float16/bfloat16 graphs compute it in float32 (as the kernels and stash_type do).
"""

from __future__ import annotations

import math

from onnx import TensorProto

from onnxtrain.autodiff.context import GradCtx, RuleError
from onnxtrain.autodiff.registry import gradient
from onnxtrain.ir.attrs import mvn_axes
from onnxtrain.ir.graphs import is_training_batch_norm

_LOW = (TensorProto.FLOAT16, TensorProto.BFLOAT16)


def _axis(g: GradCtx, axis: int, what: str = "input") -> tuple[int, int]:
    """(normalized axis, rank of input 0); the rank must be known."""
    r = g.rank(0)
    if r is None:
        raise RuleError(f"{g.node.op_type} gradient needs the rank of the {what} "
                        "(shape inference found none)")
    if not -r <= axis < r:
        raise RuleError(f"{g.node.op_type} axis {axis} is out of range for rank {r}")
    return axis % r, r


def _nan_cleared(g: GradCtx, y: str) -> str | None:
    """The output of ``Where(IsNaN(y), 0, y)`` when that is all ``y`` is read by (and y is no graph
    output), else None: torch's TorchScript exporter writes scaled_dot_product_attention with a mask so,
    the zeros standing for the softmax of a fully masked row (nan: every score −inf)."""
    if g.is_graph_output(y):
        return None
    readers = g.readers(y)
    flags = {n.output[0] for n in readers if n.op_type == "IsNaN"}
    cleared = None
    for n in readers:
        if n.op_type == "IsNaN":
            continue
        if n.op_type != "Where" or n.input[0] not in flags or n.input[2] != y or n.input[1] == y:
            return None
        zero = g.constant_value(n.input[1])
        if zero is None or zero.size != 1 or zero.reshape(-1)[0] != 0:
            return None
        cleared = n.output[0]
    return cleared  # dY is 0 wherever Y is nan: only those Wheres pass a gradient to Y


def _zero(g: GradCtx, name: str) -> bool:
    """Whether ``name`` is a constant 0 (one value), also through a Cast or CastLike of one."""
    node = g.producer(name)
    if node is not None and node.op_type in ("Cast", "CastLike"):
        name = node.input[0]
    value = g.constant_value(name)
    return value is not None and value.size == 1 and value.reshape(-1)[0] == 0


def _zero_filled(g: GradCtx, y: str) -> bool:
    """Whether every use of ``y``'s values (directly or through Casts; a Shape or the type of a CastLike
    aside) is the value branch of a ``Where(c, 0, ·)`` (y no graph output): ONNX's ``Attention`` body
    writes its softmax so, zeroing the rows whose every key is masked (a nan row: every score −inf),
    where dY is then 0."""
    if g.is_graph_output(y):
        return False
    readers = g.readers(y)
    for n in readers:
        if n.op_type == "Shape" or (n.op_type == "CastLike" and n.input[0] != y):
            continue  # its shape or type only
        if n.op_type == "Cast":
            if g.is_graph_output(n.output[0]) or not _zero_filled(g, n.output[0]):
                return False
        elif n.op_type != "Where" or n.input[2] != y or n.input[1] == y or not _zero(g, n.input[1]):
            return False
    return any(n.op_type in ("Cast", "Where") for n in readers)


@gradient("Softmax", uses=("y0",))
def softmax_grad(g: GradCtx) -> None:
    # dX = Y·(dY − Σ dY·Y)  over the softmax axis (opset 13 semantics: one axis). Y read through
    # Where(IsNaN(Y), 0, Y) reads that instead: the same values, and 0 in place of a fully masked row's
    # nan, where dY is 0 too, so dX is 0 there as torch's attention gives (nan·0 was nan); no extra pass.
    # Y read only through Where(c, 0, ·) (ONNX's Attention body) is cleared of nan here (two passes): the
    # nan rows are the fully masked ones, which that Where zeroes (a nan it let through makes the loss nan).
    y = _nan_cleared(g, g.y(0))
    if y is None:
        y = g.y(0)
        if _zero_filled(g, y):
            y = g.emit("Where", g.emit("IsNaN", y), g.const(0.0, g.elem_type(y)), y)
    s = g.reduce("ReduceSum", g.emit("Mul", g.dy(0), y), [g.attr("axis")], keepdims=1)
    g.set_dx(0, g.emit("Mul", y, g.emit("Sub", g.dy(0), s)))


@gradient("LogSoftmax", uses=("y0",))
def log_softmax_grad(g: GradCtx) -> None:
    # dX = dY − Exp(Y)·Σ dY  over the axis
    s = g.reduce("ReduceSum", g.dy(0), [g.attr("axis")], keepdims=1)
    g.set_dx(0, g.emit("Sub", g.dy(0), g.emit("Mul", g.emit("Exp", g.y(0)), s)))


# ---------------------------------------------------------------- shared pieces


def _work_type(g: GradCtx) -> int:
    """The float type the backward computes in."""
    return TensorProto.FLOAT if g.dtype in _LOW else g.dtype


def _cast(g: GradCtx, name: str, to: int, frm: int | None = None) -> str:
    """``name`` as type ``to`` (no node when it already is)."""
    frm = g.elem_type(name) if frm is None else frm
    return name if frm == to else g.emit("Cast", name, to=to)


def _reduce_mean(g: GradCtx, t: str, axes: list[int]) -> str:
    return g.reduce("ReduceMean", t, axes, keepdims=1)


def _standardize(g: GradCtx, x: str, axes: list[int], eps: float, wt: int) -> tuple[str, str]:
    """(xhat, r) recomputed from ``x`` over ``axes``: xhat = (x − mean)·r, r = 1/sqrt(var + eps)."""
    d = g.emit("Sub", x, _reduce_mean(g, x, axes))
    var = _reduce_mean(g, g.emit("Mul", d, d), axes)
    r = g.emit("Reciprocal", g.emit("Sqrt", g.emit("Add", var, g.const(eps, wt))))
    return g.emit("Mul", d, r), r


def _dx(g: GradCtx, gs: str, xhat: str, r: str, axes: list[int]) -> str:
    """dX = r·(gS − mean(gS) − xhat·mean(gS·xhat)), means over the normalized ``axes``."""
    m1 = _reduce_mean(g, gs, axes)
    m2 = _reduce_mean(g, g.emit("Mul", gs, xhat), axes)
    inner = g.emit("Sub", g.emit("Sub", gs, m1), g.emit("Mul", xhat, m2))
    return g.emit("Mul", r, inner)


def _per_channel(g: GradCtx, v: str, rank: int) -> str:
    """A (C,) vector shaped (C, 1, ..., 1) to broadcast against (N, C, d1, ...)."""
    return v if rank <= 2 else g.emit("Unsqueeze", v, g.ints(range(1, rank - 1)))


def _sum_to(g: GradCtx, t: str, axes: list[int], i: int, wt: int) -> str:
    """ReduceSum of ``t`` over ``axes`` (keepdims=0), cast back to the type of input ``i``."""
    return _cast(g, g.reduce("ReduceSum", t, axes, keepdims=0), g.elem_type(g.node.input[i]) or g.dtype, wt)


# ---------------------------------------------------------------- LayerNormalization


FROM_OUTPUT = "from_output"  # the variant of use_memory_efficient_gradient


@gradient("LayerNormalization", uses=("x0", "x1", "y1", "y2"))
def layer_norm_grad(g: GradCtx) -> None:
    # over axes axis..rank−1:  xhat = (X − Mean)·InvStdDev,  gS = dY·Scale,
    # dX = InvStdDev·(gS − mean(gS) − xhat·mean(gS·xhat));  dScale = Σ dY·xhat, dB = Σ dY over the rest.
    # Gradients flowing into the Mean / InvStdDev outputs add dMean/n and −dInvStdDev·InvStdDev²·xhat/n.
    axis, r = _axis(g, g.attr("axis"))
    xt, wt = g.dtype, _work_type(g)
    stash = g.attr("stash_type") or TensorProto.FLOAT
    x = _cast(g, g.x(0), wt, xt)
    if xt == TensorProto.DOUBLE and stash != TensorProto.DOUBLE:
        # the Mean/InvStdDev outputs are in stash_type (float32): recompute in float64 to keep its precision
        xhat, inv = _standardize(g, x, list(range(axis, r)), g.attr("epsilon"), wt)
    else:
        inv = _cast(g, g.y(2), wt, stash)
        xhat = g.emit("Mul", g.emit("Sub", x, _cast(g, g.y(1), wt, stash)), inv)
    _layer_norm_backward(g, xhat, inv, axis, r)


@gradient("LayerNormalization", uses=("y0", "x1", "x2", "y2"), variant=FROM_OUTPUT)
def layer_norm_grad_from_output(g: GradCtx) -> None:
    # use_memory_efficient_gradient: xhat = (Y − B)/Scale, read off the output, so that the input need not
    # be kept for the backward pass (onnxruntime's InvertibleLayerNormalizationGrad). The same gradient up
    # to rounding; a Scale with zeros gives non-finite values. The builder picks this rule only where no
    # other rule keeps the input
    axis, r = _axis(g, g.attr("axis"))
    xt, wt = g.dtype, _work_type(g)
    stash = g.attr("stash_type") or TensorProto.FLOAT
    y = _cast(g, g.y(0), wt, xt)
    if g.has_x(2):
        y = g.emit("Sub", y, _cast(g, g.x(2), wt, xt))
    xhat = g.emit("Div", y, _cast(g, g.x(1), wt, xt))
    _layer_norm_backward(g, xhat, _cast(g, g.y(2), wt, stash), axis, r)


def _layer_norm_backward(g: GradCtx, xhat: str, inv: str, axis: int, r: int) -> None:
    """The gradients of a LayerNormalization given its standardized input ``xhat`` and ``inv`` (its
    InvStdDev), both in the work type."""
    axes = list(range(axis, r))
    xt, wt = g.dtype, _work_type(g)
    stash = g.attr("stash_type") or TensorProto.FLOAT
    dy = g.dy(0)
    dyw = None if dy is None else _cast(g, dy, wt, xt)
    if g.needs_dx(0):
        parts = []
        if dyw is not None:
            gs = g.emit("Mul", dyw, _cast(g, g.x(1), wt, xt))
            parts.append(_dx(g, gs, xhat, inv, axes))
        dmean, dinv = g.dy(1), g.dy(2)
        if dmean is not None or dinv is not None:
            # d mean/dX = 1/n,  d InvStdDev/dX = −InvStdDev²·xhat/n
            extra = None
            if dinv is not None:
                extra = g.emit("Mul", g.emit("Neg", _cast(g, dinv, wt, stash)), g.emit("Mul", inv, inv))
                extra = g.emit("Mul", extra, xhat)
            if dmean is not None:
                dm = _cast(g, dmean, wt, stash)
                extra = dm if extra is None else g.emit("Add", extra, dm)
            extra = g.emit("Mul", extra, _inv_count(g, axis, wt))
            if dinv is None:
                extra = g.emit("Expand", extra, g.shape(0))
            parts.append(extra)
        dx = parts[0] if len(parts) == 1 else g.emit("Add", *parts)
        g.set_dx(0, _cast(g, dx, xt, wt))
    if dyw is None:
        return
    if g.needs_dx(1):
        g.set_dx(1, _cast(g, g.unbroadcast(g.emit("Mul", dyw, xhat), 1, grad_rank=r), xt, wt))
    if g.has_x(2) and g.needs_dx(2):
        g.set_dx(2, g.unbroadcast(dy, 2, grad_rank=r))


def _inv_count(g: GradCtx, axis: int, wt: int) -> str:
    """1/n, n = the number of elements normalized together (X.shape[axis:])."""
    xs = g.static_shape(0)
    if xs is not None and all(d is not None for d in xs[axis:]):
        n = 1
        for d in xs[axis:]:
            n *= d  # type: ignore[operator]
        return g.const(1.0 / max(n, 1), wt)
    tail = g.emit("Slice", g.shape(0), g.ints([axis]), g.ints([2**62]))
    n = g.emit("Cast", g.emit("ReduceProd", tail, keepdims=0), to=wt)
    return g.emit("Reciprocal", n)


# ---------------------------------------------------------------- Batch / Instance / Group


@gradient("BatchNormalization", uses=("x0", "x1", "x3", "x4"), stop=(3, 4), stop_if=is_training_batch_norm)
def batch_norm_grad(g: GradCtx) -> None:
    # training_mode=1: Y uses the batch statistics, recomputed here over (N, d1, ...); the running
    # statistics (inputs 3, 4 and outputs 1, 2) are state updates and carry no gradient.
    # training_mode=0: Y = (X − mean)·scale·rstd + B with the given mean and var, rstd = 1/sqrt(var + eps):
    # dX = dY·scale·rstd, dmean = −scale·rstd·Σ dY, dvar = −½·scale·rstd²·Σ dY·xhat (xhat = (X − mean)·rstd);
    # mean and var get them when they are computed from values that need gradients (torch's dynamo exporter
    # writes BatchNorm without running statistics this way) or are differentiated themselves.
    if g.dy(0) is None:
        return
    _, r = _axis(g, 0)
    axes = [0, *range(2, r)]
    xt, wt = g.dtype, _work_type(g)
    dy = _cast(g, g.dy(0), wt, xt)
    eps = g.attr("epsilon")
    if g.attr("training_mode"):
        _batch_norm_train_grad(g, dy, axes, r, eps, xt, wt)
        return
    var = _cast(g, g.x(4), wt, g.elem_type(g.x(4)))
    rstd_c = g.emit("Reciprocal", g.emit("Sqrt", g.emit("Add", var, g.const(eps, wt))))  # (C,)
    rstd = _per_channel(g, rstd_c, r)
    a = None
    if g.needs_dx(0) or g.needs_dx(3) or g.needs_dx(4):
        a = g.emit("Mul", _cast(g, g.x(1), wt, g.elem_type(g.x(1))), rstd_c)  # scale·rstd, (C,)
    if g.needs_dx(0):
        g.set_dx(0, _cast(g, g.emit("Mul", dy, _per_channel(g, a, r)), xt, wt))
    xhat = None
    if g.needs_dx(1) or g.needs_dx(4):
        mean = _per_channel(g, _cast(g, g.x(3), wt, g.elem_type(g.x(3))), r)
        xhat = g.emit("Mul", g.emit("Sub", _cast(g, g.x(0), wt, xt), mean), rstd)
    if g.needs_dx(3):
        dmean = g.emit("Neg", g.emit("Mul", a, g.reduce("ReduceSum", dy, axes, keepdims=0)))
        g.set_dx(3, _cast(g, dmean, g.elem_type(g.x(3)) or g.dtype, wt))
    if g.needs_dx(4):
        sums = g.reduce("ReduceSum", g.emit("Mul", dy, xhat), axes, keepdims=0)
        dvar = g.emit("Mul", g.emit("Mul", a, rstd_c), g.emit("Mul", sums, g.const(-0.5, wt)))
        g.set_dx(4, _cast(g, dvar, g.elem_type(g.x(4)) or g.dtype, wt))
    if g.needs_dx(1):
        g.set_dx(1, _sum_to(g, g.emit("Mul", dy, xhat), axes, 1, wt))
    if g.needs_dx(2):
        g.set_dx(2, _sum_to(g, dy, axes, 2, wt))


def _batch_norm_train_grad(g: GradCtx, dy: str, axes: list[int], rank: int, eps: float, xt: int,
                           wt: int) -> None:
    """Gradients of a training-mode BatchNormalization from its batch statistics, recomputed: with
    d = X − mean, r = 1/sqrt(var + eps) and n values per channel, dScale = r·Σ dY·d, dB = Σ dY and
    dX = scale·r·(dY − Σ dY / n − d·r²·Σ dY·d / n), the normalized input never formed: two reductions
    shared by the three gradients, and four passes over dY and d for dX (was six reductions, ten passes)."""
    x = _cast(g, g.x(0), wt, xt)
    d = g.emit("Sub", x, _reduce_mean(g, x, axes))
    r = g.emit("Reciprocal", g.emit("Sqrt", g.emit("Add", _reduce_mean(g, g.emit("Mul", d, d), axes),
                                                    g.const(eps, wt))))
    need_x, need_scale, need_bias = g.needs_dx(0), g.needs_dx(1), g.needs_dx(2)
    sum_dy = g.reduce("ReduceSum", dy, axes, keepdims=1) if need_x or need_bias else ""
    sum_dyd = g.reduce("ReduceSum", g.emit("Mul", dy, d), axes, keepdims=1) if need_x or need_scale else ""
    if need_x:
        n = _count(g, axes, wt)
        k = g.emit("Mul", _per_channel(g, _cast(g, g.x(1), wt, xt), rank), r)
        c2 = g.emit("Div", g.emit("Mul", g.emit("Mul", r, r), sum_dyd), n)
        inner = g.emit("Sub", g.emit("Sub", dy, g.emit("Div", sum_dy, n)), g.emit("Mul", d, c2))
        g.set_dx(0, _cast(g, g.emit("Mul", inner, k), xt, wt))
    flat = g.ints([-1])
    if need_scale:
        # over an empty batch r is NaN (a mean over nothing) and Σ dY·d is 0: the scale's gradient is 0, as
        # torch's and onnxruntime's (NaN would spread to every weight at the next step)
        r0 = g.emit("Where", g.emit("IsNaN", r), g.const(0.0, wt), r)
        dscale = g.emit("Reshape", g.emit("Mul", sum_dyd, r0), flat)
        g.set_dx(1, _cast(g, dscale, g.elem_type(g.node.input[1]) or g.dtype, wt))
    if need_bias:
        g.set_dx(2, _cast(g, g.emit("Reshape", sum_dy, flat), g.elem_type(g.node.input[2]) or g.dtype, wt))


def _count(g: GradCtx, axes: list[int], wt: int) -> str:
    """How many values of input 0 ``axes`` hold per channel, as a float of type ``wt``."""
    shape = g.static_shape(0)
    if shape is not None and all(shape[a] is not None for a in axes):
        return g.const(float(math.prod(shape[a] for a in axes)), wt)  # type: ignore[misc]
    sizes = g.emit("Gather", g.emit("Shape", g.x(0)), g.ints(axes))
    return g.emit("Cast", g.reduce("ReduceProd", sizes, None, keepdims=1), to=wt)


@gradient("InstanceNormalization", uses=("x0", "x1"))
def instance_norm_grad(g: GradCtx) -> None:
    # statistics per (n, c) over the spatial axes; scale/bias per channel
    _, r = _axis(g, 0)
    spatial = list(range(2, r))
    xt, wt = g.dtype, _work_type(g)
    dy = _cast(g, g.dy(0), wt, xt)
    if not spatial:  # (N, C): statistics over no axis, Y = B (as the kernel computes it): only B has one
        for i in (0, 1):
            if g.needs_dx(i):
                g.set_dx(i, g.zeros_like(g.x(i)))
        if g.needs_dx(2):
            g.set_dx(2, _sum_to(g, dy, [0], 2, wt))
        return
    xhat, rstd = _standardize(g, _cast(g, g.x(0), wt, xt), spatial, g.attr("epsilon"), wt)
    if g.needs_dx(0):
        gs = g.emit("Mul", dy, _per_channel(g, _cast(g, g.x(1), wt, xt), r))
        g.set_dx(0, _cast(g, _dx(g, gs, xhat, rstd, spatial), xt, wt))
    if g.needs_dx(1):
        g.set_dx(1, _sum_to(g, g.emit("Mul", dy, xhat), [0, *spatial], 1, wt))
    if g.needs_dx(2):
        g.set_dx(2, _sum_to(g, dy, [0, *spatial], 2, wt))


@gradient("GroupNormalization", uses=("x0", "x1"))
def group_norm_grad(g: GradCtx) -> None:
    # X viewed as (N, G, C/G, S): statistics over (C/G, S). Scale/bias are per group at opset 18-20
    # and per channel from 21 (stash_type: the kernels' rule, float32 for float16/bfloat16 inputs).
    # Per group (opset 18-20), X is viewed as (N, G, C/G·S) and needs no channel count; per channel, as
    # (N, G, C/G, S), the count read from X's static shape or, when symbolic there, from the scale's.
    groups = g.attr("num_groups")
    per_channel = g.opset >= 21
    c = None
    if per_channel:
        for shape, k in ((g.static_shape(0), 1), (g.static_shape(1), 0)):
            if c is None and shape is not None and len(shape) > k:
                c = shape[k]
        if c is None:
            raise RuleError("GroupNormalization gradient needs the static channel count of the input or its "
                            "scale")
    xt, wt = g.dtype, _work_type(g)
    view = g.ints([0, groups, c // groups, -1] if per_channel else [0, groups, -1])
    stats = [2, 3] if per_channel else [2]
    x = g.emit("Reshape", _cast(g, g.x(0), wt, xt), view)
    dy = g.emit("Reshape", _cast(g, g.dy(0), wt, xt), view)
    xhat, rstd = _standardize(g, x, stats, g.attr("epsilon"), wt)
    if g.needs_dx(0):
        scale = _cast(g, g.x(1), wt, xt)
        sc = g.emit("Reshape", scale, g.ints([groups, c // groups, 1] if per_channel else [groups, 1]))
        dxg = _dx(g, g.emit("Mul", dy, sc), xhat, rstd, stats)
        g.set_dx(0, _cast(g, g.emit("Reshape", dxg, g.shape(0)), xt, wt))
    red = [0, 3] if per_channel else [0, 2]
    for i, t in ((1, None), (2, dy)):
        if g.needs_dx(i):
            s = _sum_to(g, g.emit("Mul", dy, xhat) if t is None else t, red, i, wt)
            g.set_dx(i, g.emit("Reshape", s, g.ints([-1])) if per_channel else s)


# ---------------------------------------------------------------- LpNormalization


@gradient("LpNormalization", uses=("x0", "y0"))
def lp_norm_grad(g: GradCtx) -> None:
    # Y = X/n along the axis, n = ||X||_p:  dX = (dY − s·Σ dY·Y)/n with s = ∂n/∂X = Y (p=2) or
    # torch's sgn(X) (p=1: ±1, 0 at ±0 and NaN, as Abs and ReduceL1); a slice of norm 0 (Y = 0) gets
    # dY/1, so an all-zero weight can leave 0. Half types compute in float32, as the kernel does (a float16
    # norm past 65504 was inf, and dX 0)
    p = g.attr("p")
    if p not in (1, 2):
        raise RuleError(f"LpNormalization gradient supports p=1 or p=2, got p={p}")
    axis = g.attr("axis")
    xt, wt = g.dtype, _work_type(g)
    x, y, dy = (_cast(g, t, wt, xt) for t in (g.x(0), g.y(0), g.dy(0)))
    n = g.reduce("ReduceL2" if p == 2 else "ReduceL1", x, [axis], keepdims=1)
    n = g.emit("Where", g.emit("Equal", n, g.const(0, wt)), g.const(1, wt), n)
    dot = g.reduce("ReduceSum", g.emit("Mul", dy, y), [axis], keepdims=1)
    s = y if p == 2 else _cast(g, g.sgn(g.x(0)), wt, xt)
    g.set_dx(0, _cast(g, g.emit("Div", g.emit("Sub", dy, g.emit("Mul", s, dot)), n), xt, wt))


@gradient("MeanVarianceNormalization", uses=("x0",))
def mean_variance_norm_grad(g: GradCtx) -> None:
    # Y = xc / (s + ε), xc = X − mean(X), s = sqrt(mean(xc²)), ε = 1e-9 (the schema's function body):
    # dX = (dY − mean(dY)) / (s + ε) − xc · mean(dY·xc) / (s · (s + ε)²)   over the normalised axes.
    # Half types compute in float32 (s·(s + ε)² overflowed float16 from s ≈ 40)
    axes = mvn_axes(g.attr("axes"), g.rank(0))
    xt, wt = g.dtype, _work_type(g)
    x, dy = _cast(g, g.x(0), wt, xt), _cast(g, g.dy(0), wt, xt)
    xc = g.emit("Sub", x, _reduce_mean(g, x, axes))
    s = g.emit("Sqrt", _reduce_mean(g, g.emit("Mul", xc, xc), axes))
    d = g.emit("Add", s, g.const(1e-9, wt))
    first = g.emit("Div", g.emit("Sub", dy, _reduce_mean(g, dy, axes)), d)
    # over a constant slice (s = 0, and xc = 0 with it) the second term is 0, not 0/0: s taken as 1 there
    s_safe = g.emit("Where", g.emit("Greater", s, g.const(0.0, wt)), s, g.const(1.0, wt))
    second = g.emit("Div", g.emit("Mul", xc, _reduce_mean(g, g.emit("Mul", dy, xc), axes)),
                    g.emit("Mul", s_safe, g.emit("Mul", d, d)))
    g.set_dx(0, _cast(g, g.emit("Sub", first, second), xt, wt))


# ---------------------------------------------------------------- LRN


def _channel_window_sum(g: GradCtx, t: str, before: int, after: int) -> str:
    """out[:, c] = Σ t[:, c − before … c + after] along axis 1 (zero outside the channels), ``t`` of the
    input's rank: Pad, then one Slice per window offset (LRN windows are a few channels wide)."""
    width = before + after
    if width == 0:
        return t
    r = g.rank(0)
    if r is None:
        raise RuleError("LRN gradient needs the rank of its input")
    pads = [0] * (2 * r)
    pads[1], pads[r + 1] = before, after
    padded = g.emit("Pad", t, g.ints(pads))
    # offset k keeps padded[:, k : k + C], i.e. up to k − width from the end
    parts = [g.emit("Slice", padded, g.ints([k]), g.ints([k - width if k < width else 2**62]), g.ints([1]))
             for k in range(width + 1)]
    return g.emit("Sum", *parts)


@gradient("LRN", uses=("x0",))
def lrn_grad(g: GradCtx) -> None:
    # Y = X·D^−β, D = bias + (α/n)·S, S[c] = Σ X[i]² over the window i ∈ [c − (n−1)//2, c + n//2]:
    # dX = dY·D^−β − (2αβ/n)·X·S′(dY·X·D^−β/D), where S′ sums over the mirrored window
    # i ∈ [c − n//2, c + (n−1)//2] (the channels whose window holds c). Half types compute in float32,
    # as the kernel does (S overflowed float16 from |X| ≈ 256)
    size, alpha, beta = g.attr("size"), g.attr("alpha"), g.attr("beta")
    xt, wt = g.dtype, _work_type(g)
    x, dy = _cast(g, g.x(0), wt, xt), _cast(g, g.dy(0), wt, xt)
    s = _channel_window_sum(g, g.emit("Mul", x, x), (size - 1) // 2, size // 2)
    d = g.emit("Add", g.emit("Mul", s, g.const(alpha / size, wt)), g.const(g.attr("bias"), wt))
    p = g.emit("Pow", d, g.const(-beta, wt))  # D^−β
    u = g.emit("Div", g.emit("Mul", g.emit("Mul", dy, x), p), d)
    back = _channel_window_sum(g, u, size // 2, (size - 1) // 2)
    cross = g.emit("Mul", g.emit("Mul", x, back), g.const(2 * alpha * beta / size, wt))
    g.set_dx(0, _cast(g, g.emit("Sub", g.emit("Mul", dy, p), cross), xt, wt))
