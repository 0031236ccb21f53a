"""Gradient rules of the indexing ops (same names and order as engine/kernels/indexing.py).

Gathers scatter ``dY`` back with ``reduction="add"`` (repeated indices sum their gradients;
ScatterElements/ScatterND accept negative indices, so they need no normalising); scatters gather
``dY`` for their updates.
"""

from __future__ import annotations

import numpy as np
import onnx

from onnxtrain.autodiff.context import GradCtx, RuleError
from onnxtrain.autodiff.registry import gradient, no_gradient
from onnxtrain.autodiff.rules.shape import as_int64, route_back, zeros


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
            g.set_dx(2, gather_of(dy))
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
    else:
        raise RuleError(f"{g.node.op_type} with reduction={red!r} has no gradient rule")


@gradient("ScatterElements", uses=("x0", "x1", "x2"), stop=(1,))
def scatter_elements_grad(g: GradCtx) -> None:
    # x0 and x2 are read only for reduction="mul"
    _scatter_grad(g, "ScatterElements", "GatherElements", axis=g.attr("axis"))


# Scatter (opsets 9-10) is ScatterElements without reduction; models are upgraded to opset 17 first, so
# this only keeps the rule families complete
gradient("Scatter", uses=("x0", "x1", "x2"), stop=(1,))(scatter_elements_grad)


@gradient("ScatterND", uses=("x0", "x1", "x2"), stop=(1,))
def scatter_nd_grad(g: GradCtx) -> None:
    # x0 and x2 are read only for reduction="mul"
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


no_gradient("OneHot", "NonZero")


@gradient("CumSum", uses=("x1",), stop=(1,), linear=True)
def cumsum_grad(g: GradCtx) -> None:
    # the transpose of a (reverse, exclusive) prefix sum is the prefix sum in the other direction
    g.set_dx(0, g.emit("CumSum", g.dy(0), g.x(1), exclusive=g.attr("exclusive"),
                       reverse=1 - g.attr("reverse")))


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
