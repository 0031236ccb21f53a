"""Gradient rules of the reductions (same names as engine/kernels/reduce.py).

Every rule works on ``keep(t)``: a reduced tensor with its reduced axes re-inserted as size 1, which
broadcasts against X. The axes come from the ``axes`` attribute (before opset 18; ReduceSum before
13), from a constant ``axes`` input (read at build time), or from a dynamic one (used as a tensor).
With no axes and ``noop_with_empty_axes=1`` nothing is reduced: the forward is elementwise (|x| for
ReduceL1, log x for ReduceLogSum ...), and the same formulas with "reduce nothing" give its gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from onnxtrain.autodiff.context import GradCtx
from onnxtrain.autodiff.registry import gradient


def constant_value(g: GradCtx, name: str) -> np.ndarray | None:
    """The value of ``name`` when it is a constant of the graph, else None (see GradCtx.constant_value)."""
    return g.constant_value(name) if name else None


@dataclass
class _Axes:
    """The reduced axes: a list (never empty), a dynamic int64 tensor name, or None for all axes."""

    axes: list[int] | str | None
    keepdims: bool
    noop: bool  # statically nothing reduced (no axes and noop_with_empty_axes=1)
    noop_attr: int  # noop_with_empty_axes, for reductions over a dynamic axes tensor
    tensor: str | None = None  # the axes as an int64 tensor, once emitted

    def as_tensor(self, g: GradCtx) -> str:
        """The axes as an int64 tensor name (one Constant per rule)."""
        if isinstance(self.axes, str):
            return self.axes
        if self.tensor is None:
            self.tensor = g.ints(self.axes or [])
        return self.tensor


def _axes(g: GradCtx) -> _Axes:
    as_input = g.opset >= 13 and g.node.op_type == "ReduceSum" or g.opset >= 18
    noop_attr = int(g.attr("noop_with_empty_axes") or 0)
    axes: list[int] | str | None
    if not as_input:
        axes = [int(a) for a in g.attr("axes") or []] or None
    elif not g.has_x(1):
        axes = None
    else:
        v = constant_value(g, g.node.input[1])
        axes = g.node.input[1] if v is None else ([int(a) for a in v.reshape(-1)] or None)
    keepdims = bool(g.attr("keepdims"))
    return _Axes(axes, keepdims, axes is None and bool(noop_attr), noop_attr)


def keep(g: GradCtx, t: str, ax: _Axes | None = None) -> str:
    """A reduced tensor ``t`` with the reduced axes re-inserted (size 1), so that it broadcasts against X."""
    ax = ax or _axes(g)
    if ax.keepdims or ax.noop or ax.axes is None:
        return t  # already keepdims-shaped, not reduced, or a scalar (all axes reduced)
    return g.emit("Unsqueeze", t, ax.as_tensor(g))


def expand_back(g: GradCtx, dy: str, ax: _Axes | None = None) -> str:
    """``dy`` of a reduction, broadcast back to the input's shape (reduced axes re-inserted)."""
    ax = ax or _axes(g)
    if ax.noop:
        return dy
    return g.emit("Expand", keep(g, dy, ax), g.shape(0))


def _sum_keep(g: GradCtx, t: str, ax: _Axes) -> str:
    """ReduceSum of ``t`` (shaped like X) over the reduced axes, keepdims=1."""
    if ax.noop:
        return t
    if ax.axes is None:
        return g.emit("ReduceSum", t, keepdims=1)
    # ReduceSum takes its axes as an input at every opset we emit (>= 13)
    # a dynamic axes tensor may be empty at run time: keep the node's noop_with_empty_axes
    noop = ax.noop_attr if isinstance(ax.axes, str) and ax.noop_attr else None
    return g.emit("ReduceSum", t, ax.as_tensor(g), keepdims=1, noop_with_empty_axes=noop)


def _inv_count(g: GradCtx, ax: _Axes) -> str:
    """1 / (number of elements reduced into each output element), of the node's float type."""
    xs = g.static_shape(0)
    if xs is not None and not isinstance(ax.axes, str):
        red = range(len(xs)) if ax.axes is None else {a % len(xs) for a in ax.axes} if xs else ()
        dims = [xs[a] for a in red]
        if all(d is not None for d in dims):
            return g.const(1.0 / max(math.prod(dims), 1))  # type: ignore[arg-type]
    # dynamic: Size(Y) / Size(X), from the Shapes taken in the forward pass
    size_y, size_x = (g.emit("Cast", g.emit("ReduceProd", s, keepdims=0), to=g.dtype)
                      for s in (g.shape(0, output=True), g.shape(0)))
    return g.emit("Div", size_y, size_x)


@gradient("ReduceSum", stop=(1,), linear=True)
def reduce_sum_grad(g: GradCtx) -> None:
    # dX = Expand(dY)
    g.set_dx(0, expand_back(g, g.dy(0)))


@gradient("ReduceMean", stop=(1,), linear=True)
def reduce_mean_grad(g: GradCtx) -> None:
    # dX = Expand(dY) / count (scaled before the Expand, on the small tensor)
    ax = _axes(g)
    if ax.noop:
        g.set_dx(0, g.dy(0))
        return
    g.set_dx(0, expand_back(g, g.emit("Mul", g.dy(0), _inv_count(g, ax)), ax))


def _extreme_grad(g: GradCtx) -> None:
    """dX = dY shared evenly among the elements of each slice equal to its max (min), dY/k for k ties and 0
    elsewhere: ``torch.amax`` / ``torch.amin``'s gradient, and ``torch.max(x)``'s without a dim.

    The choice among the conventions: ``torch.max(x, dim)`` gives all of dY to the one index it returns,
    but torch's exporters write it as this same ReduceMax (beside an ArgMax when the index is used, as
    they write ``amax`` beside ``argmax``), so the graph cannot tell the two apart; sharing is what
    ``amax``/``amin``, TensorFlow's and JAX's max reductions and onnxruntime-training's elementwise Max/Min
    gradient (since 2022) do, and it does not depend on the order of the elements. onnxruntime-training
    registers no ReduceMax/ReduceMin gradient (one was merged and reverted), so such a graph did not build
    there; its ORTModule exported ``torch.max(x, dim)`` as an ATen op with torch's one-index gradient.

    A slice holding a NaN has a NaN max, which no element equals: its gradient is NaN throughout, as
    ``torch.amax``'s (``torch.max(x)`` instead shares dY among the NaNs); onnxruntime's ReduceMax does not
    always give NaN there, and on that backend the gradient follows the max it gives. With nothing reduced
    (no axes, or fed axes empty at run time, and ``noop_with_empty_axes``) the node is the identity and dY
    passes as it is, NaNs included."""
    ax = _axes(g)
    if ax.noop:
        g.set_dx(0, g.dy(0))
        return
    mask = g.emit("Cast", g.emit("Equal", g.x(0), keep(g, g.y(0), ax)), to=g.dtype)
    dy = keep(g, g.dy(0), ax)
    dx = g.emit("Mul", mask, g.emit("Div", dy, _sum_keep(g, mask, ax)))
    if isinstance(ax.axes, str) and ax.noop_attr:  # fed axes, empty at run time: the identity as above
        dx = g.emit("Where", g.emit("Equal", g.emit("Size", ax.axes), g.int64(0)), dy, dx)
    g.set_dx(0, dx)


@gradient("ReduceMax", stop=(1,), uses=("x0", "y0"))
def reduce_max_grad(g: GradCtx) -> None:
    _extreme_grad(g)


@gradient("ReduceMin", stop=(1,), uses=("x0", "y0"))
def reduce_min_grad(g: GradCtx) -> None:
    _extreme_grad(g)


@gradient("ReduceProd", stop=(1,), uses=("x0",))
def reduce_prod_grad(g: GradCtx) -> None:
    # dX_i = dY · (product of the slice's other elements). With P the product of the slice's nonzero
    # elements and Z its number of zeros: P / X_i where Z = 0; for a zero X_i, P where Z = 1 and 0 where
    # Z > 1; for a nonzero X_i in a slice with a zero, 0. (ONNX has no exclusive product scan.)
    ax = _axes(g)
    x = g.x(0)
    zero = g.emit("Equal", x, g.const(0))
    nonzero = g.emit("Where", zero, g.const(1), x)
    if ax.noop:
        prod = nonzero
    elif isinstance(ax.axes, str):  # dynamic axes, which may be empty at run time
        prod = g.emit("ReduceProd", nonzero, ax.axes, keepdims=1, noop_with_empty_axes=ax.noop_attr or None)
    else:
        prod = g.reduce("ReduceProd", nonzero, ax.axes, keepdims=1)
    zeros = _sum_keep(g, g.emit("Cast", zero, to=g.dtype), ax)
    others = g.emit(
        "Where", zero,
        g.emit("Where", g.emit("Equal", zeros, g.const(1)), prod, g.const(0)),
        g.emit("Where", g.emit("Equal", zeros, g.const(0)), g.emit("Div", prod, nonzero), g.const(0)),
    )
    g.set_dx(0, g.emit("Mul", keep(g, g.dy(0), ax), others))


@gradient("ReduceL1", stop=(1,), uses=("x0",))
def reduce_l1_grad(g: GradCtx) -> None:
    # dX = dY·sgn(X) with torch's sgn, 0 at X == ±0 and at a NaN X (a NaN whose sum is masked out downstream,
    # dY = 0, sends no NaN back)
    g.set_dx(0, g.emit("Mul", keep(g, g.dy(0)), g.sgn(g.x(0))))


@gradient("ReduceL2", stop=(1,), uses=("x0", "y0"))
def reduce_l2_grad(g: GradCtx) -> None:
    # dX = X·dY/Y, 0 where Y == 0 (then the whole slice of X is 0)
    y = g.y(0)
    safe = g.emit("Where", g.emit("Equal", y, g.const(0)), g.const(1), y)
    g.set_dx(0, g.emit("Mul", g.x(0), keep(g, g.emit("Div", g.dy(0), safe))))


@gradient("ReduceSumSquare", stop=(1,), uses=("x0",))
def reduce_sum_square_grad(g: GradCtx) -> None:
    # dX = 2·X·dY
    g.set_dx(0, g.emit("Mul", g.x(0), keep(g, g.emit("Mul", g.dy(0), g.const(2)))))


@gradient("ReduceLogSum", stop=(1,), uses=("y0",))
def reduce_log_sum_grad(g: GradCtx) -> None:
    # Y = log ΣX:  dX = dY / ΣX = dY / Exp(Y)
    g.set_dx(0, expand_back(g, g.emit("Div", g.dy(0), g.emit("Exp", g.y(0)))))


@gradient("ReduceLogSumExp", stop=(1,), uses=("x0", "y0"))
def reduce_log_sum_exp_grad(g: GradCtx) -> None:
    # dX = dY·Exp(X − Y)  (the softmax of X over the reduced axes)
    ax = _axes(g)
    p = g.emit("Exp", g.emit("Sub", g.x(0), keep(g, g.y(0), ax)))
    g.set_dx(0, g.emit("Mul", p, keep(g, g.dy(0), ax)))
