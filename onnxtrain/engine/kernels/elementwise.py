"""Elementwise kernels: arithmetic, unary math, Erf, comparison, logic, bitwise, variadic, Where, Cast,
BitCast.

Most ops are one numpy ufunc and are registered from tables; the rest are written out below.
Results go through ``_arr`` because ufuncs return numpy scalars for 0-d inputs.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from onnx import TensorProto, helper

from onnxtrain.engine.kernels import buffering, half_cast
from onnxtrain.engine.kernels.clamp import clip_ufunc
from onnxtrain.engine.kernels.half import F32, is_half
from onnxtrain.engine.kernels.spread import MIN_VALUES as MIN_SPREAD
from onnxtrain.engine.kernels.spread import spread, spread_shape
from onnxtrain.engine.parallel import for_rows, width
from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel


def _arr(r: Any) -> np.ndarray:
    return r if type(r) is np.ndarray else np.asarray(r)


def _is_float(dt: np.dtype) -> bool:
    """True for numpy floats and the ml_dtypes ones (bfloat16, float8, float4)."""
    return dt.kind == "f" or dt.name.startswith(("bfloat", "float"))


# --- one-ufunc ops ---------------------------------------------------------------------------------

_DIVIDES_ONE = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64))


def reciprocal(x: Any, out: np.ndarray | None = None) -> Any:
    """1 / x with a ufunc's signature: numpy's divide of the type's one for its own floats (the same bits
    as ``np.reciprocal``, every float16 and 200 M float32 bit patterns checked, whose float loops numpy 2.4
    does not vectorise: 614 K float32 values 126 → 64 µs), ``np.reciprocal`` for any other type."""
    dt = x.dtype
    if dt in _DIVIDES_ONE:
        return np.divide(dt.type(1), x, out=out)
    return np.reciprocal(x, out=out)


_BINARY: list[tuple[str, int, Callable[..., Any]]] = [
    ("Add", 7, np.add), ("Sub", 7, np.subtract), ("Mul", 7, np.multiply),
    ("Equal", 7, np.equal), ("Greater", 7, np.greater), ("Less", 7, np.less),
    ("GreaterOrEqual", 12, np.greater_equal), ("LessOrEqual", 12, np.less_equal),
    ("And", 7, np.logical_and), ("Or", 7, np.logical_or), ("Xor", 7, np.logical_xor),
    ("BitwiseAnd", 18, np.bitwise_and), ("BitwiseOr", 18, np.bitwise_or), ("BitwiseXor", 18, np.bitwise_xor),
]

_UNARY: list[tuple[str, int, Callable[..., Any]]] = [
    ("Neg", 6, np.negative), ("Abs", 6, np.absolute), ("Exp", 6, np.exp), ("Sign", 9, np.sign),
    ("Floor", 6, np.floor), ("Ceil", 6, np.ceil), ("Round", 11, np.rint),  # rint: half to even
    ("Sin", 7, np.sin), ("Cos", 7, np.cos), ("Tan", 7, np.tan), ("Atan", 7, np.arctan),
    ("Sinh", 9, np.sinh), ("Cosh", 9, np.cosh), ("Asinh", 9, np.arcsinh),
    ("Not", 1, np.logical_not), ("IsNaN", 9, np.isnan), ("BitwiseNot", 18, np.invert),
]

# ops whose domain errors (log(0), sqrt(-1), 1/0) are expected and must not warn
_UNARY_QUIET: list[tuple[str, int, Callable[..., Any]]] = [
    ("Log", 6, np.log), ("Sqrt", 6, np.sqrt), ("Reciprocal", 6, reciprocal),
    ("Asin", 7, np.arcsin), ("Acos", 7, np.arccos), ("Acosh", 9, np.arccosh), ("Atanh", 9, np.arctanh),
]


# numpy's float16 comparisons convert each operand (4.7 ms for 1 M values against a scalar): compared as
# float32 arrays instead, which order every float16 alike (NaN unordered in both)
_COMPARISONS = frozenset({np.equal, np.greater, np.less, np.greater_equal, np.less_equal})


def _both_half(a: Any, b: Any) -> bool:
    """Two float16 arrays: a :data:`~onnxtrain.engine.kernels.half_cast.ROUNDED_ONCE` op or a comparison takes
    them through float32."""
    return type(a) is np.ndarray and type(b) is np.ndarray and a.dtype == half_cast.HALF == b.dtype


def spread_operands(a: Any, b: Any) -> tuple[Any, Any]:
    """``a`` and ``b``, the one broadcast over small planes of the other copied out over them
    (:mod:`onnxtrain.engine.kernels.spread`; the same values)."""
    if type(a) is not np.ndarray or type(b) is not np.ndarray or a.shape == b.shape:
        return a, b
    big, small = (a, b) if a.size >= b.size else (b, a)
    shape = spread_shape(small.shape, big.shape)
    if shape is None or np.broadcast_shapes(a.shape, b.shape) != big.shape:
        return a, b
    wide = spread(small, shape)
    return (a, wide) if big is a else (wide, b)


# operands whose sizes multiply to fewer values make a result below both spread.MIN_VALUES and
# buffering.MIN_VALUES (a broadcast result has at most that many values)
SMALL_OPERANDS = min(MIN_SPREAD, buffering.MIN_VALUES)


def _binary(fn: Callable[..., Any]) -> Callable[[Inputs, Attrs], Outputs]:
    half = half_cast.ViaSingle(fn) if fn in half_cast.ROUNDED_ONCE else None
    compares = fn in _COMPARISONS
    halves = half is not None or compares  # two float16 operands go through float32

    def run(inputs: Inputs, attrs: Attrs) -> Outputs:
        a, b = inputs[0], inputs[1]
        if (type(a) is np.ndarray and type(b) is np.ndarray and a.size * b.size < SMALL_OPERANDS
                and not (halves and a.dtype == half_cast.HALF == b.dtype)):
            # a result this small is neither spread nor buffered (below): the ufunc alone
            r = fn(a, b)
            return (r if type(r) is np.ndarray else np.asarray(r),)
        if halves and _both_half(a, b):
            a, b = inputs
            if half is not None:
                return (half(a, b),)
            if max(a.size, b.size) >= half_cast.VIA_SINGLE_MIN:  # exact: float32 holds every float16
                return (fn(half_cast.to_single(a), half_cast.to_single(b)),)
        a, b = spread_operands(inputs[0], inputs[1])
        # (a broadcast along runs numpy would copy through its buffer: buffering.py)
        r = buffering.call_with_buffer(buffering.binary_size(a, b), fn, a, b)
        return (r if type(r) is np.ndarray else np.asarray(r),)

    return run


# transcendental ufuncs: a value costs several plain ufuncs' (float32 exp about 0.33 ns here, an add 0.07), so
# a large input is split over the run's threads, each value computed by the same ufunc (the same bits).
# The bench GPT decoder's loss gradient starts with an Exp of its (1,024, 1,000) log-probabilities: 0.74-0.87
# ms of its step on one thread
_COSTLY = frozenset({"Exp", "Log", "Sin", "Cos", "Tan", "Atan", "Sinh", "Cosh", "Asinh", "Asin", "Acos",
                     "Acosh", "Atanh"})
COSTLY_WORK = 4  # one value's work, in plain ufunc values (``parallel.MIN_ROWS_WORK`` is in those)
# fewer values stay in one piece: waking a second thread costs about 100 µs on this VM. A lone float32 Exp,
# one thread against two (Plan.run alone): 131 K values 93 / 200 µs, 262 K 130 / 249, 524 K 280 / 339,
# 1 M 498 / 415
SPLIT_MIN = 3 << 18


def _split_ufunc(fn: Callable[..., Any], x: np.ndarray) -> np.ndarray:
    """``fn(x)`` for a C-contiguous float ``x``, its values split over the run's threads when many."""
    y = np.empty_like(x)
    xf, yf = x.reshape(-1), y.reshape(-1)
    for_rows(xf.size, xf.size * COSTLY_WORK, lambda lo, hi: fn(xf[lo:hi], out=yf[lo:hi]), align=64)
    return y


def _unary(fn: Callable[..., Any], quiet: bool, costly: bool = False) -> Callable[[Inputs, Attrs], Outputs]:
    def call(x: Any) -> Any:
        if (costly and type(x) is np.ndarray and x.size >= SPLIT_MIN and x.dtype.kind == "f"
                and x.flags.c_contiguous and width() > 1):
            return _split_ufunc(fn, x)
        return fn(x)

    def run(inputs: Inputs, attrs: Attrs) -> Outputs:
        r = call(inputs[0])
        return (r if type(r) is np.ndarray else np.asarray(r),)

    def run_quiet(inputs: Inputs, attrs: Attrs) -> Outputs:
        with np.errstate(divide="ignore", invalid="ignore"):
            r = call(inputs[0])
        return (r if type(r) is np.ndarray else np.asarray(r),)

    return run_quiet if quiet else run


for _op, _since, _fn in _BINARY:
    kernel(_op, since=_since)(_binary(_fn))
for _op, _since, _fn in _UNARY:
    kernel(_op, since=_since)(_unary(_fn, quiet=False, costly=_op in _COSTLY))
for _op, _since, _fn in _UNARY_QUIET:
    kernel(_op, since=_since)(_unary(_fn, quiet=True, costly=_op in _COSTLY))


# --- arithmetic with ONNX-specific rules -----------------------------------------------------------

_HALF_DIVIDE = half_cast.ViaSingle(np.divide)


@kernel("Div", since=7)
def div(inputs: Inputs, attrs: Attrs) -> Outputs:
    a, b = inputs
    if a.dtype.kind not in "iu":
        with np.errstate(divide="ignore", invalid="ignore"):
            if _both_half(a, b):
                return (_HALF_DIVIDE(a, b),)
            return (_arr(buffering.call_with_buffer(buffering.binary_size(a, b), np.divide, a, b)),)
    _nonzero_divisor(b, "division")
    with np.errstate(divide="ignore", over="ignore"):
        q = _arr(np.floor_divide(a, b))
        if a.dtype.kind == "i":  # C truncation: floor differs where the quotient is negative and inexact
            q += (q < 0) & (q * b != a)
    return (q,)


def _nonzero_divisor(b: np.ndarray, what: str) -> None:
    """An integer divisor holding 0 is an error, as in onnxruntime and torch (numpy's quotient would be 0)."""
    if not np.all(b):
        raise ZeroDivisionError(f"integer {what} by zero (the divisor holds 0)")


# float32 powers other than these are computed in float64 and rounded once: numpy's float32 pow is SIMD code
# whose results are 1 ulp off on about half of the values (exponent 1.7) and that takes a scalar path, ~40×
# slower, for negative bases; the float64 result rounds to the correctly rounded float32 (as glibc's powf
# gives, onnxruntime's kernel)
_FLOAT64_POW = (np.dtype(np.float32),)


@kernel("Pow", since=7)
def pow_(inputs: Inputs, attrs: Attrs) -> Outputs:
    a, b = inputs
    dt = a.dtype
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if _is_float(dt):
            if b.size == 1 and b.ndim <= a.ndim:  # one exponent for every element: the output has A's shape
                y = _pow_scalar(a, float(b.reshape(-1)[0]))
                if y is not None:
                    return (_arr(y),)
            if b.dtype.kind in "iub":
                b = b.astype(dt)
            if dt in _FLOAT64_POW:
                r = np.power(a.astype(np.float64), b.astype(np.float64, copy=False))
            else:
                r = np.power(a, b)  # a float16 base with a float32 exponent is computed in float32
        elif b.dtype.kind == "f":
            r = np.power(a.astype(np.float64), b)  # integer base, fractional exponent
        else:
            r = _int_power(a, b)
        r = _arr(r)
        return (r if r.dtype == dt else r.astype(dt),)  # (float32 from float64: overflow to inf, quietly)


_TOP_BIT = np.uint64(1 << 63)
_LOW_62 = np.uint64((1 << 62) - 1)
_BIT_62 = np.uint64(1 << 62)


def _int_power(a: np.ndarray, b: np.ndarray) -> Any:
    """``a ** b`` for an integer base and exponent, wrapping as integer products do; a negative exponent
    gives C's pow truncated toward zero (as onnxruntime: 0 for |a| >= 2), computed in float64 for those
    elements only."""
    if b.dtype == np.uint64 and a.dtype.kind == "i":
        # numpy takes int ** uint64 to float64: as int64 exponents instead, the same powers modulo 2^64
        # (for b >= 2^63, b mod 2^62 + 2^62: a^(2^62) is 1 for an odd a modulo 2^64, an even a's power is 0)
        big = b >= _TOP_BIT
        b = (np.where(big, (b & _LOW_62) | _BIT_62, b) if big.any() else b).astype(np.int64)
    if b.dtype.kind != "i" or not (b < 0).any():
        return np.power(a, b)
    neg = b < 0
    whole = np.power(a, np.where(neg, 0, b))
    return np.where(neg, np.power(a.astype(np.float64), b).astype(whole.dtype), whole)


def _pow_scalar(a: np.ndarray, e: float) -> np.ndarray | None:
    """``a ** e`` for a float array and one exponent. ``x¹`` is x and ``x⁰`` is 1 for every x (NaN
    included, as C's pow). Squares and (float32/float64) cubes are products, (a·a)·a, as in onnxruntime's
    and torch's kernels (the same bits). For float32: ``e`` = 0.5 is the square root and −1 the reciprocal
    (both correctly rounded, as the power is; the square root's −0 and NaN at −0 and −inf are numpy's,
    onnx.reference's and torch's); other exponents are computed in float64 (integer and half-integer ones
    up to 4 by products: :func:`_float64_products`) and rounded to float32 once, with C's signs: negative for
    a negative base (−0 and −inf included) and an odd integer exponent, NaN for a finite negative base and a
    non-integer one. None for the other dtypes' other powers."""
    if e == 1:
        return a.copy()
    if e == 0:
        return np.ones_like(a)
    if e == 2:
        return np.multiply(a, a)
    if e == 3 and a.dtype.kind == "f" and a.dtype.itemsize >= 4:  # (halves: one rounding of the float32 cube)
        y = np.multiply(a, a)
        y *= a
        return y
    if a.dtype not in _FLOAT64_POW:
        return None
    if e == 0.5:  # as numpy's and torch's power: NaN at −inf, −0 at −0 (C's pow, onnxruntime's: +inf, +0)
        return np.sqrt(a)
    if e == -1:
        return reciprocal(a)
    if math.isnan(e):
        return np.power(a.astype(np.float64), e).astype(a.dtype)
    if abs(e) <= _PRODUCT_POW_MAX and (2 * e).is_integer():
        return _float64_products(a, e)
    y = _arr(np.power(np.abs(a, dtype=np.float64), e)).astype(a.dtype)  # (an array for a 0-d base too)
    if math.isfinite(e) and e.is_integer():
        if int(e) % 2:
            np.copysign(y, a, out=y)
    elif math.isfinite(e):  # (an infinite exponent reads only |a|)
        _nan_at_finite_negatives(y, a)
    return y


# integer and half-integer float32 powers up to this magnitude are float64 products, square roots and a
# reciprocal (3 to 5 roundings at 2^-53, so the float32 rounding differs from the correctly rounded one only
# for a power within ~2^-50 of a float32 rounding boundary), 2-5× faster than numpy's float64 power
_PRODUCT_POW_MAX = 4


def _float64_products(a: np.ndarray, e: float) -> np.ndarray:
    """float32 ``a ** e`` for an integer or half-integer ``e`` with |e| ≤ ``_PRODUCT_POW_MAX``, by float64
    squarings and products (exact for the square of a float32), a square root for the half and a reciprocal
    for a negative ``e``; C's signs (a half-integer power reads |a|, NaN for a finite negative base)."""
    w = _arr(a.astype(np.float64))
    half = not e.is_integer()
    if half:
        np.abs(w, out=w)
    k = int(abs(e))
    y = _arr(np.sqrt(w)) if half else None
    sq = w
    while k:
        if k & 1:
            y = sq.copy() if y is None else np.multiply(y, sq, out=y)
        k >>= 1
        if k:
            sq = np.multiply(sq, sq, out=sq)  # (w is no longer read)
    if e < 0:
        np.divide(1.0, y, out=y)  # (numpy's reciprocal is slower for float64)
    out = y.astype(a.dtype)
    if half:
        _nan_at_finite_negatives(out, a)
    return out


def _nan_at_finite_negatives(y: np.ndarray, a: np.ndarray) -> None:
    """C's pow of a finite negative base by a non-integer exponent: NaN (``y`` was computed from |a|)."""
    neg = np.less(a, 0)
    if neg.any():
        neg &= np.isfinite(a)
        y[neg] = np.nan


@kernel("Mod", since=10)
def mod(inputs: Inputs, attrs: Attrs) -> Outputs:
    if inputs[1].dtype.kind in "iu":
        _nonzero_divisor(inputs[1], "modulo")
    with np.errstate(divide="ignore", invalid="ignore"):
        # fmod=1: sign of the dividend (C fmod); fmod=0: sign of the divisor (Python %)
        r = np.fmod(inputs[0], inputs[1]) if attrs["fmod"] else np.mod(inputs[0], inputs[1])
    return (_arr(r),)


@kernel("BitShift", since=11)
def bit_shift(inputs: Inputs, attrs: Attrs) -> Outputs:
    # numpy defines shifts by >= the bit width (and by negative amounts) as 0, or -1 for a negative
    # signed right operand, which is what ONNX asks for
    x, y = inputs
    if attrs["direction"] == "LEFT":
        return (_arr(np.left_shift(x, y)),)
    if attrs["direction"] == "RIGHT":
        return (_arr(np.right_shift(x, y)),)
    raise ValueError(f"BitShift direction must be LEFT or RIGHT, got {attrs['direction']!r}")


@kernel("IsInf", since=10)
def is_inf(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    pos, neg = attrs["detect_positive"], attrs["detect_negative"]
    if pos and neg:
        return (_arr(np.isinf(x)),)
    if pos:
        return (_arr(x == np.inf),)
    if neg:
        return (_arr(x == -np.inf),)
    return (np.zeros(x.shape, dtype=bool),)


# --- Erf -------------------------------------------------------------------------------------------
# erf(x) = x * h(x) with h = erf(x)/x. On each interval [k/2, (k+1)/2), k = 0..11, h is a degree-14
# polynomial in t = 4|x| - 2k - 1 (t in [-1, 1]): the interpolant of h at 16 Chebyshev nodes,
# computed in 50-digit arithmetic, truncated after the t**14 term and written in powers of t.
# Max error against 30-digit erf: 2-3 ulp in float64 (float32: below). erf(x) rounds to 1 for |x| >= 6.
_ERF_F64 = np.array([
    (1.1053055606729478, -0.04529143129683348, -0.02095945178917365, 0.0016362775557547565,
     0.00034779836999790907, -3.5090751263555324e-05, -4.491922887627653e-06, 5.453691636430639e-07,
     4.642083071011616e-08, -6.6785277643755584e-09, -3.936764055451655e-10, 6.756363828275984e-11,
     2.78023920320869e-12, -5.669830858742054e-13, -1.6081014349248233e-14),
    (0.9482075115380202, -0.10175881411427096, -0.0062635871199434754, 0.0026459622597687473,
     -9.715945459669306e-05, -3.693998540580371e-05, 3.5657667713237644e-06, 3.116743598995832e-07,
     -5.7061448498058504e-08, -1.1631438152371147e-09, 6.242624109526315e-10, -9.715023953263355e-12,
     -5.194749813345989e-12, 2.178440658212735e-13, 3.34789244066726e-14),
    (0.7383201026051666, -0.10035979603157516, 0.005289389053359358, 0.0010363196276635014,
     -0.00022651206375271058, 8.442228059403752e-06, 2.471959263930585e-06, -3.1734192139652544e-07,
     -6.083350380979353e-09, 3.895004848533757e-09, -1.735985005365012e-10, -2.7072338698103384e-11,
     2.898206320880213e-12, 8.728146488097364e-14, -2.5476848525289295e-14),
    (0.5638123835538186, -0.07300534108909545, 0.007130897195664952, -0.0002137238430056611,
     -7.683902651741935e-05, 1.4673634072026357e-05, -8.458086204320319e-07, -9.048267939958872e-08,
     1.929163886901349e-08, -8.067849495775068e-10, -1.2602507399236845e-10, 1.7259129333018486e-11,
     -1.2645199744205712e-13, -1.3108590879625762e-13, 8.77673907448e-15),
    (0.4437943481836973, -0.04851689212907548, 0.0049443708532433735, -0.0003985095830550056,
     1.114796819195439e-05, 3.387065671968469e-06, -6.914835415746196e-07, 5.864422309371388e-08,
     2.6222576805939485e-10, -6.553930970054966e-10, 6.7961241215922e-11, -6.472252341590077e-13,
     -5.290470575416879e-13, 4.856657174895254e-14, 2.1038059887339958e-16),
    (0.36359977384650194, -0.03300122696358256, 0.002963469214200507, -0.0002537222654667168,
     1.8437658139544155e-05, -6.975255928752284e-07, -8.372347270308964e-08, 2.1949846685194278e-08,
     -2.4893347278967555e-09, 1.2750558124098918e-10, 7.481064186651205e-12, -2.0543319956147474e-12,
     1.6349172729417112e-13, 1.115291111783491e-16, -1.2157361829231525e-15),
    (0.307690983760165, -0.023666291902675496, 0.0018186596784270257, -0.00013895550549463553,
     1.034445073786842e-05, -7.014369481394335e-07, 3.4160376402039785e-08, 5.647256821024986e-10,
     -4.267770390214387e-10, 6.324544258206648e-11, -5.548422768005476e-12, 2.166993265386679e-13,
     1.8268800726912683e-14, -3.9333184551862446e-15, 2.987797969370362e-16),
    (0.26666663633939824, -0.0177777169938138, 0.0011851260434089681, -7.897519616033776e-05,
     5.250595119149643e-06, -3.452555665393051e-07, 2.1762303300239885e-08, -1.1859227060113699e-09,
     3.378063985490545e-11, 3.9622114378424075e-12, -9.262022102546553e-13, 1.1106922309925776e-13,
     -8.838461767206285e-15, 3.4331327294336296e-16, 1.9914110200542385e-17),
    (0.23529411721162963, -0.013840829474566817, 0.0008141654306807936, -4.789138923394449e-05,
     2.8167923857565644e-06, -1.6555873266842834e-07, 9.696761387657563e-09, -5.596594883098143e-10,
     3.0631134812483284e-11, -1.3916316056919121e-12, 2.0138383140175633e-14, 6.541012142328425e-15,
     -1.1690326765886228e-15, 1.3070882886530005e-16, -1.0222050546315633e-17),
    (0.2105263157855821, -0.011080332400328343, 0.0005831753782819923, -3.069343228508837e-05,
     1.6154388859575669e-06, -8.50209256595549e-08, 4.4740071525112036e-09, -2.352423032059641e-10,
     1.2322795932333846e-11, -6.359789821037001e-13, 3.1131361589213574e-14, -1.2623274176847457e-15,
     1.4070362627165727e-17, 5.8907685609926724e-18, -9.5195323711678e-19),
    (0.19047619047616893, -0.00907029478452193, 0.0004319187991874236, -2.0567561801181823e-05,
     9.794076638102137e-07, -4.6638439868866216e-08, 2.220869885709463e-09, -1.0575293488699288e-10,
     5.0350537026581576e-12, -2.3956472914127014e-13, 1.1364308045918707e-14, -5.328263622767813e-16,
     2.3961515381472337e-17, -9.192102354214756e-19, 1.4318767706876083e-20),
    (0.1739130434782608, -0.007561436672967646, 0.00032875811621567593, -1.4293831139520677e-05,
     6.214709189066377e-07, -2.7020474623833435e-08, 1.1748031945955862e-09, -5.1078380916982275e-11,
     2.2207930656960914e-12, -9.655450155539413e-14, 4.197594810734931e-15, -1.8240705284707888e-16,
     7.912308897479793e-18, -3.42810041696249e-19, 1.435495003341155e-20),
])


# float32 is table-driven. Bits 31..15 of a float32's pattern (sign, exponent, top 8 mantissa bits) name a
# slot; clearing bits 14..0 gives the slot's start x0, so d = x0 - x is exact, and |d| < |x0|/256 for
# normal x. As erf'' = -2x erf', the quadratic term comes free: erf(x0 + u) = erf(x0) + erf'(x0) (u - x0 u^2)
# + O(u^3). So a slot keeps two numbers, a and b, and erf(x) ~ a - b*d*(1 + x0*d). They are fitted when
# first needed, from the float64 erf: per slot, a and b make the O(u^3) rest equioscillate at u = 0,
# h/sqrt(3) and h (h the slot width; a closed form in erf at those points), then are rounded to float32. The
# negative half of the table mirrors the positive one (a -> -a), so the sign costs nothing; x is clipped
# to [-4, 4] (erf(4) rounds to 1, and inf gets a finite d). -0.0 stays -0.0: d = +0 and a = -0.0 there.
# Max error over all 2^32 inputs against the float64 erf: 1.25 ulp (tools/fit_erf32.py checks it); it is
# mostly the float32 rounding of a and of the result. A single odd rational x*P(x^2)/Q(x^2), the usual
# gather-free alternative, measured ~7 ulp here: near erf = 1 every rounding in its Horner steps counts.
_ERF32_SHIFT = 15
_ERF32_LOW = np.uint32(0xFFFFFFFF >> _ERF32_SHIFT << _ERF32_SHIFT)  # keeps the slot's bits
_ERF32_NEG = 1 << (31 - _ERF32_SHIFT)  # slot offset of the sign bit
_ERF32_BLOCK = 1 << 17  # elements per block: few calls, for a split run's threads share one GIL (measured
# on 1 M elements over two threads: 1.13 ms at 2^16, 0.95 ms at 2^17; one thread: the same at both)
_ERF32_TABLES: list[tuple[np.ndarray, np.ndarray]] = []  # [(a, b)], filled on first use (about 0.8 MB)
_F32_FOUR, _F32_MINUS_FOUR, _F32_ONE = np.float32(4), np.float32(-4), np.float32(1)
_scratch = threading.local()  # each thread's erf scratch, kept: allocating it per call made a split run
# slower than a serial one (fresh pages and unmaps, one thread's cost paid by both)


def _erf32_tables() -> tuple[np.ndarray, np.ndarray]:
    if _ERF32_TABLES:
        return _ERF32_TABLES[0]
    top = int(_F32_FOUR.view(np.uint32)) >> _ERF32_SHIFT  # the slot of 4.0
    i = np.arange(top + 1, dtype=np.uint32) << _ERF32_SHIFT
    edges = i.view(np.float32).astype(np.float64)
    x0, h = edges[:-1], np.diff(edges)
    u = h / np.sqrt(3)
    e0, e1, e2 = erf(x0), erf(x0 + u), erf(x0 + h)
    b = (e2 - e0) / (h - x0 * h * h)
    a = (e0 + e1 - b * (u - x0 * u * u)) / 2
    size = _ERF32_NEG + top + 1  # slots between the halves only ever see NaN, which stays NaN
    ta, tb = np.zeros(size, np.float32), np.zeros(size, np.float32)
    ta[:top], tb[:top] = a, b
    ta[0] = 0.0  # a rounds to +-0 in the slot of +0.0; keep it +0.0 exactly
    ta[top] = 1.0  # x clipped to 4
    ta[_ERF32_NEG:], tb[_ERF32_NEG:] = -ta[:top + 1], tb[:top + 1]
    ta.flags.writeable = tb.flags.writeable = False
    _ERF32_TABLES.append((ta, tb))
    return ta, tb


def _erf32_block(x: np.ndarray, out: np.ndarray, d: np.ndarray, a: np.ndarray, idx: np.ndarray,
                 ta: np.ndarray, tb: np.ndarray) -> None:
    """erf of the 1-d float32 block ``x`` into ``out``; d, a (float32) and idx (intp) are scratch."""
    clip_ufunc(x, _F32_MINUS_FOUR, _F32_FOUR, out=d)  # NaN stays NaN (clip beat min/max against arrays here)
    bits = d.view(np.uint32)
    np.right_shift(bits, _ERF32_SHIFT, out=idx)
    # mode="wrap" is the fastest take here; only a negative NaN's slot is past the end, and it stays NaN.
    # The array methods, not np.take: numpy's Python wrappers cost more than the call itself on a block
    tb.take(idx, out=out, mode="wrap")
    ta.take(idx, out=a, mode="wrap")
    t = idx.view(np.float32)[:d.size]  # the indices are spent: their memory holds t
    np.bitwise_and(bits, _ERF32_LOW, out=t.view(np.uint32))  # t = x0
    np.subtract(t, d, out=d)  # d = x0 - x, exact
    t *= d
    t += _F32_ONE
    t *= d
    out *= t
    np.subtract(a, out, out=out)


def _erf32(x: np.ndarray, into: np.ndarray | None = None) -> np.ndarray:
    """erf of float32 ``x``, into the C-contiguous float32 array ``into`` when given (it may be ``x``)."""
    ta, tb = _erf32_tables()
    flat = x.reshape(-1)
    out = np.empty(flat.shape, np.float32) if into is None else into.reshape(-1)
    n = min(flat.size, _ERF32_BLOCK)
    kept = getattr(_scratch, "erf32", None)
    if kept is None or kept[1].size < n:
        kept = _scratch.erf32 = (np.empty((2, n), np.float32), np.empty(n, np.intp))
    scratch, idx = kept
    for i in range(0, flat.size, _ERF32_BLOCK):
        j = min(i + _ERF32_BLOCK, flat.size)
        _erf32_block(flat[i:j], out[i:j], *scratch[:, :j - i], idx[:j - i], ta, tb)
    return out.reshape(x.shape) if into is None else into


def erf_into(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """erf with a ufunc's signature: into ``out`` (same shape and dtype as ``x``, may be ``x``) when given."""
    if out is None:
        return erf(x)
    if x.dtype == out.dtype == np.float32 and out.flags.c_contiguous and x.shape == out.shape:
        return _erf32(x, out)
    np.copyto(out, erf(x))
    return out


_ERF_T = {np.dtype(np.float64): _ERF_F64.T.copy()}
# float64: |x| cap, last interval index + 1/2, 2, 4, 1, and 2k + 1 for k = 0..11 (0-d arrays keep the dtype)
_ERF_K = {d: (np.array(6, d), np.array(11.5, d), np.array(2, d), np.array(4, d), np.array(1, d),
              (2 * np.arange(12) + 1).astype(d)) for d in _ERF_T}
_ERF_CHUNK = 8192  # elements per block: the gathered coefficients of a block stay in cache


def _erf_block(x: np.ndarray, table: np.ndarray, cap: np.ndarray, top: np.ndarray, two: np.ndarray,
               four: np.ndarray, one: np.ndarray, offset: np.ndarray) -> np.ndarray:
    a = np.minimum(np.abs(x), cap)
    idx = np.fmin(a * two, top).astype(np.intp)  # fmin: a NaN gets a valid interval (and stays NaN)
    t = a * four - offset.take(idx)
    c = table.take(idx, axis=1)  # row j: the t**j coefficient of each element's interval
    y = c[-1] * t + c[-2]
    for row in c[-3::-1]:  # Horner
        y *= t
        y += row
    y *= a
    np.minimum(y, one, out=y)
    return np.copysign(y, x, out=y)


def _erf_through_single(x: np.ndarray) -> np.ndarray:
    """erf of a half-precision array computed in float32 and rounded once (the casts: half_cast.py)."""
    return half_cast.from_single(_erf32(half_cast.to_single(x)), x.dtype)


def erf(x: np.ndarray) -> np.ndarray:
    """Vectorised erf for float arrays; float16 and bfloat16 are computed in float32."""
    x = np.asarray(x)
    if x.dtype == np.float32:
        return _erf32(x)
    table = _ERF_T.get(x.dtype)
    if table is None:  # float16 (and bfloat16) through float32; float16 arrays by a lookup in those results
        if x.dtype == half_cast.HALF and x.size >= half_cast.TABLE_MIN:
            return half_cast.by_table(_erf_through_single, x)
        return _erf_through_single(x)
    k = _ERF_K[x.dtype]
    if x.ndim == 0:
        return _erf_block(x.reshape(1), table, *k).reshape(())
    if x.size <= _ERF_CHUNK:
        return _erf_block(x, table, *k)
    flat = x.reshape(-1)
    out = np.empty(flat.shape, x.dtype)
    for i in range(0, flat.size, _ERF_CHUNK):
        out[i:i + _ERF_CHUNK] = _erf_block(flat[i:i + _ERF_CHUNK], table, *k)
    return out.reshape(x.shape)


@kernel("Erf", since=9)
def erf_kernel(inputs: Inputs, attrs: Attrs) -> Outputs:
    return (erf(inputs[0]),)


# --- variadic ops, Where, Identity -----------------------------------------------------------------

def _fold(fn: Callable[..., Any], xs: Inputs) -> np.ndarray:
    r = _arr(fn(xs[0], xs[1]))
    for x in xs[2:]:
        if np.broadcast_shapes(r.shape, x.shape) == r.shape:
            fn(r, x, out=r)  # r is ours: accumulate in place
        else:
            r = fn(r, x)
    return r


def _variadic(fn: Callable[..., Any]) -> Callable[[Inputs, Attrs], Outputs]:
    def run(inputs: Inputs, attrs: Attrs) -> Outputs:
        return (inputs[0] if len(inputs) == 1 else _fold(fn, inputs),)

    return run


def _sum_float32(xs: Inputs) -> np.ndarray:
    """The sum of float16/bfloat16 ``xs`` in float32, in _fold's order, not yet rounded (Sum, Mean)."""
    return _fold(np.add, [x.astype(F32) for x in xs])


kernel("Max", since=8)(_variadic(np.maximum))
kernel("Min", since=8)(_variadic(np.minimum))


@kernel("Sum", since=8)
def sum_(inputs: Inputs, attrs: Attrs) -> Outputs:
    """float32/float64 fold in their type, in the order ((a + b) + c) + ... that the fusion expand_sums
    reproduces with Adds; float16/bfloat16 add in float32 and round once, as onnxruntime (expand_sums
    leaves their Sums alone)."""
    if len(inputs) == 1:
        return (inputs[0],)
    if is_half(inputs[0].dtype):
        return (_sum_float32(inputs).astype(inputs[0].dtype),)
    return (_fold(np.add, inputs),)


@kernel("Mean", since=8)
def mean(inputs: Inputs, attrs: Attrs) -> Outputs:
    if len(inputs) == 1:
        return (inputs[0],)
    if is_half(inputs[0].dtype):  # the sum and the division in float32, rounded once
        r = _sum_float32(inputs)
        r /= len(inputs)
        return (r.astype(inputs[0].dtype),)
    r = _fold(np.add, inputs)
    r /= len(inputs)
    return (r,)


# Where selects by bit masks: out = b ^ ((a ^ b) & m), m all ones where the condition holds. It is exact
# (bits are copied, NaN payloads and -0.0 included) and 10-20x faster than np.where on an irregular mask
# (the ReLU gradient's, a causal mask's). A mask of the output's full shape skips building m: the bits as
# integers times the 0/1 flags are as exact, and 1.3-1.6x faster (the ReLU gradient at 256x512: 36 -> 23 us);
# a broadcast mask (a causal one) keeps m, which is small.
BITS_INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}  # itemsize → the integer type of its bits


# below this many elements np.where is faster than the bit masks (measured here: 0.8 against 4.1 µs at 256,
# 2.7 against 4.8 at 4096, 8.6 against 6.4 at 16384; in a training step the masks took 15-23 µs on 256)
SELECT_MASK_MIN = 8192


def select(c: np.ndarray, a: Any, b: Any) -> np.ndarray:
    """``np.where(c, a, b)`` for a bool ``c`` and same-dtype ``a`` and ``b``, by bit masks."""
    if type(a) is not np.ndarray:  # (a Where kernel's operands are arrays: no asarray calls in its steps)
        a = np.asarray(a)
    if type(b) is not np.ndarray:
        b = np.asarray(b)
    if max(c.size, a.size, b.size) < SELECT_MASK_MIN or c.dtype != np.bool_ or a.dtype != b.dtype:
        return np.where(c, a, b)
    shape = np.broadcast_shapes(c.shape, a.shape, b.shape)
    if c.size == 1:  # one flag picks a whole input
        picked = a if c.reshape(-1)[0] else b
        return picked if picked.shape == shape else np.broadcast_to(picked, shape).copy()
    it = BITS_INT.get(a.dtype.itemsize)
    if it is None or a.dtype.kind not in "fiub":
        return np.where(c, a, b)
    out = np.empty(shape, a.dtype)
    av, bv, ov = a.view(it), b.view(it), out.view(it)
    if c.shape == shape:  # a full mask: integer arithmetic with the 0/1 flags, no mask to build first
        flags = c.view(np.int8)
        if b.size == 1 and not bv.any():  # where(c, a, 0) = a * flag
            np.multiply(av, flags, out=ov, dtype=it)
        elif a.size == 1 and not av.any():  # where(c, 0, b) = b * (1 - flag)
            np.multiply(bv, np.logical_not(c).view(np.int8), out=ov, dtype=it)
        else:  # (a - b) * flag + b, wrapping around: a or b exactly
            np.subtract(av, bv, out=ov)
            np.multiply(ov, flags, out=ov, dtype=it)
            np.add(ov, bv, out=ov)
        return out
    m = np.negative(c.view(np.int8), dtype=it, out=np.empty(c.shape, it))
    if b.size == 1 and not bv.any():  # where(c, a, 0): one AND
        np.bitwise_and(av, m, out=ov)
    elif a.size == 1 and not av.any():  # where(c, 0, b)
        np.invert(m, out=m)
        np.bitwise_and(bv, m, out=ov)
    else:
        np.bitwise_xor(av, bv, out=ov)
        ov &= m
        ov ^= bv
    return out


@kernel("Where", since=9)
def where(inputs: Inputs, attrs: Attrs) -> Outputs:
    return (select(inputs[0], inputs[1], inputs[2]),)


@kernel("Identity", since=1)
def identity(inputs: Inputs, attrs: Attrs) -> Outputs:
    return (inputs[0],)


# --- Cast, CastLike --------------------------------------------------------------------------------

_F8_MAX = {TensorProto.FLOAT8E4M3FN: 448.0, TensorProto.FLOAT8E4M3FNUZ: 240.0,
           TensorProto.FLOAT8E5M2: 57344.0, TensorProto.FLOAT8E5M2FNUZ: 57344.0}
_E8M0 = getattr(TensorProto, "FLOAT8E8M0", -1)


def _to_e8m0(x: np.ndarray, dt: np.dtype, saturate: bool, round_mode: str) -> np.ndarray:
    """float -> float8e8m0, a bare power-of-two exponent byte (2^-127 to 2^127, 0xFF NaN), as onnxruntime's
    Cast: rounded up, down or to the nearest power (a tie upwards); with ``saturate``, values below 2^-127
    (zero and negative ones too) give 2^-127 and values above 2^127 (+inf too) 2^127, else NaN."""
    f = np.asarray(x, dtype=np.float32)
    bits = f.view(np.uint32)
    e = ((bits >> 23) & 0xFF).astype(np.int32)
    frac = bits & 0x7FFFFF
    sub = e == 0  # float32 subnormals: 2^-127 is the fraction 0x400000, 2^-126 the next code
    if round_mode == "up":
        inc = np.where(sub, frac > 0x400000, frac != 0)
    elif round_mode == "nearest":
        inc = np.where(sub, frac >= 0x600000, frac >= 0x400000)
    elif round_mode == "down":
        inc = np.zeros(e.shape, dtype=bool)
    else:
        raise ValueError(f"Cast: round_mode must be up, down or nearest, got {round_mode!r}")
    code = e + inc
    with np.errstate(invalid="ignore"):
        low = ~(f >= np.float32(2.0**-127))  # NaN too: set apart below
        high = f > np.float32(2.0**127)
    code = np.where(low, 0, np.minimum(code, 0xFE)) if saturate else np.where(low | high, 0xFF, code)
    code = np.where(np.isnan(f), 0xFF, code)
    return code.astype(np.uint8).view(dt)


_NUMPY_FLOATS = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64, np.longdouble))


def cast_to(x: np.ndarray, to: int, saturate: bool = True, round_mode: str = "up",
            dt: np.dtype | None = None) -> np.ndarray:
    """``x`` converted to the ONNX element type ``to`` (Cast semantics, opset 19+ ``saturate``)."""
    if to == TensorProto.STRING:
        return _as_strings(x)
    if dt is None:
        dt = np.dtype(helper.tensor_dtype_to_np_dtype(to))
    if x.dtype == dt:
        return x
    if to == _E8M0:
        return _to_e8m0(x, dt, saturate, round_mode)
    if x.dtype.kind in "OU":  # strings: their leading number, as onnxruntime reads them (C's strtoll, strtod)
        flat = x.reshape(-1).tolist()
        if dt.kind in "iub":  # the leading integer ("1.5" and "1e2" are 1), wrapped into the type
            ints = [_leading_number(v, _INTEGER, signed=dt.kind == "i") for v in flat]
            if dt.kind == "b":
                return np.array([v != 0 for v in ints], dtype=bool).reshape(x.shape)
            bits = 8 * dt.itemsize
            wrapped = np.array([v % (1 << bits) for v in ints], dtype=np.uint64)
            return wrapped.astype(dt).reshape(x.shape)
        x = np.array([_leading_number(v, _FLOAT) for v in flat], dtype=np.float64).reshape(x.shape)
        if dt != np.float64:  # read as a float32 first, then narrowed (float16 and the others)
            x = x.astype(np.float32)
    narrow = x.dtype.kind in "Vf" and x.dtype not in _NUMPY_FLOATS
    if narrow and (dt.kind in "iub" or (saturate and to in _F8_MAX)):
        # ml_dtypes sources (bfloat16, float8, int4 ...) widened exactly, so that the clamp below and the
        # integer conversion treat them as float32 sources (they skipped both: NaN where a value saturates)
        x = x.astype(np.float32)
    if saturate and to in _F8_MAX and x.dtype.kind in "fiu":
        m = _F8_MAX[to]
        x = np.clip(x, -m, m)  # +-inf and out-of-range values (any source type) go to the largest finite one
    if x.dtype.kind == "f" and dt.kind in "iub":
        with np.errstate(invalid="ignore"):  # NaN and out-of-range values are undefined in ONNX
            return x.astype(dt)
    if x.dtype == half_cast.SINGLE and dt == half_cast.HALF:
        return half_cast.narrow(x)
    if x.dtype == half_cast.HALF and dt == half_cast.SINGLE:
        return half_cast.widen(x)
    return x.astype(dt)


_INTEGER = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")
_HEX = re.compile(r"[ \t\n\v\f\r]*([+-]?0x(?:[0-9a-f]+\.?[0-9a-f]*|\.[0-9a-f]+)(?:p[+-]?[0-9]+)?)",
                  re.IGNORECASE)
_FLOAT = re.compile(r"[ \t\n\v\f\r]*([+-]?(?:inf(?:inity)?|nan|(?:[0-9]+\.?[0-9]*|\.[0-9]+)"
                    r"(?:e[+-]?[0-9]+)?))", re.IGNORECASE)
_INT64, _UINT64 = (-(1 << 63), (1 << 63) - 1), (-((1 << 64) - 1), (1 << 64) - 1)


def _leading_number(v: Any, pattern: re.Pattern[str], signed: bool = True) -> Any:
    """The number a string starts with, as C's stoll / stoull / stod read it (onnxruntime's Cast reads that
    much: "1.5abc" is 1.5 as a float, 1 as an integer; "1_000" is 1; "0x1A" is 26 as a float), out-of-range
    values refused as they are there."""
    text = str(v)
    m = _HEX.match(text) if pattern is _FLOAT else None
    if m is not None:
        hexa = m.group(1)
        return float.fromhex(hexa if "p" in hexa.lower() else hexa + "p0")
    m = pattern.match(text)
    if m is None:
        raise ValueError(f"Cast: {text!r} does not start with a number")
    if pattern is _INTEGER:
        n = int(m.group(1))
        low, high = _INT64 if signed else _UINT64
        if not low <= n <= high:
            raise ValueError(f"Cast: {text!r} is out of the range of a {'signed' if signed else 'unsigned'} "
                             "64-bit integer")
        return n
    f = float(m.group(1))
    digits = m.group(1).lower().split("e")[0]
    if (math.isinf(f) and "inf" not in digits) or (f == 0 and any(c in "123456789" for c in digits)):
        raise ValueError(f"Cast: {text!r} is out of the range of a double")
    return f


def _as_strings(x: np.ndarray) -> np.ndarray:
    """``x`` as strings, spelled as onnxruntime's Cast spells them: "1"/"0" for booleans, floating-point
    values with 8 significant digits ("100", "1e-07") and the reserved "NaN", "INF", "-INF"."""
    if x.dtype.kind in "OSU":
        return x.astype(np.str_).astype(object)
    if x.dtype == np.bool_:
        return np.where(x, "1", "0").astype(object)
    if x.dtype.kind in "iu":
        return x.astype(np.str_).astype(object)
    v = np.asarray(x, np.float64)
    special = {math.inf: "INF", -math.inf: "-INF"}
    out = ["NaN" if math.isnan(f) else special.get(f) or f"{f:.8g}" for f in v.reshape(-1).tolist()]
    return np.array(out, dtype=object).reshape(x.shape)


@kernel("Cast", since=6)
def cast(inputs: Inputs, attrs: Attrs) -> Outputs:
    c = attrs.cache
    args = c.get("args")
    if args is None:
        to = attrs["to"]
        sat = attrs.get("saturate")
        args = (to, sat is None or bool(sat), attrs.get("round_mode") or "up",
                None if to == TensorProto.STRING else np.dtype(helper.tensor_dtype_to_np_dtype(to)))
        # "plain" first: another thread running this node reads it once it sees "args"
        c["plain"] = {}  # source dtype → whether its conversion is numpy's own astype (_plain_cast)
        c["args"] = args
    x = inputs[0]
    if type(x) is np.ndarray:
        known = c["plain"]
        plain = known.get(x.dtype)
        if plain is None:
            plain = known[x.dtype] = _plain_cast(x.dtype, args[0], args[3])
        if plain:
            return (x.astype(args[3]),)
    return (_arr(cast_to(x, *args)),)


_PLAIN_KINDS = frozenset("biuf")


def _plain_cast(src: np.dtype, to: int, dt: np.dtype | None) -> bool:
    """True when :func:`cast_to` converts ``src`` to ``dt`` (the ONNX type ``to``) by ``astype`` alone: two
    different numpy bool/integer/float types (not float16's own routes, float8, E8M0 or strings), and no float
    source cast to an integer (cast_to quiets numpy's warnings there)."""
    return (dt is not None and src != dt and src.kind in _PLAIN_KINDS and dt.kind in _PLAIN_KINDS
            and (src.kind != "f" or src in _NUMPY_FLOATS) and (dt.kind != "f" or dt in _NUMPY_FLOATS)
            and not (src.kind == "f" and dt.kind in "iub") and to not in _F8_MAX and to != _E8M0
            and half_cast.HALF not in (src, dt))


@kernel("CastLike", since=15)
def cast_like(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, like = inputs
    sat = attrs.get("saturate")
    to = helper.np_dtype_to_tensor_dtype(like.dtype)
    return (_arr(cast_to(x, to, sat is None or bool(sat), attrs.get("round_mode") or "up")),)


_SUB_BYTE_BITS = {TensorProto.UINT4: 4, TensorProto.INT4: 4, TensorProto.FLOAT4E2M1: 4}
_SUB_BYTE_BITS.update({getattr(TensorProto, t): 2 for t in ("UINT2", "INT2") if hasattr(TensorProto, t)})


def _bit_width(dt: np.dtype) -> int:
    """Bits of one element of ``dt`` (ml_dtypes keeps a 4- or 2-bit element in a byte of its own)."""
    return _SUB_BYTE_BITS.get(helper.np_dtype_to_tensor_dtype(dt), dt.itemsize * 8)


def _bit_cast_type(src: np.dtype, to: int) -> np.dtype:
    if src.kind in "OSU" or to == TensorProto.STRING:
        raise TypeError("BitCast: strings have no fixed bit width")
    dt = np.dtype(helper.tensor_dtype_to_np_dtype(to))
    if _bit_width(src) != _bit_width(dt):
        raise TypeError(f"BitCast: {src} ({_bit_width(src)} bits) and {dt} ({_bit_width(dt)} bits) differ in "
                        "bit width; the output keeps the input's shape, so they must be equal")
    return dt


@kernel("BitCast", since=26)
def bit_cast(inputs: Inputs, attrs: Attrs) -> Outputs:
    """The input's bits read as the type ``to`` of the same width (Cast keeps values, BitCast bits)."""
    x = inputs[0]
    dt = attrs.cached(("to", x.dtype), lambda: _bit_cast_type(x.dtype, attrs["to"]))
    return (x.view(dt),)
