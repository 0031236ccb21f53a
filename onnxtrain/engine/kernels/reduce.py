"""Reductions: ReduceSum, ReduceMean, ReduceMax/Min/Prod, ReduceL1/L2, ReduceSumSquare, ReduceLogSum(Exp).

Axes are an attribute before opset 18 (ReduceSum: before 13) and an optional second input after.
Empty ``axes`` reduce over everything unless ``noop_with_empty_axes`` is set, in which case the input
passes through. A reduction over an empty set gives the op's identity (0 for sums, 1 for products,
-inf for ReduceMax and the log-sums, +inf for ReduceMin). A scalar input is reduced (its one element)
whatever axes are given, as onnxruntime does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from onnxtrain.engine.kernels.half_cast import to_single
from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel

_NOOP = "noop"


def _attr_axes(attrs: Attrs) -> tuple[int, ...] | None | str:
    """Axes from the ``axes`` attribute, parsed once."""
    cache = attrs.cache
    if "axes" not in cache:
        axes = attrs.get("axes")
        if axes:
            cache["axes"] = tuple(int(a) for a in axes)
        else:
            cache["axes"] = _NOOP if attrs.get("noop_with_empty_axes") else None
    return cache["axes"]


def _input_axes(axes: Any, attrs: Attrs) -> tuple[int, ...] | None | str:
    """Axes from the optional ``axes`` input."""
    if axes is None or axes.size == 0:
        return _NOOP if attrs["noop_with_empty_axes"] else None
    return tuple(axes.reshape(-1).tolist())


def _checked_axes(axes: tuple[int, ...], nd: int) -> tuple[int, ...]:
    """``axes``, each in [-nd, nd) (the fast paths below wrap them), an axis given twice reduced once (as
    onnxruntime reduces it; numpy refuses it)."""
    seen: dict[int, None] = {}
    for a in axes:
        if not -nd <= a < nd:
            raise ValueError(f"axes {list(axes)}: axis {a} is out of range for an input of rank {nd} "
                             f"(valid: {-nd} to {nd - 1})")
        seen[a % nd] = None
    return axes if len(seen) == len(axes) else tuple(seen)


def _work(x: np.ndarray) -> np.ndarray:
    """float16/bfloat16 accumulate in float32."""
    return to_single(x) if x.dtype.kind in "fV" and x.dtype.itemsize < 4 else x


def _fill(x: np.ndarray, axes: tuple[int, ...] | None, keepdims: bool, value: Any) -> np.ndarray:
    """The result of reducing an empty set: ``value`` in the reduced shape."""
    nd = x.ndim
    red = set(range(nd)) if axes is None else {a % nd for a in axes} if nd else set()
    shape = [1 if i in red else d for i, d in enumerate(x.shape) if keepdims or i not in red]
    return np.full(shape, value, dtype=x.dtype)


def _finish(y: Any, dt: np.dtype) -> np.ndarray:
    if isinstance(y, np.ndarray) and y.dtype == dt:
        return y
    return np.asarray(y).astype(dt, copy=False)


Reducer = Callable[[np.ndarray, Any, bool], Any]


def _register(op: str, attr_until: int, fn: Reducer, empty: Any = None, plain: bool = True,
              fast: Callable[[Any, Any, Any], np.ndarray | None] | None = None,
              whole: Callable[[Any, Attrs], np.ndarray | None] | None = None) -> None:
    """Register ``op``: axes attribute for opsets < ``attr_until``, axes input from then on.

    ``fn(x, axes, keepdims)`` does the reduction; ``empty`` (a value or a callable of the dtype)
    is the result over an empty set, when numpy would raise or differ. With no axes and
    ``noop_with_empty_axes``, a ``plain`` reduction passes its input through; the others still
    apply their elementwise part (ReduceL1 gives |x|, ReduceLogSum log x), as their ONNX
    function bodies do. ``fast(x, axes input, keepdims)``, when given, is tried first on the axes-input
    form: its result, or None to take the general path; ``whole(x, attrs)`` likewise when that form has no
    axes input.
    """

    def run(x: np.ndarray, axes: Any, keepdims: bool) -> Outputs:
        if axes is _NOOP:
            if plain:
                return (x,)
            axes = ()
        elif axes is not None:
            # a scalar has its one element reduced whatever the axes, as onnxruntime reduces it (a Squeeze of
            # a batch of one, then a reduction over the batch axis)
            axes = _checked_axes(axes, x.ndim) if x.ndim else None
        if x.size == 0 and empty is not None:
            return (_fill(x, axes, keepdims, empty(x.dtype) if callable(empty) else empty),)
        return (_finish(fn(x, axes, keepdims), x.dtype),)

    def with_attr(inputs: Inputs, attrs: Attrs) -> Outputs:
        return run(inputs[0], _attr_axes(attrs), bool(attrs["keepdims"]))

    def with_input(inputs: Inputs, attrs: Attrs) -> Outputs:
        axes = inputs[1] if len(inputs) > 1 else None
        if fast is not None and axes is not None:
            y = fast(inputs[0], axes, attrs["keepdims"])
            if y is not None:
                return (y,)
        elif whole is not None and axes is None:
            y = whole(inputs[0], attrs)
            if y is not None:
                return (y,)
        return run(inputs[0], _input_axes(axes, attrs), bool(attrs["keepdims"]))

    with_attr.__name__ = f"{op.lower()}_axes_attr"
    with_input.__name__ = f"{op.lower()}_axes_input"
    kernel(op, since=1)(with_attr)
    kernel(op, since=attr_until)(with_input)


_BLAS_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
BLAS_SUM_MIN = 1 << 14  # elements: below, a sum by numpy (or einsum) is as fast as one by BLAS


def _last_axis_sum(w: np.ndarray, axes: Any, keepdims: bool) -> np.ndarray | None:
    """Float sum over just the last axis of a contiguous array: a BLAS product with ones for float32/64
    (2048 × 128 in the transformer's LayerNorm gradients: the step's ReduceSums and ReduceMeans 2.1 → 1.7
    ms, medians of five profiles), else einsum (about 3x faster than np.sum on short rows, as accurate);
    None when that does not apply."""
    nd = w.ndim
    if (nd < 2 or axes is None or len(axes) != 1 or axes[0] % nd != nd - 1 or w.dtype.kind != "f"
            or not w.flags.c_contiguous):
        return None
    if w.dtype in _BLAS_FLOATS and w.size >= BLAS_SUM_MIN:
        y = (w.reshape(-1, w.shape[-1]) @ np.ones(w.shape[-1], w.dtype)).reshape(w.shape[:-1])
    else:
        y = np.einsum("...i->...", w)
    return y[..., None] if keepdims else y


def _leading_axes_sum(w: np.ndarray, axes: Any, keepdims: bool) -> np.ndarray | None:
    """Float32/64 sum over the leading axes of a contiguous array (a bias's gradient) as a BLAS
    matrix-vector product with ones: 2.4x faster than numpy's row-by-row accumulation on the
    transformer's 2048 × 512, and more accurate (BLAS keeps several partial sums); numpy's own sum below
    :data:`BLAS_SUM_MIN` values; None for other sums."""
    nd = w.ndim
    if axes is None or not axes or nd < 2 or w.dtype not in _BLAS_FLOATS or not w.flags.c_contiguous:
        return None
    lead = sorted(a % nd for a in axes)
    k = len(lead)
    if lead != list(range(k)) or k == nd:
        return None
    return _sum_leading(w, k, keepdims)


_AXIS0 = (0,)


def _sum_leading(w: np.ndarray, k: int, keepdims: bool) -> np.ndarray:
    """The sum over the first ``k`` axes of a contiguous float32/64 array (the callers check that): numpy's
    own sum below :data:`BLAS_SUM_MIN` values (as np.sum computes it), else a product with ones."""
    if w.size < BLAS_SUM_MIN:
        return np.add.reduce(w, axis=_AXIS0 if k == 1 else tuple(range(k)), dtype=w.dtype, keepdims=keepdims)
    if k == 1 and w.ndim == 2:  # (a bias's gradient, in each training step: no reshapes)
        y = _ones(w.shape[0], w.dtype) @ w
        return y.reshape(1, -1) if keepdims else y
    rows = math.prod(w.shape[:k])
    y = _ones(rows, w.dtype) @ w.reshape(rows, -1)
    return y.reshape((1,) * k + w.shape[k:] if keepdims else w.shape[k:])


def _ones(rows: int, dtype: np.dtype) -> np.ndarray:
    """A read-only vector of ``rows`` ones (kept for the last few row counts and dtypes)."""
    key = (rows, dtype)
    ones = _ONES.get(key)
    if ones is None:
        if len(_ONES) >= 16:
            _ONES.clear()
        ones = _ONES[key] = np.ones(rows, dtype)
        ones.flags.writeable = False
    return ones


_ONES: dict[tuple[int, np.dtype], np.ndarray] = {}


def _bias_sum(x: Any, axes: Any, keepdims: Any) -> np.ndarray | None:
    """ReduceSum of a non-empty, contiguous 2-D float32/64 array over axis 0 given as a one-value int64 axes
    input (each bias's gradient in a training step), as :func:`_leading_axes_sum` computes it, without the
    general path's axes parsing and checks (5-10 µs of each such step out of cache); None for any other
    call."""
    if (type(x) is not np.ndarray or x.ndim != 2 or type(axes) is not np.ndarray or axes.dtype != _I64
            or axes.size != 1 or x.dtype not in _BLAS_FLOATS or not x.size or not x.flags.c_contiguous
            or axes.item() not in (0, -2)):
        return None
    return _sum_leading(x, 1, bool(keepdims))


_I64 = np.dtype(np.int64)


def _whole_sum(x: Any, attrs: Attrs) -> np.ndarray | None:
    """ReduceSum of a non-empty float32/64 array over every axis (no axes input, ``noop_with_empty_axes``
    unset: the count of a loss gradient's ignore mask), as the general path sums it (numpy's own reduction),
    without its axes handling (3-5 µs out of cache in a training step); None for any other call."""
    if (type(x) is not np.ndarray or x.dtype not in _BLAS_FLOATS or not x.size
            or attrs["noop_with_empty_axes"]):
        return None
    return np.asarray(np.add.reduce(x, axis=None, dtype=x.dtype, keepdims=bool(attrs["keepdims"])))


def channel_sum(w: np.ndarray, other: np.ndarray | None = None) -> np.ndarray | None:
    """Per-channel sums of a contiguous float32/64 (N, C, ...) array, or of its product with ``other`` (of the
    same shape): each (image, channel) row by BLAS (a product with ones, or the rows' dot products; einsum
    when small), then over the images. 3-6x faster than numpy's reduction at MobileNet's sizes (16 × 96 ×
    32²: 258 → 48 µs), as accurate. None for other arrays."""
    if w.ndim < 3 or w.dtype not in _BLAS_FLOATS or not w.flags.c_contiguous:
        return None
    n, c = w.shape[:2]
    if n * c == 0:  # no (image, channel) rows: the sums over no images, or no channels
        return np.zeros(c, w.dtype)
    flat = w.reshape(n * c, -1)
    if other is not None:
        o = other.reshape(n * c, -1)
        rows = np.vecdot(flat, o) if w.size >= BLAS_SUM_MIN else np.einsum("ij,ij->i", flat, o)
    else:
        rows = flat @ np.ones(flat.shape[1], w.dtype) if w.size >= BLAS_SUM_MIN else np.einsum("ij->i", flat)
    return np.add.reduce(rows.reshape(n, c), axis=0)


def channel_axes_sum(w: np.ndarray, axes: Any, keepdims: bool,
                     other: np.ndarray | None = None) -> np.ndarray | None:
    """:func:`channel_sum` (of ``w`` or of ``w·other``) when ``axes`` are every axis but 1 (BatchNorm's
    statistics and their gradients), shaped as the reduction's result; None otherwise."""
    if (axes is None or not all(-w.ndim <= a < w.ndim for a in axes)  # (out of range: the caller's error)
            or sorted(a % w.ndim for a in axes) != [0, *range(2, w.ndim)]):
        return None
    y = channel_sum(w, other)
    return y if y is None or not keepdims else y.reshape((1, w.shape[1]) + (1,) * (w.ndim - 2))


def _sum(x: np.ndarray, axes: Any, keepdims: bool) -> Any:
    w = _work(x)
    y = _last_axis_sum(w, axes, keepdims)
    if y is None:
        y = _leading_axes_sum(w, axes, keepdims)
    if y is None:
        y = channel_axes_sum(w, axes, keepdims)
    if y is None:  # np.sum's own reduction, without its Python wrapper (10 µs of a small sum in a step)
        y = np.add.reduce(w, axis=None if axes is None else tuple(axes), dtype=w.dtype, keepdims=keepdims)
    return y


def empty_mean(w: np.ndarray, axes: Any, keepdims: bool = False) -> np.ndarray:
    """The mean of an empty ``w`` over ``axes`` (all when None): NaN for each mean over no value, computed
    as 0 / 0 quietly (``np.mean`` warns)."""
    count = w.size if axes is None else int(np.prod([w.shape[a] for a in np.atleast_1d(axes)]))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.true_divide(np.sum(w, axis=axes, keepdims=keepdims, dtype=w.dtype), count)


def _mean(x: np.ndarray, axes: Any, keepdims: bool) -> Any:
    if x.dtype.kind in "iu":  # (the mean of no integers is 0, as onnxruntime's: NaN cast back was garbage)
        return np.mean(x, axis=axes, keepdims=keepdims) if x.size else np.sum(x, axis=axes, keepdims=keepdims)
    w = _work(x)
    y = _last_axis_sum(w, axes, keepdims)
    if y is not None:
        y /= w.shape[-1]
        return y
    if not w.size:  # NaN where a mean is over no value, without numpy's "Mean of empty slice" warning
        return empty_mean(w, axes, keepdims)
    if axes is None or w.dtype.kind != "f":
        return np.mean(w, axis=axes, keepdims=keepdims, dtype=w.dtype)
    y = channel_axes_sum(w, axes, keepdims)
    if y is not None:
        y /= w.size // w.shape[1] if w.size else 0  # empty: NaN means, as the other paths give
        return y
    # np.mean's own sum and division, without its Python wrapper (a small mean costs 1.5 µs, not 4)
    ax = tuple(axes)
    y = np.add.reduce(w, axis=ax, keepdims=keepdims)
    count = math.prod(w.shape[a] for a in ax)
    return np.true_divide(y, count, out=y) if isinstance(y, np.ndarray) else y.dtype.type(y / count)


def _max(x: np.ndarray, axes: Any, keepdims: bool) -> Any:
    return np.max(x, axis=axes, keepdims=keepdims)


def _min(x: np.ndarray, axes: Any, keepdims: bool) -> Any:
    return np.min(x, axis=axes, keepdims=keepdims)


def _prod(x: np.ndarray, axes: Any, keepdims: bool) -> Any:
    w = _work(x)
    return np.prod(w, axis=axes, keepdims=keepdims, dtype=w.dtype)


def _l1(x: np.ndarray, axes: Any, keepdims: bool) -> Any:
    w = np.abs(_work(x))
    return np.sum(w, axis=axes, keepdims=keepdims, dtype=w.dtype)


SQUARES_ROW = 1024  # values per BLAS dot product in a whole-array sum of squares


def _all_sum_square(w: np.ndarray, axes: Any, keepdims: bool) -> Any:
    """Σ w² over every axis of a contiguous float32/64 array (a gradient's norm for clipping) as BLAS dot
    products over rows of :data:`SQUARES_ROW` values, then their pairwise sum: as accurate as numpy's
    pairwise sum of the squares (one dot product over everything was 40x less accurate over 2 M values), in
    one pass without the squares (512 × 784: 181 → 31 µs). None when that does not apply."""
    if w.dtype not in _BLAS_FLOATS or not w.flags.c_contiguous or w.size < BLAS_SUM_MIN:
        return None
    if axes is not None and sorted(a % w.ndim for a in axes) != list(range(w.ndim)):
        return None
    flat = w.reshape(-1)
    rows = flat.size // SQUARES_ROW
    head = flat[:rows * SQUARES_ROW].reshape(rows, SQUARES_ROW)
    total = np.add.reduce(np.vecdot(head, head))
    tail = flat[rows * SQUARES_ROW:]
    if tail.size:
        total = total + np.dot(tail, tail)
    total = w.dtype.type(total)
    return np.full((1,) * w.ndim, total, w.dtype) if keepdims else total


def _sum_square(x: np.ndarray, axes: Any, keepdims: bool) -> Any:
    w = _work(x)
    y = _all_sum_square(w, axes, keepdims)
    if y is not None:
        return y
    sq = np.multiply(w, w)
    return np.sum(sq, axis=axes, keepdims=keepdims, dtype=w.dtype)


def _l2(x: np.ndarray, axes: Any, keepdims: bool) -> Any:
    if x.dtype.kind in "iu":  # squares summed in float64, as onnxruntime's (int32 ones overflow from 46,341)
        w = x.astype(np.float64)
        return np.sqrt(np.sum(np.multiply(w, w, out=w), axis=axes, keepdims=keepdims))
    s = np.asarray(_sum_square(x, axes, keepdims))
    return np.sqrt(s, out=s) if s.ndim else np.sqrt(s)


def _log_sum(x: np.ndarray, axes: Any, keepdims: bool) -> Any:
    return np.log(_sum(x, axes, keepdims))


def _int_log_sum_exp(x: np.ndarray, axes: Any, keepdims: bool) -> np.ndarray:
    """Integer inputs, as onnxruntime computes them: the exps of x - max summed in the integer type (each
    partial sum truncated, so only the k entries equal to the maximum count), then max + log(k) in float64,
    truncated back to the integer type."""
    m = np.max(x, axis=axes, keepdims=True)
    k = np.sum(x == m, axis=axes, keepdims=True)
    y = m.astype(np.float64) + np.log(k)
    if not keepdims:
        y = y.reshape(()) if axes is None else np.squeeze(y, axis=axes)
    return y.astype(x.dtype)


def _log_sum_exp(x: np.ndarray, axes: Any, keepdims: bool) -> Any:
    if x.dtype.kind in "iu":
        return _int_log_sum_exp(x, axes, keepdims)
    if x.ndim == 0:  # log(exp(x)) by the same steps, on one element
        return _log_sum_exp(x.reshape(1), None, False)
    w = _work(x)
    m = np.max(w, axis=axes, keepdims=True)
    if m.dtype.kind == "f":
        m[~np.isfinite(m)] = 0  # all -inf (or an inf) in a slice: no shift
    e = np.subtract(w, m)
    np.exp(e, out=e)
    s = np.sum(e, axis=axes, keepdims=True, dtype=e.dtype)
    np.log(s, out=s)
    s += m
    if not keepdims:
        s = s.reshape(()) if axes is None else np.squeeze(s, axis=axes)
    return s


def _dtype_min(dt: np.dtype) -> Any:
    return False if dt.kind == "b" else np.iinfo(dt).min if dt.kind in "iu" else -np.inf


def _dtype_max(dt: np.dtype) -> Any:
    return True if dt.kind == "b" else np.iinfo(dt).max if dt.kind in "iu" else np.inf


_register("ReduceSum", 13, _sum, fast=_bias_sum, whole=_whole_sum)
_register("ReduceMean", 18, _mean)
_register("ReduceMax", 18, _max, empty=_dtype_min)
_register("ReduceMin", 18, _min, empty=_dtype_max)
_register("ReduceProd", 18, _prod, empty=1)
_register("ReduceL1", 18, _l1, plain=False)
_register("ReduceL2", 18, _l2, plain=False)
_register("ReduceSumSquare", 18, _sum_square, plain=False)
_register("ReduceLogSum", 18, _log_sum, empty=-np.inf, plain=False)
_register("ReduceLogSumExp", 18, _log_sum_exp, empty=-np.inf)
