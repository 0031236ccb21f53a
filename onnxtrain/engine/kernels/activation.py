"""Activation kernels: Relu, Sigmoid, Tanh, Gelu, the Relu/Elu variants, Softplus, Mish, Clip, Hardmax.

Composite formulas run in float32 for float16 and bfloat16 inputs (``_float_op``) and are rounded
back once; Softplus never overflows exp, and Sigmoid's exp overflows only where the result is below
the normal floats (it is then 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from onnxtrain.engine.kernels.clamp import clamp, negative_part, relu_into
from onnxtrain.engine.kernels.elementwise import erf, reciprocal, select
from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel

_NATIVE = (np.dtype(np.float32), np.dtype(np.float64))

FloatFn = Callable[[np.ndarray, Attrs], np.ndarray]


def _float_op(op: str, since: int) -> Callable[[FloatFn], FloatFn]:
    """Register ``fn(x, attrs) -> y`` for ``op``; other float types are computed in float32."""

    def register(fn: FloatFn) -> FloatFn:
        def run(inputs: Inputs, attrs: Attrs) -> Outputs:
            x = inputs[0]
            if x.ndim == 0:  # the formulas' out= passes want arrays, not numpy scalars
                (y,) = run((x.reshape(1), *inputs[1:]), attrs)
                return (y.reshape(()),)
            if x.dtype in _NATIVE:
                return (np.asarray(fn(x, attrs)),)
            return (np.asarray(fn(x.astype(np.float32), attrs)).astype(x.dtype),)

        run.__name__ = fn.__name__
        kernel(op, since=since)(run)
        return fn

    return register


def logistic(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """1 / (1 + exp(-x)), computed as written: relatively accurate wherever the result is a normal float.
    Where exp(-x) overflows (x < -88.7 in float32, -709.8 in float64) the result is 0, the exact value
    being subnormal or less, as in onnx.reference; callers turn numpy's overflow warning off. Four
    passes; the overflow-free form exp(min(x, 0)) / (1 + exp(-|x|)) took seven, 2.3x the time (the LSTM
    gradient's gates, 614K values: 986 → 416 µs). Into ``out`` when given (it may be ``x``)."""
    r = np.negative(x, out=out)
    np.exp(r, out=r)
    r += 1
    reciprocal(r, out=r)
    return r


def sigmoid(x: np.ndarray) -> np.ndarray:
    """:func:`logistic` with numpy's overflow warning off."""
    with np.errstate(over="ignore"):
        return logistic(x)


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|))."""
    e = np.abs(x)
    np.negative(e, out=e)
    np.exp(e, out=e)
    np.log1p(e, out=e)
    e += relu_into(x)
    return e


@kernel("Relu", since=6)
def relu(inputs: Inputs, attrs: Attrs) -> Outputs:
    return (np.asarray(relu_into(inputs[0])),)


@kernel("Tanh", since=6)
def tanh(inputs: Inputs, attrs: Attrs) -> Outputs:
    return (np.asarray(np.tanh(inputs[0])),)


@_float_op("Sigmoid", since=6)
def _sigmoid(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    return sigmoid(x)


@_float_op("Softplus", since=1)
def _softplus(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    return softplus(x)


@_float_op("Softsign", since=1)
def _softsign(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    d = np.abs(x)
    d += 1
    return np.divide(x, d, out=d)


@_float_op("Mish", since=18)
def _mish(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    y = softplus(x)
    np.tanh(y, out=y)
    y *= x
    return y


# constants as ONNX's function bodies have them (float attributes are float32)
_GELU_C = math.sqrt(float(np.float32(2 / math.pi)))
_GELU_C3 = float(np.float32(0.044715)) * _GELU_C
_SIXTH = float(np.float32(1 / 6))


@_float_op("Gelu", since=20)
def _gelu(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    approximate = attrs["approximate"]
    if approximate == "none":  # x/2 * (1 + erf(x/sqrt(2)))
        y = erf(x * math.sqrt(0.5))
    elif approximate == "tanh":  # x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))
        y = x * x
        y *= _GELU_C3
        y += _GELU_C
        y *= x
        np.tanh(y, out=y)
    else:
        raise ValueError(f"Gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    y += 1
    y *= x
    y *= 0.5
    return y


@_float_op("LeakyRelu", since=6)
def _leaky_relu(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    alpha = attrs["alpha"]
    if 0.0 < alpha <= 1.0:  # alpha·x ≥ x exactly where x < 0 (alpha = 0 would turn +inf into max(inf, NaN))
        return np.maximum(x, x * alpha)
    # the spec's select, by bit masks: −0.0 (not < 0) stays −0.0, +inf stays +inf whatever alpha is
    return select(np.less(x, 0), x * alpha, x)


@kernel("PRelu", since=7)
def prelu(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, slope = inputs
    y = np.asarray(negative_part(x) * slope)  # slope * min(x, 0) + max(x, 0)
    if y.shape != x.shape:
        raise ValueError(f"PRelu: slope of shape {slope.shape} does not broadcast to X's shape {x.shape}")
    if not np.isfinite(slope).all():  # X > 0 gives X whatever the slope (0 · inf was nan), as onnxruntime
        np.copyto(y, x, where=np.asarray(x > 0))
        return (y,)
    y += relu_into(x)
    return (y,)


def _elu(x: np.ndarray, alpha: float) -> np.ndarray:
    """alpha * (exp(x) - 1) for x < 0, x otherwise: alpha * expm1(min(x, 0)) + max(x, 0)."""
    y = negative_part(x)
    np.expm1(y, out=y)
    y *= alpha
    y += relu_into(x)
    return y


@_float_op("Elu", since=6)
def _elu_op(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    return _elu(x, attrs["alpha"])


@_float_op("Selu", since=6)
def _selu(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    y = _elu(x, attrs["alpha"])
    y *= attrs["gamma"]
    return y


@_float_op("Celu", since=12)
def _celu(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    alpha = attrs["alpha"]  # max(0, x) + min(0, alpha * (exp(x / alpha) - 1))
    y = negative_part(x)
    y /= alpha
    np.expm1(y, out=y)
    y *= alpha
    y += relu_into(x)
    return y


def _unit_clamp(y: np.ndarray) -> np.ndarray:
    """min(max(y, 0), 1) in place by numpy's clip ufunc (:func:`clamp`): one vectorised pass, where
    ``maximum`` and ``minimum`` against a scalar take numpy's slow loops (614 K float32 values 454 -> 68 us).
    The same bits for a ``y`` that is never -0.0 (clip keeps it, ``maximum`` gives +0.0): callers add their
    offset as +0.0 at least, and a sum is -0.0 only when both its terms are."""
    t = y.dtype.type
    return clamp(y, t(0), t(1), out=y)


@_float_op("HardSigmoid", since=6)
def _hard_sigmoid(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    y = x * attrs["alpha"]
    y += attrs["beta"] + 0.0  # (a beta of -0.0 as +0.0: the same sums but for -0.0, which max(., 0) drops)
    return _unit_clamp(y)


@_float_op("HardSwish", since=14)
def _hard_swish(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    y = x * _SIXTH
    y += 0.5
    _unit_clamp(y)
    y *= x
    return y


@_float_op("ThresholdedRelu", since=10)
def _thresholded_relu(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    return select(np.greater(x, attrs["alpha"]), x, np.zeros((), x.dtype))  # (np.where's loop: 10-30x slower)


@kernel("Shrink", since=9)
def shrink(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    if x.dtype.itemsize < 4 and x.dtype.kind in "fV":  # float16/bfloat16: compared and shifted in float32, as
        # the float32 attributes ask (numpy would round lambd and bias to float16 first), rounded once
        (y,) = shrink([x.astype(np.float32)], attrs)
        return (y.astype(x.dtype),)
    lambd, bias = attrs["lambd"], attrs["bias"]
    lo, hi = np.less(x, -lambd), np.greater(x, lambd)  # (NaN compares False: it shrinks to 0)
    up, down = np.add(x, bias), np.subtract(x, bias)
    # selects by bit masks (numpy's where loop is 10-30x slower), the same bits as np.where
    y = select(lo, up, select(hi, down, np.zeros((), down.dtype)))
    return (y if y.dtype == x.dtype else y.astype(x.dtype),)


@kernel("Clip", since=6)
def clip_6(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    lo, hi = attrs["min"], attrs["max"]
    if x.dtype.kind == "f" and x.dtype.itemsize < 4:  # the float32 default bounds overflow float16
        fi = np.finfo(x.dtype)
        lo, hi = max(lo, float(fi.min)), min(hi, float(fi.max))
    return (np.asarray(clamp(x, x.dtype.type(lo), x.dtype.type(hi))),)


@kernel("Clip", since=11)
def clip(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    lo = inputs[1] if len(inputs) > 1 else None
    hi = inputs[2] if len(inputs) > 2 else None
    if lo is None and hi is None:
        return (x,)
    y = clamp(x, lo, hi)
    return (y if type(y) is np.ndarray else np.asarray(y),)


def _one_hot_max(x: np.ndarray, axis: int) -> np.ndarray:
    """1 at the first maximum along ``axis``, 0 elsewhere."""
    if x.size == 0:
        return np.zeros_like(x)
    first = np.expand_dims(np.argmax(x, axis=axis), axis)
    iota = np.arange(x.shape[axis]).reshape([-1 if d == axis else 1 for d in range(x.ndim)])
    return (iota == first).astype(x.dtype)


def _check_rank(x: np.ndarray) -> None:
    if not x.ndim:
        raise ValueError("Hardmax: the input must have rank >= 1 (it is a scalar)")


@kernel("Hardmax", since=1)
def hardmax_1(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]  # opsets 1-11: flatten to 2-D at ``axis``, one max per row
    _check_rank(x)
    axis = attrs["axis"] + (x.ndim if attrs["axis"] < 0 else 0)
    flat = x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))
    return (_one_hot_max(flat, 1).reshape(x.shape),)


@kernel("Hardmax", since=13)
def hardmax(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    axis = attrs["axis"]
    _check_rank(x)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"Hardmax: axis {axis} is out of range for rank {x.ndim}")
    return (_one_hot_max(x, axis % x.ndim),)
