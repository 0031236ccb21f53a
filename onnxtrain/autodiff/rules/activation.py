"""Gradient rules of the activation ops (same names and order as engine/kernels/activation.py)."""

from __future__ import annotations

from onnxtrain.autodiff.context import GradCtx
from onnxtrain.autodiff.registry import gradient


@gradient("Relu", uses=("y0",))
def relu_grad(g: GradCtx) -> None:
    g.set_dx(0, g.emit("Where", g.emit("Greater", g.y(0), g.const(0)), g.dy(0), g.const(0)))
