"""Quantization kernels: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, and the integer
products MatMulInteger, ConvInteger, QLinearMatMul and QLinearConv.

Integer products are computed in float64 (BLAS), where every sum of products of 8-bit values is an
exact integer; the two convolutions run the Conv kernel on those float64 values. Rounding to an
integer type is half to even, then saturating to the type's range; a float8/float4 target rounds
the same way through Cast (saturating unless ``saturate=0``).
"""

from __future__ import annotations

import numpy as np
from onnx import helper

from onnxtrain.engine.kernels.conv import conv
from onnxtrain.engine.kernels.elementwise import cast_to
from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel

_F64 = np.dtype(np.float64)
_SUB_BYTE = {"int4": (-8, 7), "uint4": (0, 15), "int2": (-2, 1), "uint2": (0, 3)}


def _int_range(dt: np.dtype) -> tuple[int, int] | None:
    """(min, max) of an integer dtype (the 2- and 4-bit ones included), or None for a float dtype."""
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return int(info.min), int(info.max)
    return _SUB_BYTE.get(dt.name)


def _wide(v: np.ndarray | None) -> np.ndarray | float:
    """``v`` as float64 (exact for every quantized type), 0.0 for an omitted zero point."""
    return 0.0 if v is None else np.asarray(v).astype(_F64)


def saturate_to(v: np.ndarray, dt: np.dtype, saturate: bool = True) -> np.ndarray:
    """Real values ``v`` rounded to ``dt``: half to even and clipped for an integer type (NaN to the type's
    lowest value, as onnxruntime), Cast for a float one (float8 overflows to NaN/inf unless ``saturate``;
    float4 always saturates)."""
    rng = _int_range(dt)
    if rng is None:
        return cast_to(np.asarray(v), helper.np_dtype_to_tensor_dtype(dt), saturate)
    return np.minimum(np.fmax(np.rint(v), rng[0]), rng[1]).astype(dt)


def _axis(axis: int, rank: int, op: str) -> int:
    if not -rank <= axis < rank:
        raise ValueError(f"{op}: axis {axis} is out of range for an input of rank {rank}")
    return axis % rank


def _granular(x_shape: tuple[int, ...], v: np.ndarray | None, attrs: Attrs, what: str) -> np.ndarray | None:
    """A scale or zero point shaped to broadcast against x: per tensor (one value), per axis (1-D of
    x.shape[axis]) or blocked (x's rank, each value repeated ``block_size`` times along ``axis``)."""
    if v is None:
        return None
    op = attrs.op or "QuantizeLinear"
    block = int(attrs.get("block_size") or 0)
    if block > 0:
        if v.ndim != len(x_shape):
            raise ValueError(f"{op}: blocked {what} must have x's rank {len(x_shape)}, got shape {v.shape}")
        ax = _axis(int(attrs.get("axis", 1)), len(x_shape), op)
        want = tuple(-(-d // block) if i == ax else d for i, d in enumerate(x_shape))
        if v.shape != want:
            raise ValueError(f"{op}: {what} shape {v.shape} does not match x {x_shape} with block_size "
                             f"{block} on axis {ax} (expected {want})")
        return np.repeat(v, block, axis=ax)[tuple(slice(0, d) for d in x_shape)]
    if v.size == 1 and v.ndim <= 1:
        return v.reshape(())
    if v.ndim != 1:
        raise ValueError(f"{op}: {what} of shape {v.shape} needs block_size > 0 (or be a scalar or 1-D)")
    ax = _axis(int(attrs.get("axis", 1)), len(x_shape), op)
    if v.shape[0] != x_shape[ax]:
        raise ValueError(f"{op}: per-axis {what} has {v.shape[0]} values, x has {x_shape[ax]} on axis {ax}")
    return v.reshape((-1,) + (1,) * (len(x_shape) - 1 - ax))


# ------------------------------------------------------------------------ QuantizeLinear, Dequantize

@kernel("QuantizeLinear", since=10)
def quantize_linear(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, scale = inputs[0], inputs[1]
    zp = inputs[2] if len(inputs) > 2 else None
    to = int(attrs.get("output_dtype") or 0)
    if zp is not None:
        dt = zp.dtype
        if to and helper.np_dtype_to_tensor_dtype(dt) != to:
            raise ValueError(f"QuantizeLinear: output_dtype {to} differs from y_zero_point's type {dt}")
    else:
        dt = helper.tensor_dtype_to_np_dtype(to) if to else np.dtype(np.uint8)
    precision = int(attrs.get("precision") or 0)
    work = np.dtype(helper.tensor_dtype_to_np_dtype(precision) if precision else scale.dtype)
    if work.kind != "f" and work.name != "bfloat16":  # a float8e8m0 (power of two) scale: divide in float32
        work = np.dtype(np.float32)
    s = _granular(x.shape, scale, attrs, "y_scale").astype(work)
    q = np.asarray(x.astype(work) / s)
    if _int_range(np.dtype(dt)) is not None:
        q = np.rint(q)  # the zero point is an integer: round before adding it, as the spec writes
    if zp is not None:
        q = q.astype(_F64) + _wide(_granular(x.shape, zp, attrs, "y_zero_point"))
    sat = attrs.get("saturate")
    return (saturate_to(q, np.dtype(dt), sat is None or bool(sat)),)


@kernel("DequantizeLinear", since=10)
def dequantize_linear(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, scale = inputs[0], inputs[1]
    zp = inputs[2] if len(inputs) > 2 else None
    to = int(attrs.get("output_dtype") or 0)
    dt = helper.tensor_dtype_to_np_dtype(to) if to else scale.dtype
    if x.dtype == np.int32 and zp is not None and np.any(zp):
        raise ValueError("DequantizeLinear: an int32 x takes no (or a zero) x_zero_point")
    s = _granular(x.shape, scale, attrs, "x_scale")
    diff = _wide(x) - _wide(_granular(x.shape, zp, attrs, "x_zero_point"))
    # a half-precision output is rounded once, from the float32 product (as onnxruntime does)
    work = np.promote_types(dt, np.float32)
    y = diff.astype(work) * s.astype(work)
    return (np.asarray(y).astype(dt, copy=False),)


@kernel("DynamicQuantizeLinear", since=11)
def dynamic_quantize_linear(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    f = np.float32
    hi = f(max(0.0, float(x.max()))) if x.size else f(0)
    lo = f(min(0.0, float(x.min()))) if x.size else f(0)
    # an all-zero x has no range: scale 1/255 then, as onnx.reference does (onnxruntime 1.32 says 1.0),
    # so zero maps to zero
    scale = f((hi - lo) if hi != lo else f(1)) / f(255)
    zp = np.rint(np.clip(f(0) - lo / scale, 0, 255))
    y = np.clip(np.rint(x / scale) + zp, 0, 255).astype(np.uint8)
    return y, np.asarray(scale, dtype=x.dtype), np.asarray(zp).astype(np.uint8)


# --------------------------------------------------------------------------------- integer products

def _rows(v: np.ndarray | None, a_ndim: int) -> np.ndarray | None:
    """A zero point or scale of matmul's left operand: a vector of several values holds one per row."""
    if v is not None and v.ndim == 1 and v.size > 1 and a_ndim >= 2:
        return v.reshape(-1, 1)
    return v


def _channels(v: np.ndarray | None, rank: int, axis: int) -> np.ndarray | None:
    """A conv zero point, scale or bias: a vector of several values holds one per channel (``axis``)."""
    if v is None:
        return None
    if v.ndim == 1 and v.size > 1:
        return v.reshape((-1,) + (1,) * (rank - 1 - axis))
    return v.reshape(()) if v.size == 1 else v


def _multiplier(*scales: np.ndarray) -> np.ndarray:
    """x_scale * w_scale / y_scale, in the scales' own type (as the spec computes it), then widened."""
    a, b, c = (np.asarray(s) for s in scales)
    return np.asarray(a * b / c).astype(_F64)


@kernel("MatMulInteger", since=10)
def matmul_integer(inputs: Inputs, attrs: Attrs) -> Outputs:
    a, b = inputs[0], inputs[1]
    a_zp = inputs[2] if len(inputs) > 2 else None
    b_zp = inputs[3] if len(inputs) > 3 else None
    y = np.matmul(_wide(a) - _wide(_rows(a_zp, a.ndim)), _wide(b) - _wide(b_zp))
    return (np.asarray(y).astype(np.int32),)


@kernel("QLinearMatMul", since=10)
def qlinear_matmul(inputs: Inputs, attrs: Attrs) -> Outputs:
    a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp = inputs[:8]
    # a 1-D b is a (K, 1) matrix whose column axis leaves the result: the per-row scales of a must still
    # meet the result's rows, so the product is formed with that axis and it is dropped at the end
    vec = b.ndim == 1
    if vec:
        b = b.reshape(-1, 1)
    acc = np.matmul(_wide(a) - _wide(_rows(a_zp, a.ndim)), _wide(b) - _wide(b_zp))
    m = _multiplier(_rows(a_scale, a.ndim), b_scale, y_scale)
    dt = y_zp.dtype if y_zp is not None else a.dtype
    y = saturate_to(acc * m + _wide(y_zp), np.dtype(dt))
    return (y[..., 0] if vec else y,)


def _conv_integer(inputs: Inputs, attrs: Attrs, x_zp: np.ndarray | None,
                  w_zp: np.ndarray | None) -> np.ndarray:
    """The exact (float64) convolution of x - x_zp with w - w_zp; zero padding then equals x_zp padding."""
    x, w = inputs[0], inputs[1]
    if x_zp is not None and np.size(x_zp) != 1:
        raise ValueError(f"{attrs.op}: x_zero_point must be a scalar, got shape {np.shape(x_zp)}")
    return conv((_wide(x) - _wide(_channels(x_zp, x.ndim, 1)), _wide(w) - _wide(_channels(w_zp, w.ndim, 0))),
                attrs)[0]


@kernel("ConvInteger", since=10)
def conv_integer(inputs: Inputs, attrs: Attrs) -> Outputs:
    x_zp = inputs[2] if len(inputs) > 2 else None
    w_zp = inputs[3] if len(inputs) > 3 else None
    return (_conv_integer(inputs, attrs, x_zp, w_zp).astype(np.int32),)


@kernel("QLinearConv", since=10)
def qlinear_conv(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp = inputs[:8]
    bias = inputs[8] if len(inputs) > 8 else None
    acc = _conv_integer((x, w), attrs, x_zp, w_zp)
    rank = acc.ndim
    if bias is not None:
        acc += _wide(_channels(bias, rank, 1))
    m = _multiplier(x_scale, _channels(w_scale, rank, 1), y_scale)
    dt = y_zp.dtype if y_zp is not None else x.dtype
    return (saturate_to(acc * m + _wide(y_zp), np.dtype(dt)),)
