"""Gradient rules of the reductions (same names as engine/kernels/reduce.py)."""

from __future__ import annotations

from onnxtrain.autodiff.context import GradCtx
from onnxtrain.autodiff.registry import gradient


def _axes(g: GradCtx) -> list[int] | str | None:
    """The reduced axes as a list (attribute or constant input), a dynamic name, or None for all."""
    if g.opset >= 13 and g.node.op_type == "ReduceSum" or g.opset >= 18:
        if not g.has_x(1):
            return None
        return g.node.input[1]
    return g.attr("axes")


def expand_back(g: GradCtx, dy: str) -> str:
    """``dy`` of a reduction, broadcast back to the input's shape (reduced axes re-inserted)."""
    axes = _axes(g)
    if not g.attr("keepdims"):
        if axes is None:
            rank = g.rank(0)
            if rank is None:
                raise ValueError("rank of the reduced input is unknown")
            axes = list(range(rank))
        if isinstance(axes, str):
            dy = g.emit("Unsqueeze", dy, axes)
        elif axes:
            dy = g.emit("Unsqueeze", dy, g.ints(axes))
    return g.emit("Expand", dy, g.shape(0))


@gradient("ReduceSum", stop=(1,), linear=True)
def reduce_sum_grad(g: GradCtx) -> None:
    axes = _axes(g)
    if axes is not None and not isinstance(axes, str) and not axes and g.attr("noop_with_empty_axes"):
        g.set_dx(0, g.dy(0))
        return
    g.set_dx(0, expand_back(g, g.dy(0)))
