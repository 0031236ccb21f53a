"""Gradient rules of the indexing ops (same names and order as engine/kernels/indexing.py).

Gathers scatter ``dY`` back with ``reduction="add"`` (repeated indices sum their gradients;
ScatterElements/ScatterND accept negative indices, so they need no normalising); scatters gather
``dY`` for their updates.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from onnxtrain.autodiff.context import GradCtx, RuleError
from onnxtrain.autodiff.registry import gradient, no_gradient
from onnxtrain.autodiff.rules.shape import I64, as_int64, route_back, trim, zeros
from onnxtrain.ir.builder import NodeWriter


@gradient("Gather", uses=("x1",), stop=(1,), linear=True)
def gather_grad(g: GradCtx) -> None:
    # dData = ScatterND(zeros, idx[..., None], dY, add) with the gathered axis moved to the front
    if _scalar_index_grad(g):
        return
    dy, idx = g.dy(0), as_int64(g, g.x(1))
    axis = g.attr("axis")
    r, q = g.rank(0), g.rank(1)
    if axis == 0 or r is not None and axis == -r:
        nd = g.emit("Unsqueeze", idx, g.ints([-1]))
        g.set_dx(0, g.emit("ScatterND", zeros(g, g.shape(0)), nd, dy, reduction="add"))
        return
    if r is None or q is None:
        g.set_dx(0, route_back(g, dy, lambda iota: g.emit("Gather", iota, g.x(1), axis=axis), repeats=True))
        return
    a = axis % r
    # dY is data[:a] + idx.shape + data[a+1:]; bring idx.shape to the front to match the scatter
    dperm = [a, *range(a), *range(a + 1, r)]
    yperm = [*range(a, a + q), *range(a), *range(a + q, r + q - 1)]
    zt = zeros(g, g.emit("Gather", g.shape(0), g.ints(dperm)))
    nd = g.emit("Unsqueeze", idx, g.ints([-1]))
    dyt = dy if yperm == sorted(yperm) else g.emit("Transpose", dy, perm=yperm)
    s = g.emit("ScatterND", zt, nd, dyt, reduction="add")
    g.set_dx(0, g.emit("Transpose", s, perm=[int(p) for p in np.argsort(dperm)]))


def _scalar_index_grad(g: GradCtx) -> bool:
    """A constant scalar index (q, k and v taken from one projection): dY padded with zeros back to the
    data's shape, one Pad instead of zeros + ScatterND. The axis size and the rank may be dynamic (a
    negative axis needs the rank)."""
    i, r, axis = g.constant_value(1), g.rank(0), g.attr("axis")
    if i is None or np.ndim(i) != 0 or r is None and axis < 0:
        return False
    i = int(i)
    a = axis % r if r is not None else axis
    shape = g.static_shape(0)
    n = shape[a] if shape is not None and isinstance(shape[a], int) else None
    # pads: begin[a] = i (n + i for a negative index), end[a] = n - 1 - i (-1 - i); 0 on the other axes
    if n is not None:
        if not -n <= i < n:
            return False
        i %= n
        begin, end = g.ints([i]), g.ints([n - 1 - i])
    else:
        size = g.emit("Gather", g.shape(0), g.ints([a]))
        if i >= 0:
            begin, end = g.ints([i]), g.emit("Sub", size, g.ints([i + 1]))
        else:
            begin, end = g.emit("Add", size, g.ints([i])), g.ints([-1 - i])
    if r is not None:
        tail = g.ints([0] * (r - 1 - a))
    else:
        rank = g.emit("Shape", g.shape(0))
        zero = onnx.numpy_helper.from_array(np.zeros(1, np.int64))
        tail = g.emit("ConstantOfShape", g.emit("Sub", rank, g.ints([a + 1])), value=zero)
    lead = [g.ints([0] * a)] if a else []
    pads = g.emit("Concat", *lead, begin, tail, *lead, end, tail, axis=0)
    g.set_dx(0, g.emit("Pad", g.emit("Unsqueeze", g.dy(0), g.ints([a])), pads))
    return True


@gradient("GatherElements", uses=("x1",), stop=(1,), linear=True)
def gather_elements_grad(g: GradCtx) -> None:
    # dData = ScatterElements(zeros, idx, dY, axis, add)
    g.set_dx(0, g.emit("ScatterElements", zeros(g, g.shape(0)), g.x(1), g.dy(0), axis=g.attr("axis"),
                       reduction="add"))


def _gather_elements(g: GradCtx, t: str, idx: str, axis: int) -> str:
    """GatherElements of a data-shaped ``t``; cut to the indices' extent on the other axes first when
    they are smaller (valid ONNX, but onnx.reference's GatherElements requires equal sizes)."""
    ds, js = g.static_shape(0), g.static_shape(1)
    if ds is None or js is None or None in ds or None in js or len(ds) != len(js):
        return g.emit("GatherElements", t, idx, axis=axis)
    a = axis % len(ds)
    if any(d != j for k, (d, j) in enumerate(zip(ds, js)) if k != a):
        ends = [2**63 - 1 if k == a else j for k, j in enumerate(js)]
        t = g.emit("Slice", t, g.ints([0] * len(js)), g.ints(ends))  # type: ignore[list-item]
    return g.emit("GatherElements", t, idx, axis=axis)


def _distinct_indices(g: GradCtx, gather: str) -> bool:
    """Whether the scatter's indices are constants that name each slot once (no update overwrites another)."""
    idx = g.constant_value(1)
    if idx is None:
        return False
    idx = np.asarray(idx)
    dims = g.static_shape(0)
    if gather == "GatherND":
        rows = idx.reshape(-1, idx.shape[-1]) if idx.ndim else idx.reshape(1, -1)
        sizes = None if dims is None else dims[:rows.shape[1]]
    else:
        axis = g.attr("axis") or 0
        rank = idx.ndim
        if rank == 0:
            return True
        # along the axis, the other coordinates are the position's own: distinct if no row repeats a slot
        rows = np.moveaxis(idx, axis % rank, -1).reshape(-1, idx.shape[axis % rank])
        sizes = None if dims is None or len(dims) != rank else [dims[axis % rank]] * rows.shape[1]
    if (rows < 0).any():  # -1 and size − 1 name one slot: counted from the end, where the size is known
        if sizes is None or len(sizes) != rows.shape[1] or any(d is None for d in sizes):
            return False
        rows = np.where(rows < 0, rows + np.array(sizes, np.int64), rows)
    if gather == "GatherND":
        return len({tuple(r) for r in rows.tolist()}) == len(rows)
    return all(len(set(r)) == len(r) for r in rows.tolist())


def _kept_updates_only(g: GradCtx, scatter: str, gather_of: Any, du: str, kw: dict) -> str:
    """``du`` (each update's slot gradient) zeroed for the updates a later one overwrites: the slot keeps
    the last update written to it (the engine and onnxruntime write in order), so only that one reaches the
    output. Found at run time by scattering each update's ordinal and reading back which one stayed."""
    u = g.x(2)
    count = g.emit("Size", u)
    ordinal = g.emit("Reshape", g.emit("Range", g.int64(0), count, g.int64(1)), g.emit("Shape", u),
                     allowzero=1)  # an empty update keeps its zero dims
    blank = g.emit("ConstantOfShape", g.shape(0),
                   value=numpy_helper.from_array(np.zeros(1, np.int64)))
    kept = g.emit("Equal", gather_of(g.emit(scatter, blank, g.x(1), ordinal, **kw)), ordinal)
    return g.emit("Where", kept, du, g.const(0))


def _scatter_grad(g: GradCtx, scatter: str, gather: str, **kw: int) -> None:
    """ScatterElements / ScatterND: ``gather`` is the matching gather op, ``kw`` its axis."""
    dy, idx = g.dy(0), g.x(1)
    if gather == "GatherElements":
        def gather_of(t: str) -> str:
            return _gather_elements(g, t, idx, kw["axis"])
    else:
        def gather_of(t: str) -> str:
            return g.emit("GatherND", t, idx)
    red = g.attr("reduction") or "none"
    if red == "none":
        # overwritten slots of data get no gradient; each update gets the gradient of its slot
        if g.needs_dx(0):
            g.set_dx(0, g.emit(scatter, dy, idx, zeros(g, g.shape(2)), **kw))
        if g.needs_dx(2):
            du = gather_of(dy)
            distinct = _distinct_indices(g, gather)
            g.set_dx(2, du if distinct else _kept_updates_only(g, scatter, gather_of, du, kw))
    elif red == "add":
        g.set_dx(0, dy)
        if g.needs_dx(2):
            g.set_dx(2, gather_of(dy))
    elif red == "mul":
        u = g.x(2)
        if g.needs_dx(0):
            # Y = data·Π u at the slot: dData = dY·Π u
            g.set_dx(0, g.emit("Mul", dy, g.emit(scatter, zeros(g, g.shape(0), 1.0), idx, u, reduction="mul",
                                                 **kw)))
        if g.needs_dx(2):
            # du_j = dY·data·Π_{k≠j} u_k at j's slot, exact with zeros among the u: with
            # P = data·Π_{u_k≠0} u_k and Z = #{k: u_k = 0} at the slot, du_j = dY·P/u_j if Z = 0 and
            # u_j ≠ 0, dY·P if Z = 1 and u_j = 0, else 0; i.e. dY·P/u'_j where Z equals [u_j = 0]
            zero, one = g.const(0), g.const(1)
            is0 = g.emit("Equal", u, zero)
            u1 = g.emit("Where", is0, one, u)
            is0f = g.emit("Cast", is0, to=g.dtype)
            p = g.emit(scatter, g.x(0), idx, u1, reduction="mul", **kw)
            z = g.emit(scatter, zeros(g, g.shape(0)), idx, is0f, reduction="add", **kw)
            dyp = gather_of(g.emit("Mul", dy, p))
            ok = g.emit("Equal", gather_of(z), is0f)
            g.set_dx(2, g.emit("Div", g.emit("Where", ok, dyp, zero), u1))
    elif red in ("max", "min"):
        # torch's scatter_reduce(amax/amin, include_self=True) convention: the slot's gradient is shared
        # equally by every contributor (data and updates) that equals the result
        y, u = g.y(0), g.x(2)
        data_won = g.emit("Cast", g.emit("Equal", g.x(0), y), to=g.dtype)
        upd_won = g.emit("Cast", g.emit("Equal", u, gather_of(y)), to=g.dtype)
        share = g.emit("Div", dy, g.emit(scatter, data_won, idx, upd_won, reduction="add", **kw))
        if g.needs_dx(0):
            g.set_dx(0, g.emit("Mul", data_won, share))
        if g.needs_dx(2):
            g.set_dx(2, g.emit("Mul", upd_won, gather_of(share)))
    else:
        raise RuleError(f"{g.node.op_type} with reduction={red!r} has no gradient rule")


@gradient("ScatterElements", uses=("x0", "x1", "x2", "y0"), stop=(1,))
def scatter_elements_grad(g: GradCtx) -> None:
    # x0 and x2 are read only for reductions mul, max and min, y0 for max and min
    _scatter_grad(g, "ScatterElements", "GatherElements", axis=g.attr("axis"))


# Scatter (opsets 9-10) is ScatterElements without reduction; models are upgraded to opset 17 first, so
# this only keeps the rule families complete
gradient("Scatter", uses=("x0", "x1", "x2"), stop=(1,))(scatter_elements_grad)


@gradient("ScatterND", uses=("x0", "x1", "x2", "y0"), stop=(1,))
def scatter_nd_grad(g: GradCtx) -> None:
    # x0 and x2 are read only for reductions mul, max and min, y0 for max and min
    _scatter_grad(g, "ScatterND", "GatherND")


@gradient("GatherND", uses=("x1",), stop=(1,), linear=True)
def gather_nd_grad(g: GradCtx) -> None:
    b = g.attr("batch_dims")
    if b == 0:
        # dData = ScatterND(zeros, idx, dY, add)
        g.set_dx(0, g.emit("ScatterND", zeros(g, g.shape(0)), g.x(1), g.dy(0), reduction="add"))
        return
    # ScatterND has no batch_dims: route dY back through the flat positions of data (iota trick)
    g.set_dx(0, route_back(g, g.dy(0), lambda iota: g.emit("GatherND", iota, g.x(1), batch_dims=b),
                           repeats=True))


@gradient("TensorScatter", uses=("x2",), stop=(2,), linear=True)
def tensor_scatter_grad(g: GradCtx) -> None:
    # dPast is dY with the written positions zeroed (zeros scattered the same way); dUpdate is dY read back at
    # the written positions: write_indices[b] + s along the axis (modulo the cache length when circular)
    dy, axis, mode = g.dy(0), g.attr("axis"), g.attr("mode")
    w = g.x(2) if g.has_x(2) else None
    if g.needs_dx(0):
        g.set_dx(0, g.emit("TensorScatter", dy, zeros(g, g.shape(1)), w, mode=mode, axis=axis))
    if not g.needs_dx(1):
        return
    if w is None:  # positions 0 .. S-1 in both modes
        g.set_dx(1, g.emit("Slice", dy, g.ints([0]), g.emit("Gather", g.shape(1), g.ints([axis])),
                           g.ints([axis])))
        return
    # s at every element of the update, plus its batch row's write index (over a (batch, rest) view)
    ones = zeros(g, g.shape(1), 1, elem=I64)
    s = g.emit("CumSum", ones, g.const(np.array(axis, np.int64), I64), exclusive=1)
    pos = g.emit("Add", g.emit("Reshape", s, g.ints([0, -1])), g.emit("Unsqueeze", w, g.ints([1])))
    pos = g.emit("Reshape", pos, g.shape(1))
    if mode == "circular":
        pos = g.emit("Mod", pos, g.emit("Gather", g.shape(0), g.const(np.array(axis, np.int64), I64)))
    g.set_dx(1, g.emit("GatherElements", dy, pos, axis=axis))


no_gradient("OneHot", "NonZero")


@gradient("CumSum", uses=("x1",), stop=(1,), linear=True)
def cumsum_grad(g: GradCtx) -> None:
    # the transpose of a (reverse, exclusive) prefix sum is the prefix sum in the other direction
    g.set_dx(0, g.emit("CumSum", g.dy(0), g.x(1), exclusive=g.attr("exclusive"),
                       reverse=1 - g.attr("reverse")))


_END = 2**63 - 1  # a Slice end past any axis


@gradient("CumProd", uses=("x0", "x1"), stop=(1,))
def cumprod_grad(g: GradCtx) -> None:
    # Y_j = Π_{k≤j} x_k: dX_i = Σ_{j≥i} dY_j·Π_{k≤j, k≠i} x_k = E_i·S_i, with E_i = Π_{k<i} x_k (the
    # exclusive CumProd) and S_i = Σ_{j≥i} dY_j·Π_{i<k≤j} x_k, the linear recurrence
    # S_i = dY_i + x_{i+1}·S_{i+1}. Exclusive: dY_{i+1} in place of dY_i. Reverse: the mirror image
    # (E_i = Π_{k>i} x_k, S_i = dY_i + x_{i-1}·S_{i-1}).
    # The recurrence is solved by recursive doubling: ⌈log2 n⌉ steps of a few Slice, Mul, Pad and Add
    # nodes on arrays of X's size (O(n log n) work, O(n) memory along the axis). Nothing is divided, so
    # zeros in X are exact, where dY·Y/X is not. When the axis length is unknown as the graph is built,
    # a Loop runs the steps.
    # Unrolled, the Pads name every axis rather than take Pad's axes input: onnxruntime 1.32's transpose
    # optimizer permutes the pads of a Pad with axes as if they covered every axis (the gradient of a
    # transposed value failed in a Gather it inserts). The Loop's Pads (and those feeding it) stay
    # out of its reach: it moves no Transpose into or across a Loop.
    x, dy, rev = g.x(0), g.dy(0), g.attr("reverse")
    from_end = not rev  # S_i reads S_{i+1}
    axes = g.emit("Reshape", as_int64(g, g.x(1)), g.ints([1]))
    zero, end, one = g.ints([0]), g.ints([_END]), g.const(1)
    axis, shape = g.constant_value(1), g.static_shape(0)
    n = shape[int(axis) % len(shape)] if axis is not None and shape else None
    pad_axes: str | None = axes if n is None else None

    def shift(d: int) -> str:
        """Pads moving a slice ``d`` places back into place along the axis."""
        if n is None:
            return g.ints([0, d] if from_end else [d, 0])
        rank = len(shape)
        full = [0] * (2 * rank)
        full[int(axis) % rank + (rank if from_end else 0)] = d
        return g.ints(full)

    far = _halves(zero, g.ints([1]), g.ints([-1]), end, from_end)[1]
    # x_{i±1}; the last one is never read
    a = g.emit("Pad", *trim(g.emit("Slice", x, *far, axes), shift(1), one, pad_axes))
    b = dy
    if g.attr("exclusive"):
        b = g.emit("Pad", *trim(g.emit("Slice", dy, *far, axes), shift(1), None, pad_axes))
    if n is None:
        s = _doubling_loop(g, a, b, axes, from_end)
    else:
        s, d = b, 1
        while d < n:
            near, far = _halves(zero, g.ints([d]), g.ints([-d]), end, from_end)
            a, s = _doubling_step(g.emit, a, s, axes, near, far, shift(d), one, 2 * d >= n, pad_axes=None)
            d *= 2
    e = g.emit("CumProd", x, g.x(1), exclusive=1, reverse=rev)
    g.set_dx(0, g.emit("Mul", e, s))


def _halves(zero: str, d: str, neg_d: str, end: str, from_end: bool
            ) -> tuple[tuple[str, str], tuple[str, str]]:
    """(starts, ends) along the axis of the elements with a partner ``d`` places on, and of the partners."""
    lo, hi = (zero, neg_d), (d, end)
    return (lo, hi) if from_end else (hi, lo)


def _doubling_step(emit: Any, a: str, b: str, axes: str, near: tuple[str, str], far: tuple[str, str],
                   pads: str, one: str, last: bool, pad_axes: str | None) -> tuple[str, str]:
    """One step of recursive doubling for s_i = b_i + a_i·s_partner: element i's map s ↦ b + a·s composed with
    its partner's, (a, b) ← (a·a', b + a·b'); elements without a partner keep theirs. ``pads`` puts the
    partners' slice back in place (along ``pad_axes``, or over every axis when None); ``last``: a is not
    needed afterwards."""
    prod = emit("Mul", emit("Slice", a, *near, axes), emit("Slice", b, *far, axes))
    b = emit("Add", b, emit("Pad", *trim(prod, pads, None, pad_axes)))
    if not last:
        a = emit("Mul", a, emit("Pad", *trim(emit("Slice", a, *far, axes), pads, one, pad_axes)))
    return a, b


def _doubling_loop(g: GradCtx, a: str, b: str, axes: str, from_end: bool) -> str:
    """The doubling steps as a Loop over d = 1, 2, 4, ... while d < n, the axis length read at run time;
    returns the final b."""
    names = g._bw.names
    pre = f"{g.node.name or g.node.op_type}_Grad/doubling/"
    it, cond, d, a_in, b_in = (names(pre + v) for v in ("iter", "cond", "d", "a", "b"))
    n = g.emit("Gather", g.shape(0), axes)
    zero, end, one, two = g.ints([0]), g.ints([_END]), g.const(1), g.ints([2])
    nodes: list[onnx.NodeProto] = []
    w = NodeWriter(names, nodes, prefix=pre)
    near, far = _halves(zero, d, w.one("Neg", d), end, from_end)
    pads = w.one("Concat", *((zero, d) if from_end else (d, zero)), axis=0)
    a_out, b_out = _doubling_step(w.one, a_in, b_in, axes, near, far, pads, one, last=False, pad_axes=axes)
    d_out = w.one("Mul", d, two)
    more = w.one("Squeeze", w.one("Less", d_out, n))
    vi = onnx.helper.make_tensor_value_info
    body = onnx.helper.make_graph(
        nodes, "cumprod_grad_doubling",
        [vi(it, I64, []), vi(cond, onnx.TensorProto.BOOL, []), vi(d, I64, [1]), vi(a_in, g.dtype, None),
         vi(b_in, g.dtype, None)],
        [vi(more, onnx.TensorProto.BOOL, []), vi(d_out, I64, [1]), vi(a_out, g.dtype, None),
         vi(b_out, g.dtype, None)],
    )
    first = g.emit("Squeeze", g.emit("Less", g.ints([1]), n))
    return g.emit("Loop", None, first, g.ints([1]), a, b, body=body, outputs=3)[2]


@gradient("TopK", uses=("y1",), stop=(1,), linear=True)
def topk_grad(g: GradCtx) -> None:
    # values came from X at Indices (distinct within a row): scatter dValues back; Indices get none
    if g.dy(0) is None:
        return
    g.set_dx(0, g.emit("ScatterElements", zeros(g, g.shape(0)), g.y(1), g.dy(0), axis=g.attr("axis")))


no_gradient("ArgMax", "ArgMin")


@gradient("Compress", uses=("x1",), stop=(1,), linear=True)
def compress_grad(g: GradCtx) -> None:
    # the iota trick: the kept positions are distinct, so no reduction is needed
    axis = g.attr("axis")
    g.set_dx(0, route_back(g, g.dy(0), lambda iota: g.emit("Compress", iota, g.x(1), axis=axis),
                           repeats=False))


no_gradient("Unique")
