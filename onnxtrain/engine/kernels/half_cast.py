"""float16 work through float32 arrays, with numpy's bits: conversions by integer passes, and the float16
ufuncs that numpy itself computes in float32.

numpy converts between float16 and float32 one value at a time (on the bench's AMD EPYC 2.4 ns a value to
float16, 5.8 where the results are subnormal, 1.7 back), and its float16 arithmetic converts each operand and
result the same way (a multiply 6.4 ns a value against 0.1 in float32); mixed-precision training casts every
weight and weight gradient each step and runs its activations' arithmetic in float16. :func:`narrow` and
:func:`widen` take the values through vectorised integer and float passes over blocks of scratch: rounding to
nearest even by integer carry (normal results) or by a float32 addition that aligns the bits (subnormal
results). They give numpy's bits for every finite value that stays finite (``tools/check_half_cast.py``
compares all 2³² float32 and all 2¹⁶ float16 inputs); arrays holding infinities, NaNs or values that
overflow float16 take numpy's own cast (its overflow warning, its NaN payloads), as do small arrays
(:data:`NARROW_MIN`, :data:`WIDEN_MIN`). :class:`ViaSingle` runs add, subtract, multiply, divide and sqrt of
float16 arrays on their float32 values, rounding once, as numpy's float16 loops do value by value.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

HALF = np.dtype(np.float16)
SINGLE = np.dtype(np.float32)
# smaller arrays take numpy's cast: the passes' calls cost about 12 µs a conversion (the bench's host: to
# float16 numpy 20 µs / these 19 at 8 K values, 41 / 30 at 16 K; back 12 / 14 at 8 K, 27 / 19 at 16 K)
NARROW_MIN = 1 << 13
WIDEN_MIN = 1 << 14
BLOCK = 1 << 17  # values per block of scratch (smaller blocks: more ufunc calls, no faster passes)

_ABS = np.uint32(0x7FFFFFFF)
_LAST_FINITE = np.uint32(0x477FEFFF)  # |x| bits below 65520: rounds to a finite float16 (65504 at most)
_REBIAS = np.uint32((113 << 23) - 0xFFF)  # exponent 127 → 14 (one added after the shift), less the rounding
_ONE_EXPONENT = np.uint32(1 << 10)
_SMALLEST_NORMAL = np.uint32(113 << 23)  # 2⁻¹⁴: below, the float16 result is subnormal (or zero)
_ALIGN_BITS = np.uint32((127 - 15 + 23 - 10 + 1) << 23)  # 0.5: added, it leaves float16's bits at the bottom
_ALIGN = _ALIGN_BITS.view(np.float32)
_HALF_ABS = np.uint16(0x7FFF)
_HALF_INF = np.uint16(0x7C00)
_SIGN = np.uint16(0x8000)
# float16 magnitude bits << 13, plus 113 << 23, read as float32: g = 2·v for a normal float16 v, 2⁻¹⁴ + v
# for a subnormal one (or zero); so v = min(g / 2, g − 2⁻¹⁴) for every finite float16, with no float32
# subnormal operand (each costs a microcode assist on Intel CPUs: 5x slower on all-subnormal gradients)
_WIDE_BIAS = np.uint32(113 << 23)
_HALVE = np.float32(0.5)
_SMALLEST_HALF_NORMAL = np.float32(2.0**-14)


def _narrow_block(x: np.ndarray, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> bool:
    """``x`` (float32 bits, uint32) rounded to float16 bits in ``out`` (uint16); False (``out`` unset) when
    some |x| is 65520 or more, infinite or NaN. ``a``, ``b``: uint32 scratch of x's size."""
    np.bitwise_and(x, _ABS, out=a)
    if np.maximum.reduce(a) > _LAST_FINITE:
        return False
    # normal results: exponent rebiased, mantissa rounded by carry (+0xFFF, +1 more where the kept last
    # bit is odd: ties to even); |x| under 2⁻¹⁴ wraps around to a huge value here, 0x400 and up after
    np.right_shift(a, 13, out=b)
    np.bitwise_and(b, 1, out=b)
    np.add(b, a, out=b)
    np.subtract(b, _REBIAS, out=b)
    np.right_shift(b, 13, out=b)
    np.add(b, _ONE_EXPONENT, out=b)
    if np.minimum.reduce(a) < _SMALLEST_NORMAL:
        # subnormal results: adding 0.5 in float32 rounds away the bits below float16's last one; what is
        # left above 0.5's bits is the float16 (0..0x400), under the value above; normal ones give more
        af = a.view(np.float32)
        np.add(af, _ALIGN, out=af)
        np.subtract(a, _ALIGN_BITS, out=a)
        np.minimum(b, a, out=b)
    np.right_shift(x, 16, out=a)
    np.bitwise_and(a, np.uint32(0x8000), out=a)
    np.bitwise_or(b, a, out=out, casting="unsafe")
    return True


def narrow(x: np.ndarray) -> np.ndarray:
    """``x.astype(np.float16)`` of a float32 array, bit for bit."""
    if x.size < NARROW_MIN or x.dtype != SINGLE:
        return x.astype(HALF)
    src = np.ascontiguousarray(x).reshape(-1).view(np.uint32)
    out = np.empty(src.size, np.uint16)
    a, b = np.empty(min(BLOCK, src.size), np.uint32), np.empty(min(BLOCK, src.size), np.uint32)
    for at in range(0, src.size, BLOCK):
        k = min(BLOCK, src.size - at)
        if not _narrow_block(src[at:at + k], out[at:at + k], a[:k], b[:k]):
            return x.astype(HALF)  # inf, NaN or overflow: numpy's payloads and warning
    return out.view(HALF).reshape(x.shape)


def widen(h: np.ndarray) -> np.ndarray:
    """``h.astype(np.float32)`` of a float16 array, bit for bit."""
    if h.size < WIDEN_MIN or h.dtype != HALF:
        return h.astype(SINGLE)
    y = _widened(h)
    return h.astype(SINGLE) if y is None else y  # inf or NaN: numpy's payloads


def _widened(h: np.ndarray) -> np.ndarray | None:
    """float16 ``h`` in float32 by the integer passes; None when it holds an infinity or a NaN."""
    src = np.ascontiguousarray(h).reshape(-1).view(np.uint16)
    out = np.empty(src.size, np.float32)
    bits = out.view(np.uint32)
    t, s = np.empty(min(BLOCK, src.size), np.uint16), np.empty(min(BLOCK, src.size), np.uint32)
    for at in range(0, src.size, BLOCK):
        k = min(BLOCK, src.size - at)
        tk, sk, ok, hk = t[:k], s[:k], bits[at:at + k], src[at:at + k]
        np.bitwise_and(hk, _HALF_ABS, out=tk)
        if np.maximum.reduce(tk) >= _HALF_INF:
            return None
        np.left_shift(tk, 13, out=ok, dtype=np.uint32)
        np.add(ok, _WIDE_BIAS, out=ok)
        g, half_g = ok.view(np.float32), sk.view(np.float32)
        np.multiply(g, _HALVE, out=half_g)
        np.subtract(g, _SMALLEST_HALF_NORMAL, out=g)
        np.minimum(g, half_g, out=g)
        np.bitwise_and(hk, _SIGN, out=tk)
        np.left_shift(tk, 16, out=sk, dtype=np.uint32)
        np.bitwise_or(ok, sk, out=ok)
    return out.reshape(h.shape)


# Rounding to float16 without leaving float32 (:func:`round_to_half`): a float32 x of exponent E (at least
# -14, float16's smallest normal one) plus C = 1.5·2^(E+13) lands in C's binade, whose spacing 2^(E-10) is
# float16's in x's binade (or its subnormal spacing 2^-24), so the addition rounds x to float16's precision
# (to nearest, ties to even: C's significand is even there) and subtracting C gives that value exactly.
_EXPONENT = np.uint32(0x7F800000)
_SIGN_BIT = np.uint32(0x80000000)
_LOWEST_EXPONENT = np.uint32(113 << 23)  # 2⁻¹⁴: below it, the spacing stays float16's subnormal one, 2⁻²⁴
_TO_MAGIC = np.uint32((13 << 23) | (1 << 22))  # exponent bits of x → C's bits: 2^(E+13), times 1.5
_FIRST_UNSAFE = np.uint32(142 << 23)  # 2¹⁵: from here a rounding may reach 65520 (inf), or x is inf/NaN
ROUND_BLOCK = 1 << 16  # values per block: the block and its two scratch arrays stay in a 2 MiB cache


def round_to_half(x: np.ndarray) -> bool:
    """Round the C-contiguous float32 array ``x`` in place to the float16 values ``x.astype(np.float16)``
    gives (to nearest even, subnormals and signed zeros alike), staying in float32: the bits of
    ``x.astype(np.float16).astype(np.float32)``. False where some |x| is 2¹⁵ or more, infinite or NaN (whose
    rounding may overflow, or carries a payload): ``x`` is then rounded in part, which narrowing it to
    float16, as the caller does then, cannot tell from ``x`` itself (each value narrows to the same bits)."""
    flat = x.reshape(-1)
    bits = flat.view(np.uint32)
    n = min(flat.size, ROUND_BLOCK)
    e, s = np.empty(n, np.uint32), np.empty(n, np.uint32)
    for at in range(0, flat.size, ROUND_BLOCK):
        k = min(ROUND_BLOCK, flat.size - at)
        xb, xf, ek = bits[at:at + k], flat[at:at + k], e[:k]
        np.bitwise_and(xb, _EXPONENT, out=ek)
        if np.maximum.reduce(ek) >= _FIRST_UNSAFE:
            return False
        tiny = np.minimum.reduce(ek) < _LOWEST_EXPONENT  # a value below 2⁻¹⁴ (zero, subnormal in float16)
        if tiny:
            np.maximum(ek, _LOWEST_EXPONENT, out=ek)
            np.bitwise_and(xb, _SIGN_BIT, out=s[:k])
        np.add(ek, _TO_MAGIC, out=ek)
        c = ek.view(np.float32)
        np.add(xf, c, out=xf)
        np.subtract(xf, c, out=xf)
        if tiny:  # a value rounded to zero keeps its sign (only one under 2⁻¹⁴ can be)
            np.bitwise_or(xb, s[:k], out=xb)
    return True


def to_single(v: np.ndarray) -> np.ndarray:
    """``v.astype(np.float32)``, float16 by :func:`widen`."""
    return widen(v) if v.dtype == HALF else v.astype(SINGLE)


def from_single(y: np.ndarray, dt: np.dtype) -> np.ndarray:
    """``y.astype(dt)``, float32 to float16 by :func:`narrow`."""
    return narrow(y) if dt == HALF and y.dtype == SINGLE else y.astype(dt)


# numpy's float16 loops of these compute each value in float32 and round it once to float16: whole float32
# arrays give the same bits, at the routes' cost instead of a scalar conversion per operand and result
ROUNDED_ONCE = frozenset({np.add, np.subtract, np.multiply, np.divide, np.sqrt})
VIA_SINGLE_MIN = 1 << 13  # values of the result: smaller ones stay in numpy's float16 loop


class ViaSingle:
    """A :data:`ROUNDED_ONCE` ufunc on float16 arrays with numpy's float16 bits: of one operand (square root),
    or of two where one holds a single value (``x * 0.5``), a lookup in numpy's own results for every float16
    (:func:`by_table`, :func:`_scalar_table`); else run on the operands' float32 values and rounded once.
    Small results, and operands holding infinities or NaNs on the float32 route, take numpy's own loop."""

    __slots__ = ("ufunc",)

    def __init__(self, ufunc: np.ufunc) -> None:
        self.ufunc = ufunc

    def __call__(self, *args: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        size = max(a.size for a in args)
        if size < VIA_SINGLE_MIN:
            return self.ufunc(*args, out=out)
        if len(args) == 1:
            return by_table(self.ufunc, args[0], out)
        y = _one_value_op(self.ufunc, args[0], args[1], size)
        if y is not None:
            return _into(y, out)
        wide = [_finite_single(a) for a in args[:1]]
        wide.append(wide[0] if args[1] is args[0] else _finite_single(args[1]))  # x · x: widened once
        if any(w is None for w in wide):  # which NaN comes out is numpy's loop's own
            return self.ufunc(*args, out=out)
        return _into(narrow(self.ufunc(*wide)), out)


def _into(y: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """``y``, or ``out`` with ``y`` copied in when given (a ufunc's ``out=``)."""
    if out is None:
        return y
    np.copyto(out, y)
    return out


def via_single(ufunc: Any, operands: list[np.dtype], result: np.dtype) -> Any:
    """``ufunc`` as a cluster runs it on ``operands`` of these dtypes giving ``result``: :class:`ViaSingle`
    where all are float16 and the ufunc is :data:`ROUNDED_ONCE`, else ``ufunc`` itself."""
    if ufunc in ROUNDED_ONCE and result == HALF and all(dt == HALF for dt in operands):
        return ViaSingle(ufunc)
    return ufunc


def _finite_single(h: np.ndarray) -> np.ndarray | None:
    """float16 ``h`` in float32; None when it holds an infinity or a NaN."""
    if h.size >= WIDEN_MIN:
        return _widened(h)
    w = h.astype(SINGLE)
    return w if np.isfinite(w).all() else None


TABLE_MIN = 1 << 12  # values from which a float16 op of one operand is a lookup (:func:`by_table`)


def _results(fn: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """``fn``'s float16 results for all 65,536 float16 bit patterns, as their bits."""
    every = np.arange(1 << 16, dtype=np.uint16).view(HALF)
    with np.errstate(all="ignore"):
        return np.asarray(fn(every), HALF).view(np.uint16)


_table = functools.cache(_results)  # a module-level function's table, made once


# tables of binary float16 ops with a one-value operand kept at once (128 KiB each); the first use of a new
# one-value operand makes its table (65,536 values through numpy's float16 loop, 0.3-0.5 ms) only for an
# operation of at least SCALAR_TABLE_MIN values, which the lookup then saves more than that on
SCALAR_TABLES = 64
SCALAR_TABLE_MIN = 1 << 16
_scalar_tables: dict[tuple[Any, int, bool], np.ndarray] = {}


def _scalar_table(ufunc: np.ufunc, bits: int, value_first: bool, make: bool) -> np.ndarray | None:
    """numpy's float16 ``ufunc`` of every float16 bit pattern and the float16 of bits ``bits`` (as the first
    operand when ``value_first``), as the results' bits; a new one only with ``make`` (else None)."""
    key = (ufunc, bits, value_first)
    table = _scalar_tables.get(key)
    if table is None and make:
        value = np.array(bits, np.uint16).view(HALF)
        table = _results(lambda every: ufunc(value, every) if value_first else ufunc(every, value))
        if len(_scalar_tables) >= SCALAR_TABLES:
            _scalar_tables.clear()  # (a model's one-value operands come back every step)
        _scalar_tables[key] = table
    return table


def _one_value_op(ufunc: np.ufunc, a: np.ndarray, b: np.ndarray, size: int) -> np.ndarray | None:
    """``ufunc(a, b)`` of float16 arrays where exactly one of them holds a single value, by a lookup in
    :func:`_scalar_table` (numpy's bits for every input, infinities and NaNs included); None otherwise, or
    when that operand's table is new and the operation too small to make it."""
    if (a.size == 1) == (b.size == 1):
        return None
    x, value = (b, a) if a.size == 1 else (a, b)
    bits = int(np.ascontiguousarray(value).reshape(()).view(np.uint16))
    table = _scalar_table(ufunc, bits, a.size == 1, size >= SCALAR_TABLE_MIN)
    if table is None:
        return None
    y = np.take(table, np.ascontiguousarray(x).reshape(-1).view(np.uint16))
    return y.view(HALF).reshape(np.broadcast_shapes(a.shape, b.shape))


def by_table(fn: Callable[[np.ndarray], np.ndarray], x: np.ndarray,
             out: np.ndarray | None = None) -> np.ndarray:
    """``fn(x)`` of a float16 array by a lookup in the results ``fn`` itself gave for every float16 (the same
    bits, NaN payloads and -0.0 included), into ``out`` when given (it may be ``x``); ``fn``: a module-level
    function of one float16 array, whose table is made once."""
    return _into(np.take(_table(fn), np.ascontiguousarray(x).view(np.uint16)).view(HALF), out)
