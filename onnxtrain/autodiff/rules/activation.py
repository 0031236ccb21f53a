"""Gradient rules of the activation ops (same names and order as engine/kernels/activation.py)."""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from onnxtrain.autodiff.context import GradCtx
from onnxtrain.autodiff.registry import gradient, no_gradient

no_gradient("Hardmax")  # piecewise constant: zero gradient almost everywhere


def _mask(g: GradCtx, cond: str, dy: str) -> str:
    """``cond ? dy : 0``."""
    return g.emit("Where", cond, dy, g.const(0))


@gradient("Relu", uses=("y0",))
def relu_grad(g: GradCtx) -> None:
    # dX = dY where Y > 0; 0 at X == 0 (torch's choice)
    g.set_dx(0, _mask(g, g.emit("Greater", g.y(0), g.const(0)), g.dy(0)))


@gradient("Sigmoid", uses=("y0",))
def sigmoid_grad(g: GradCtx) -> None:
    # dX = dY·Y·(1 - Y)
    y = g.y(0)
    g.set_dx(0, g.emit("Mul", g.dy(0), g.emit("Mul", y, g.emit("Sub", g.const(1), y))))


@gradient("Tanh", uses=("y0",))
def tanh_grad(g: GradCtx) -> None:
    # dX = dY·(1 - Y²)
    y = g.y(0)
    g.set_dx(0, g.emit("Mul", g.dy(0), g.emit("Sub", g.const(1), g.emit("Mul", y, y))))


@gradient("Gelu", since=20, uses=("x0",))
def gelu_grad(g: GradCtx) -> None:
    x = g.x(0)
    x2 = g.emit("Mul", x, x)
    if g.attr("approximate") == "tanh":
        # Y = ½X(1 + t), t = tanh(u), u = c(X + kX³), c = √(2/π), k = 0.044715
        # dX = dY·(½(1 + t) + ½X(1 - t²)·c(1 + 3kX²))
        c, k = math.sqrt(2.0 / math.pi), 0.044715
        t = g.emit("Tanh", g.emit("Mul", x, g.emit("Add", g.emit("Mul", x2, g.const(c * k)), g.const(c))))
        if g.dtype in (TensorProto.FLOAT16, TensorProto.BFLOAT16):
            # X² overflows float16 from |X| = 256 (float32 from 1.8e19), and (1 - t²)·du was 0·inf = nan:
            # du from X clipped to ±100, where 1 - t² is already 0 (one pass, half types only)
            xc = g.emit("Clip", x, g.const(-100.0), g.const(100.0))
            x2 = g.emit("Mul", xc, xc)
        du = g.emit("Add", g.emit("Mul", x2, g.const(3 * c * k)), g.const(c))
        sech2 = g.emit("Sub", g.const(1), g.emit("Mul", t, t))
        half_x = g.emit("Mul", x, g.const(0.5))
        d = g.emit("Add", g.emit("Add", g.emit("Mul", t, g.const(0.5)), g.const(0.5)),
                   g.emit("Mul", half_x, g.emit("Mul", sech2, du)))
    else:
        # Y = X·Φ(X): dX = dY·(Φ(X) + X·φ(X)), Φ(X) = ½(1 + erf(X/√2)), φ(X) = exp(-X²/2)/√(2π)
        erf = g.emit("Erf", g.emit("Mul", x, g.const(math.sqrt(0.5))))
        cdf = g.emit("Add", g.emit("Mul", erf, g.const(0.5)), g.const(0.5))
        gauss = g.emit("Exp", g.emit("Mul", x2, g.const(-0.5)))
        pdf = g.emit("Mul", gauss, g.const(1 / math.sqrt(2 * math.pi)))
        d = g.emit("Add", cdf, g.emit("Mul", x, pdf))
    g.set_dx(0, g.emit("Mul", g.dy(0), d))


@gradient("LeakyRelu", uses=("x0",))
def leaky_relu_grad(g: GradCtx) -> None:
    # dX = X > 0 ? dY : alpha·dY (alpha·dY at X == 0, as torch)
    dy = g.dy(0)
    pos = g.emit("Greater", g.x(0), g.const(0))
    g.set_dx(0, g.emit("Where", pos, dy, g.emit("Mul", dy, g.const(g.attr("alpha")))))


@gradient("PRelu", uses=("x0", "x1"))
def prelu_grad(g: GradCtx) -> None:
    # Y = X > 0 ? X : slope·X: dX = X > 0 ? dY : slope·dY; dSlope = unbroadcast(X > 0 ? 0 : X·dY)
    x, dy = g.x(0), g.dy(0)
    pos = g.emit("Greater", x, g.const(0))
    if g.needs_dx(0):
        g.set_dx(0, g.emit("Where", pos, dy, g.emit("Mul", dy, g.x(1))))
    if g.needs_dx(1):
        g.set_dx(1, g.unbroadcast(g.emit("Where", pos, g.const(0), g.emit("Mul", dy, x)), 1))


def _exp_neg(g: GradCtx, scale: float) -> str:
    """``Exp(Min(X, 0)·scale)``: 1 where X ≥ 0 (no overflow), NaN where X is NaN."""
    m = g.emit("Min", g.x(0), g.const(0))
    return g.emit("Exp", m if scale == 1.0 else g.emit("Mul", m, g.const(scale)))


def _exp_linear_grad(g: GradCtx, alpha: float, gamma: float) -> None:
    # Y = gamma·(X > 0 ? X : alpha·(e^X - 1)): dX = X > 0 ? gamma·dY : dY·gamma·alpha·e^X, from X as torch's
    # elu_backward (from Y, dY·(Y + gamma·alpha) cancelled as Y → -gamma·alpha: 0 from X ≈ -17 in float32).
    # X == 0 takes the exponential side, a NaN X the linear one (gamma·dY: 0 where masked out), as torch
    dy = g.dy(0)
    e = _exp_neg(g, 1.0)
    neg = g.emit("Mul", dy, e if gamma * alpha == 1.0 else g.emit("Mul", e, g.const(gamma * alpha)))
    lin = dy if gamma == 1.0 else g.emit("Mul", dy, g.const(gamma))
    g.set_dx(0, g.emit("Where", _at_most_zero(g), neg, lin))


def _at_most_zero(g: GradCtx) -> str:
    """X ≤ 0, false at a NaN X (before opset 12, where LessOrEqual is missing: not X > 0, true there)."""
    if g.opset >= 12:
        return g.emit("LessOrEqual", g.x(0), g.const(0))
    return g.emit("Not", g.emit("Greater", g.x(0), g.const(0)))


@gradient("Elu", uses=("x0",))
def elu_grad(g: GradCtx) -> None:
    _exp_linear_grad(g, g.attr("alpha"), 1.0)


@gradient("Selu", uses=("x0",))
def selu_grad(g: GradCtx) -> None:
    _exp_linear_grad(g, g.attr("alpha"), g.attr("gamma"))


@gradient("Celu", uses=("x0",))
def celu_grad(g: GradCtx) -> None:
    # Y = max(0, X) + min(0, alpha·(e^(X/alpha) - 1)): dX = dY·e^(min(X, 0)/alpha), from X as torch (from Y,
    # dY·(min(Y, 0)/alpha + 1) cancelled as Y → -alpha); dY itself where X > 0 or X is NaN, as torch
    dy = g.dy(0)
    g.set_dx(0, g.emit("Where", _at_most_zero(g), g.emit("Mul", dy, _exp_neg(g, 1.0 / g.attr("alpha"))), dy))


@gradient("HardSigmoid", uses=("y0",))
def hard_sigmoid_grad(g: GradCtx) -> None:
    # Y = clip(alpha·X + beta, 0, 1): dX = alpha·dY where 0 < Y < 1 (0 at the kinks, as torch)
    y = g.y(0)
    inside = g.emit("And", g.emit("Greater", y, g.const(0)), g.emit("Less", y, g.const(1)))
    g.set_dx(0, _mask(g, inside, g.emit("Mul", g.dy(0), g.const(g.attr("alpha")))))


@gradient("HardSwish", uses=("x0",))
def hard_swish_grad(g: GradCtx) -> None:
    # Y = X·clip(a·X + ½, 0, 1) with a = 1/6 as ONNX's body has it (a float32 attribute, as the kernel
    # uses): dX = X ≤ -3 ? 0 : dY·(X < 3 ? 2a·X + ½ : 1); at ±3 the outer piece's slope, as torch. The flat
    # side is selected, not dY·0 (torch's hardswish_backward): an infinite or NaN dY there sends 0, not NaN
    x = g.x(0)
    mid = g.emit("Add", g.emit("Mul", x, g.const(2 * float(np.float32(1 / 6)))), g.const(0.5))
    d = g.emit("Where", g.emit("Less", x, g.const(3)), mid, g.const(1))
    flat = g.emit("LessOrEqual", x, g.const(-3))
    g.set_dx(0, g.emit("Where", flat, g.const(0), g.emit("Mul", g.dy(0), d)))


@gradient("Softplus", uses=("x0",))
def softplus_grad(g: GradCtx) -> None:
    # dX = dY·sigmoid(X)
    g.set_dx(0, g.emit("Mul", g.dy(0), g.emit("Sigmoid", g.x(0))))


@gradient("Softsign", uses=("x0",))
def softsign_grad(g: GradCtx) -> None:
    # dX = dY / (1 + |X|)²
    s = g.emit("Add", g.emit("Abs", g.x(0)), g.const(1))
    g.set_dx(0, g.emit("Div", g.dy(0), g.emit("Mul", s, s)))


@gradient("Mish", uses=("x0",))
def mish_grad(g: GradCtx) -> None:
    # Y = X·t, t = tanh(softplus(X)): dX = dY·(t + X·sigmoid(X)·(1 - t²))
    x = g.x(0)
    t = g.emit("Tanh", g.emit("Softplus", x))
    sech2 = g.emit("Sub", g.const(1), g.emit("Mul", t, t))
    d = g.emit("Add", t, g.emit("Mul", g.emit("Mul", x, g.emit("Sigmoid", x)), sech2))
    g.set_dx(0, g.emit("Mul", g.dy(0), d))


@gradient("Clip", uses=("x*",))
def clip_grad(g: GradCtx) -> None:
    # dX = dY where min ≤ X ≤ max (boundaries included, as torch.clamp). Tensor bounds that want a gradient
    # (learnable clamp bounds: torch.clamp with tensor min/max) get torch's clamp_backward_min_max, each
    # summed down to the bound's shape: dmin = dY where X < min (and min < max when max is given), dmax = dY
    # where X > max (or max < min when min is given, the output then being max everywhere). At a tie
    # X == bound only X gets dY; with min == max an X outside passes none to either bound (as torch)
    x, dy = g.x(0), g.dy(0)
    lo, hi = (g.x(i) if g.has_x(i) else None for i in (1, 2))
    if g.needs_dx(0):
        conds = [g.emit(op, x, b) for b, op in ((lo, "GreaterOrEqual"), (hi, "LessOrEqual")) if b]
        if not conds:
            g.set_dx(0, dy)
        else:
            g.set_dx(0, _mask(g, conds[0] if len(conds) == 1 else g.emit("And", *conds), dy))
    if g.needs_dx(1) and lo:
        below = g.emit("Less", x, lo)
        if hi:
            below = g.emit("And", below, g.emit("Less", lo, hi))
        g.set_dx(1, g.unbroadcast(_mask(g, below, dy), 1))
    if g.needs_dx(2) and hi:
        above = g.emit("Greater", x, hi)
        if lo:
            above = g.emit("Or", above, g.emit("Less", hi, lo))
        g.set_dx(2, g.unbroadcast(_mask(g, above, dy), 2))


@gradient("ThresholdedRelu", uses=("x0",))
def thresholded_relu_grad(g: GradCtx) -> None:
    # dX = dY where X > alpha
    g.set_dx(0, _mask(g, g.emit("Greater", g.x(0), g.const(g.attr("alpha"))), g.dy(0)))


@gradient("Shrink", uses=("x0",))
def shrink_grad(g: GradCtx) -> None:
    # Y = X ∓ bias where |X| > lambd, else 0: dX = dY where |X| > lambd
    out = g.emit("Greater", g.emit("Abs", g.x(0)), g.const(g.attr("lambd")))
    g.set_dx(0, _mask(g, out, g.dy(0)))
