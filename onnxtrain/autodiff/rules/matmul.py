"""Gradient rules of MatMul, Gemm and Einsum (same names as engine/kernels/matmul.py)."""

from __future__ import annotations

from onnxtrain.autodiff.context import GradCtx
from onnxtrain.autodiff.registry import gradient


@gradient("Gemm", uses=("x0", "x1"))
def gemm_grad(g: GradCtx) -> None:
    # Y = alpha·op(A)·op(B) + beta·C;  d op(A) = alpha·dY·op(B)ᵀ, d op(B) = alpha·op(A)ᵀ·dY
    ta, tb = g.attr("transA"), g.attr("transB")
    alpha, beta = g.attr("alpha"), g.attr("beta")
    dy = g.dy(0)
    if alpha != 1.0 and (g.needs_dx(0) or g.needs_dx(1)):
        dy_a = g.emit("Mul", dy, g.const(alpha))
    else:
        dy_a = dy
    if g.needs_dx(0):
        # dA = dY·op(B)ᵀ (transposed back when transA)
        if ta:
            g.set_dx(0, g.emit("Gemm", g.x(1), dy_a, transA=tb, transB=1))
        else:
            g.set_dx(0, g.emit("Gemm", dy_a, g.x(1), transA=0, transB=1 - tb))
    if g.needs_dx(1):
        if tb:
            g.set_dx(1, g.emit("Gemm", dy_a, g.x(0), transA=1, transB=ta))
        else:
            g.set_dx(1, g.emit("Gemm", g.x(0), dy_a, transA=1 - ta, transB=0))
    if g.has_x(2) and g.needs_dx(2):
        dc = dy if beta == 1.0 else g.emit("Mul", dy, g.const(beta))
        g.set_dx(2, g.unbroadcast(dc, 2, grad_rank=2))
