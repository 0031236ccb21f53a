"""Gradient rules of the elementwise ops (same names and order as engine/kernels/elementwise.py)."""

from __future__ import annotations

from onnxtrain.autodiff.context import GradCtx
from onnxtrain.autodiff.registry import gradient


@gradient("Add", linear=True)
def add_grad(g: GradCtx) -> None:
    for i in (0, 1):
        if g.needs_dx(i):
            g.set_dx(i, g.unbroadcast(g.dy(0), i))


@gradient("Mul", uses=("x0", "x1"))
def mul_grad(g: GradCtx) -> None:
    # dA = dY·B, dB = dY·A
    for i in (0, 1):
        if g.needs_dx(i):
            g.set_dx(i, g.unbroadcast(g.emit("Mul", g.dy(0), g.x(1 - i)), i))


@gradient("Sum", linear=True)
def sum_grad(g: GradCtx) -> None:
    for i in range(g.n_inputs):
        if g.needs_dx(i):
            g.set_dx(i, g.unbroadcast(g.dy(0), i))


@gradient("Identity", linear=True)
def identity_grad(g: GradCtx) -> None:
    g.set_dx(0, g.dy(0))
