"""Gradient rules of the elementwise ops (same names and order as engine/kernels/elementwise.py)."""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from onnxtrain.autodiff.context import GradCtx, RuleError
from onnxtrain.autodiff.registry import gradient, no_gradient

# Piecewise-constant float ops have a zero gradient almost everywhere (torch returns zeros): stopping
# the gradient there gives the same numbers without emitting zero tensors.
no_gradient("Sign", "Floor", "Ceil", "Round")
no_gradient("Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "Not", "And", "Or", "Xor",
            "IsNaN", "IsInf", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot")


# ---- arithmetic -------------------------------------------------------------------------------

@gradient("Add", linear=True)
def add_grad(g: GradCtx) -> None:
    for i in (0, 1):
        if g.needs_dx(i):
            g.set_dx(i, g.unbroadcast(g.dy(0), i))


@gradient("Sub", linear=True)
def sub_grad(g: GradCtx) -> None:
    # dA = dY, dB = -dY (negated after unbroadcasting, on the smaller tensor)
    if g.needs_dx(0):
        g.set_dx(0, g.unbroadcast(g.dy(0), 0))
    if g.needs_dx(1):
        g.set_dx(1, g.emit("Neg", g.unbroadcast(g.dy(0), 1)))


@gradient("Mul", uses=("x0", "x1"))
def mul_grad(g: GradCtx) -> None:
    # dA = dY·B, dB = dY·A
    for i in (0, 1):
        if g.needs_dx(i):
            g.set_dx(i, g.unbroadcast(g.emit("Mul", g.dy(0), g.x(1 - i)), i))


@gradient("Div", uses=("x1", "y0"))
def div_grad(g: GradCtx) -> None:
    # Y = A/B: dA = dY/B, dB = -dY·A/B² = -(dY/B)·Y
    da = g.emit("Div", g.dy(0), g.x(1))
    if g.needs_dx(0):
        g.set_dx(0, g.unbroadcast(da, 0))
    if g.needs_dx(1):
        g.set_dx(1, g.emit("Neg", g.unbroadcast(g.emit("Mul", da, g.y(0)), 1)))


@gradient("Pow", uses=("x0", "x1", "y0"))
def pow_grad(g: GradCtx) -> None:
    # Y = A^B: dA = B == 0 ? 0 : dY·(B·A^(B-1)) (torch's pow_backward and its order of products: the 0
    #          is selected, so an infinite or NaN dY sends 0 there, and the exponent B-1 is replaced where
    #          B == 0 so 0·0^-1 = nan cannot occur);
    #          dB = dY·(A == 0 <= B ? 0 : Y·log(A)) (torch's mask, inside the product as torch has it:
    #          dY = inf there gives NaN, and a NaN B is not >= 0), and 0 where A < 0 (log undefined; torch
    #          gives nan); A == 0 > B gives Y·log(0) = inf·(−inf) = −inf·dY, as torch
    a, b = g.x(0), g.x(1)
    ta, tb = g.elem_type(a) or g.dtype, g.elem_type(b) or g.dtype
    bf = b if tb == ta else g.emit("Cast", b, to=ta)  # B may be an integer or another float type
    zero, one = g.const(0), g.const(1)
    if g.needs_dx(0):
        c = _fixed_exponent(g, b)
        if c == 1:  # dY·1·A⁰ = dY, A⁰ being 1 for every A
            g.set_dx(0, g.unbroadcast(g.dy(0), 0))
        elif c == 2:  # A¹ is A: a square's gradient is dY·(2·A), one product fewer than dY·(2·A¹)
            g.set_dx(0, g.unbroadcast(g.emit("Mul", g.dy(0), g.emit("Mul", g.const(2.0, ta), a)), 0))
        elif c == 0.5:  # Y is √A (the engine's, numpy's and torch's x.pow(0.5)): dY·(0.5·Y^−1), torch's
            # 0.5·rsqrt(A) to the bit, with its −inf at −0 and NaN at −inf (A^−0.5 is +inf and 0 there)
            factor = g.emit("Mul", g.const(0.5, ta), g.emit("Pow", g.y(0), g.const(-1.0, ta)))
            g.set_dx(0, g.unbroadcast(g.emit("Mul", g.dy(0), factor), 0))
        elif c is not None:
            factor = g.emit("Mul", g.const(c, ta), g.emit("Pow", a, g.const(c - 1, ta)))
            g.set_dx(0, g.unbroadcast(g.emit("Mul", g.dy(0), factor), 0))
        else:
            b_zero = g.emit("Equal", bf, zero)
            e = g.emit("Sub", g.emit("Where", b_zero, one, bf), one)
            da = g.emit("Mul", g.dy(0), g.emit("Mul", bf, g.emit("Pow", a, e)))
            g.set_dx(0, g.unbroadcast(g.emit("Where", b_zero, zero, da), 0))
    if g.needs_dx(1):
        log_a = g.emit("Log", g.emit("Where", g.emit("Less", a, zero), one, a))
        flat = g.emit("And", g.emit("Equal", a, zero), g.emit("GreaterOrEqual", bf, zero))
        t = g.emit("Mul", g.dy(0), g.emit("Where", flat, zero, g.emit("Mul", g.y(0), log_a)))
        db = g.unbroadcast(t, 1)
        g.set_dx(1, db if tb == ta else g.emit("Cast", db, to=tb))


def _fixed_exponent(g: GradCtx, b: str) -> float | None:
    """A Pow's exponent when it is one fixed element, an integer or half-integer of magnitude ≤ 64 other
    than 0 (exact in every float type, so the gradient's B − 1 can be a constant), else None."""
    if g.varies(b):
        return None
    v = g.constant_value(b)
    if v is None or np.size(v) != 1:
        return None
    c = float(np.asarray(v).reshape(-1)[0])
    return c if c != 0 and abs(c) <= 64 and (2 * c).is_integer() else None


@gradient("Mod", uses=("x0", "x1", "y0"))
def mod_grad(g: GradCtx) -> None:
    # Float Mod (fmod=1): Y = A - B·trunc(A/B), so dA = dY and dB = -dY·trunc(A/B) with
    # trunc(A/B) = Round((A - Y)/B) (exact integers, no Trunc op in ONNX).
    if g.needs_dx(0):
        g.set_dx(0, g.unbroadcast(g.dy(0), 0))
    if g.needs_dx(1):
        ratio = g.emit("Div", g.emit("Sub", g.x(0), g.y(0)), g.x(1))
        if g.dtype == TensorProto.BFLOAT16 and g.opset < 22:  # Round takes bfloat16 from opset 22
            q = g.emit("Cast", g.emit("Round", g.emit("Cast", ratio, to=TensorProto.FLOAT)), to=g.dtype)
        else:
            q = g.emit("Round", ratio)
        g.set_dx(1, g.emit("Neg", g.unbroadcast(g.emit("Mul", g.dy(0), q), 1)))


@gradient("Neg", linear=True)
def neg_grad(g: GradCtx) -> None:
    g.set_dx(0, g.emit("Neg", g.dy(0)))


@gradient("Abs", uses=("x0",))
def abs_grad(g: GradCtx) -> None:
    # dX = dY·sgn(X) with torch's sgn, 0 at X == ±0 and at a NaN X: there dY·0, a zero of dY's sign for a
    # finite dY (so a NaN masked out downstream, dY = 0, sends no NaN back) and NaN for an infinite one
    # (sqrt(|x|) at 0)
    g.set_dx(0, g.emit("Mul", g.dy(0), g.sgn(g.x(0))))


@gradient("Reciprocal", uses=("y0",))
def reciprocal_grad(g: GradCtx) -> None:
    # Y = 1/X: dX = -dY·Y²
    g.set_dx(0, g.emit("Neg", g.emit("Mul", g.dy(0), g.emit("Mul", g.y(0), g.y(0)))))


@gradient("Sum", linear=True)
def sum_grad(g: GradCtx) -> None:
    for i in range(g.n_inputs):
        if g.needs_dx(i):
            g.set_dx(i, g.unbroadcast(g.dy(0), i))


@gradient("Mean", linear=True)
def mean_grad(g: GradCtx) -> None:
    # Y = (X0 + … + Xn-1)/n: dXi = dY/n, unbroadcast
    n = g.n_inputs
    dy = g.dy(0) if n == 1 else g.emit("Mul", g.dy(0), g.const(1.0 / n))
    for i in range(n):
        if g.needs_dx(i):
            g.set_dx(i, g.unbroadcast(dy, i))


_SAME_VALUES = ("Cast", "CastLike", "Identity", "Expand", "Reshape", "Squeeze", "Unsqueeze")


def _fixed_value(g: GradCtx, name: str) -> np.ndarray | None:
    """The value of ``name`` when it is a constant of the graph, directly or read through ops that keep
    a constant's values (torch's dynamo exporter writes a clamp's scalar bound as CastLike(Constant, x),
    and the floor of binary_cross_entropy's logs as Expand(CastLike(Constant, p), [])), else None."""
    if g.varies(name):  # an initializer being trained (build_gradient_model's wrt) is no bound
        return None
    for _ in range(8):
        v = g.constant_value(name)
        if v is not None:
            return np.asarray(v)
        node = g.producer(name)
        if node is None or node.op_type not in _SAME_VALUES:
            return None
        name = node.input[0]
    return None


def _extremum_grad(g: GradCtx) -> None:
    # Max/Min: dY goes to the inputs equal to Y; ties between inputs that vary split it evenly
    # (torch.maximum/minimum), dXi = unbroadcast([Xi == Y] ? dY / Σj [Xj == Y] : 0). A constant input is a
    # bound, as in Max(x, c) ≡ Clip(x, c), which torch's dynamo exporter writes for x.clamp(lo, hi): it
    # takes no share, so x at the bound gets all of dY, as torch.clamp (and onnxtrain's Clip) give.
    # The inputs not taken are selected to 0, not multiplied by it, as torch's masks: an infinite or NaN
    # dY sends them 0, not NaN. Where Y is NaN (a NaN input), every input that varies gets all of dY, as
    # torch.maximum/minimum give both (neither is below the other), so a NaN masked out downstream (dY = 0)
    # sends 0; with one varying input (a clamp) a NaN gets 0, as torch.clamp gives.
    n = g.n_inputs
    if n == 1:
        g.set_dx(0, g.dy(0))
        return
    live = [i for i in range(n) if _fixed_value(g, g.node.input[i]) is None]
    y = g.y(0)
    masks = {i: g.emit("Equal", g.x(i), y) for i in live}
    if len(live) == 1:
        share = g.dy(0)  # Max(x, c): dX = [X == Y] ? dY : 0, no count
    else:
        # a count of 0 where a constant alone attains Y, or where Y is NaN (every mask false there): no
        # division by 0; at a NaN Y every varying input takes dY
        count = g.emit("Max", g.emit("Sum", *(g.emit("Cast", m, to=g.dtype) for m in masks.values())),
                       g.const(1))
        share = g.emit("Div", g.dy(0), count)
        nan_y = g.emit("IsNaN", y)
        masks = {i: g.emit("Or", m, nan_y) for i, m in masks.items()}
    for i in live:
        if g.needs_dx(i):
            g.set_dx(i, g.unbroadcast(g.emit("Where", masks[i], share, g.const(0)), i))


gradient("Max", uses=("x*", "y0"))(_extremum_grad)
gradient("Min", uses=("x*", "y0"))(_extremum_grad)


@gradient("Where", uses=("x0",), stop=(0,))
def where_grad(g: GradCtx) -> None:
    # Y = C ? A : B: dA = C ? dY : 0, dB = C ? 0 : dY (each unbroadcast); C gets none
    zero = g.const(0)
    if g.needs_dx(1):
        g.set_dx(1, g.unbroadcast(g.emit("Where", g.x(0), g.dy(0), zero), 1))
    if g.needs_dx(2):
        g.set_dx(2, g.unbroadcast(g.emit("Where", g.x(0), zero, g.dy(0)), 2))


# ---- casts and copies ---------------------------------------------------------------------------

# how torch's ``.to()`` converts to each float8 type, as Cast attributes (the defaults elsewhere):
# float8e4m3fn saturates to ±448 (as Cast's default), float8e5m2 and the fnuz types overflow to inf or NaN,
# and float8e8m0 rounds to the nearest power of two (ties up) where Cast's default rounds up; its zero and
# tiny values become its smallest, as with Cast's default saturate (only beyond its largest, 2^127, torch
# gives NaN where Cast saturates). float4e2m1 has no such choice.
_TORCH_CASTS: dict[int, dict[str, object]] = {
    TensorProto.FLOAT8E5M2: {"saturate": 0},
    TensorProto.FLOAT8E4M3FNUZ: {"saturate": 0},
    TensorProto.FLOAT8E5M2FNUZ: {"saturate": 0},
}
_E8M0 = getattr(TensorProto, "FLOAT8E8M0", None)
if _E8M0 is not None:
    _TORCH_CASTS[_E8M0] = {"round_mode": "nearest"}
_WIDE_FLOATS = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16)


def _cast_back(g: GradCtx) -> None:
    # float -> float: cast dY back to the input's type (no node when the cast was a no-op), straight through
    # as torch's x.to(dtype), whose backward is grad.to(x.dtype): a float8/float4 input gets dY rounded
    # through its type as torch rounds it. Casts to integer/bool outputs never get here: the builder stops
    # the gradient at non-float values.
    x = g.node.input[0]
    tx = g.elem_type(x)
    if tx == TensorProto.UNDEFINED:
        raise RuleError(f"the element type of {x!r} is unknown; cannot cast its gradient back")
    ty = g.elem_type(g.node.output[0])
    if tx == ty:
        g.set_dx(0, g.dy(0))
        return
    dy = g.dy(0)
    if tx == _E8M0 and ty in _WIDE_FLOATS:  # float8e8m0 has no sign: torch keeps the magnitude, where
        dy = g.emit("Abs", dy)  # ONNX leaves the cast of a negative undefined
    g.set_dx(0, g.emit("Cast", dy, to=tx, **_TORCH_CASTS.get(tx, {})))


gradient("Cast", linear=True)(_cast_back)
gradient("CastLike", linear=True, stop=(1,))(_cast_back)
# the same bits read as another type: no derivative, even between two float types (float16 and bfloat16)
no_gradient("BitCast")


@gradient("Identity", linear=True)
def identity_grad(g: GradCtx) -> None:
    g.set_dx(0, g.dy(0))


# ---- exponentials and logarithms ----------------------------------------------------------------

@gradient("Exp", uses=("y0",))
def exp_grad(g: GradCtx) -> None:
    g.set_dx(0, g.emit("Mul", g.dy(0), g.y(0)))


def _log_floor(g: GradCtx) -> float | None:
    """When every reader of the Log's output clamps it from below by a finite constant c (Max(log X, c) or
    Clip(log X, c, …): torch's binary_cross_entropy as its dynamo exporter writes it, c = −100), a floor
    for X in dY / X: where log X < c, dY is 0, and 0 / 0 = nan must not stand for X = 0 (a sigmoid
    saturated to 0 or 1). The floor is e^c, raised to the smallest X whose 1/X is finite."""
    y = g.node.output[0]
    if g.is_graph_output(y):
        return None
    bounds = []
    for n in g.readers(y):
        if n.op_type == "Max" and len(n.input) == 2:
            other = n.input[1] if n.input[0] == y else n.input[0]
        elif n.op_type == "Clip" and n.input[0] == y and len(n.input) > 1 and n.input[1]:
            other = n.input[1]
        else:
            return None
        v = None if other == y else _fixed_value(g, other)
        if v is None or v.size != 1 or not np.isfinite(v.reshape(-1)[0]):
            return None
        bounds.append(float(v.reshape(-1)[0]))
    top = {TensorProto.DOUBLE: 1.7e308, TensorProto.FLOAT16: 65504.0}.get(g.dtype, 3.4e38)  # bfloat16 ≈ float
    if not bounds or min(bounds) > math.log(top):
        return None
    return max(math.exp(min(bounds)), 1.0 / top)


@gradient("Log", uses=("x0",))
def log_grad(g: GradCtx) -> None:
    # dX = dY / X (X floored where the log is clamped from below: see _log_floor; one Max there)
    floor = _log_floor(g)
    x = g.x(0) if floor is None else g.emit("Max", g.x(0), g.const(floor))
    g.set_dx(0, g.emit("Div", g.dy(0), x))


@gradient("Sqrt", uses=("y0",))
def sqrt_grad(g: GradCtx) -> None:
    # dX = dY / (2·Y)
    g.set_dx(0, g.emit("Div", g.emit("Mul", g.dy(0), g.const(0.5)), g.y(0)))


@gradient("Erf", uses=("x0",))
def erf_grad(g: GradCtx) -> None:
    # dX = dY·(2/√π)·exp(-X²)
    x = g.x(0)
    e = g.emit("Exp", g.emit("Neg", g.emit("Mul", x, x)))
    g.set_dx(0, g.emit("Mul", g.dy(0), g.emit("Mul", e, g.const(2.0 / math.sqrt(math.pi)))))


# ---- trigonometric and hyperbolic ---------------------------------------------------------------

def _one_minus_sq(g: GradCtx, v: str) -> str:
    return g.emit("Sub", g.const(1), g.emit("Mul", v, v))


def _one_plus_sq(g: GradCtx, v: str) -> str:
    return g.emit("Add", g.emit("Mul", v, v), g.const(1))


@gradient("Sin", uses=("x0",))
def sin_grad(g: GradCtx) -> None:
    g.set_dx(0, g.emit("Mul", g.dy(0), g.emit("Cos", g.x(0))))


@gradient("Cos", uses=("x0",))
def cos_grad(g: GradCtx) -> None:
    # dX = -dY·sin(X)
    g.set_dx(0, g.emit("Neg", g.emit("Mul", g.dy(0), g.emit("Sin", g.x(0)))))


@gradient("Tan", uses=("y0",))
def tan_grad(g: GradCtx) -> None:
    # dX = dY·(1 + Y²)
    g.set_dx(0, g.emit("Mul", g.dy(0), _one_plus_sq(g, g.y(0))))


@gradient("Asin", uses=("x0",))
def asin_grad(g: GradCtx) -> None:
    # dX = dY / √(1 - X²)
    g.set_dx(0, g.emit("Div", g.dy(0), g.emit("Sqrt", _one_minus_sq(g, g.x(0)))))


@gradient("Acos", uses=("x0",))
def acos_grad(g: GradCtx) -> None:
    # dX = -dY / √(1 - X²)
    g.set_dx(0, g.emit("Neg", g.emit("Div", g.dy(0), g.emit("Sqrt", _one_minus_sq(g, g.x(0))))))


@gradient("Atan", uses=("x0",))
def atan_grad(g: GradCtx) -> None:
    # dX = dY / (1 + X²)
    g.set_dx(0, g.emit("Div", g.dy(0), _one_plus_sq(g, g.x(0))))


@gradient("Sinh", uses=("x0",))
def sinh_grad(g: GradCtx) -> None:
    g.set_dx(0, g.emit("Mul", g.dy(0), g.emit("Cosh", g.x(0))))


@gradient("Cosh", uses=("x0",))
def cosh_grad(g: GradCtx) -> None:
    g.set_dx(0, g.emit("Mul", g.dy(0), g.emit("Sinh", g.x(0))))


@gradient("Asinh", uses=("x0",))
def asinh_grad(g: GradCtx) -> None:
    # dX = dY / √(X² + 1)
    g.set_dx(0, g.emit("Div", g.dy(0), g.emit("Sqrt", _one_plus_sq(g, g.x(0)))))


@gradient("Acosh", uses=("x0",))
def acosh_grad(g: GradCtx) -> None:
    # dX = dY / √(X² - 1)
    x = g.x(0)
    g.set_dx(0, g.emit("Div", g.dy(0), g.emit("Sqrt", g.emit("Sub", g.emit("Mul", x, x), g.const(1)))))


@gradient("Atanh", uses=("x0",))
def atanh_grad(g: GradCtx) -> None:
    # dX = dY / (1 - X²)
    g.set_dx(0, g.emit("Div", g.dy(0), _one_minus_sq(g, g.x(0))))
