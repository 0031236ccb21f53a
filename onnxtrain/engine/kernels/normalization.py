"""Softmax, LogSoftmax and the normalizations (Layer, Batch, Instance, Group, Lp, MeanVariance, LRN).

Statistics of float16/bfloat16 inputs are computed in float32 (LayerNormalization's and
GroupNormalization's ``stash_type``); outputs keep the input dtype.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import helper

from onnxtrain.engine.kernels.buffering import call_with_buffer, run_size
from onnxtrain.engine.kernels.elementwise import reciprocal
from onnxtrain.engine.kernels.reduce import channel_sum
from onnxtrain.engine.kernels.spread import spread, spread_shape
from onnxtrain.engine.parallel import for_rows
from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel
from onnxtrain.ir.attrs import mvn_axes

try:  # the C function np.einsum calls when not optimizing, without its dispatcher and Python wrapper
    from numpy._core.multiarray import c_einsum
except ImportError:  # pragma: no cover - a numpy laid out otherwise
    c_einsum = np.einsum

_F32 = np.dtype(np.float32)


def _is_low(dt: np.dtype) -> bool:
    return dt.itemsize < 4 and dt.kind in "fV"


def _work(x: np.ndarray) -> np.ndarray:
    """``x`` in a dtype good enough to accumulate statistics: float32 for half precision."""
    return x.astype(_F32) if _is_low(x.dtype) else x


def _back(y: np.ndarray, dt: np.dtype) -> np.ndarray:
    return y if y.dtype == dt else y.astype(dt)


# ---------------------------------------------------------------- row helpers
# numpy's add/maximum.reduce along a short contiguous last axis is slow (no SIMD across rows):
# einsum sums rows about 3x faster at the same accuracy. For the maximum of rows of a contiguous array,
# maximum.reduceat over the flat data beats maximum.reduce at every width (2.5x at 64 columns, 1.5x at
# 1000); below 64 columns, halving the rows down to 16 columns and then a column-by-column maximum is
# faster still (1.3x at 32).


LONG_ROW = 1 << 14  # columns from which rows are summed pairwise (einsum's partial sums drift: on rows of
# 2^20 values about 100 + U(0, 1), a relative error of 3.8e-6 against numpy's pairwise 3.5e-8, which made
# a LayerNorm over them 58 times less accurate than onnxruntime's; pairwise takes twice einsum's time there)


def row_sum(x2: np.ndarray) -> np.ndarray:
    """Sums of the rows of a 2-D array, shape (rows, 1)."""
    if x2.shape[1] >= LONG_ROW:
        return np.add.reduce(x2, axis=1, keepdims=True)
    return c_einsum("ij->i", x2)[:, None]


def row_dot(a2: np.ndarray, b2: np.ndarray) -> np.ndarray:
    """Sums of the rows of ``a2 * b2`` (2-D arrays of one shape), shape (rows,)."""
    if a2.shape[1] >= LONG_ROW:
        return np.add.reduce(a2 * b2, axis=1)
    return c_einsum("ij,ij->i", a2, b2)


def row_max(x2: np.ndarray) -> np.ndarray:
    """Maxima of the rows of a 2-D array, shape (rows, 1)."""
    n = x2.shape[1]
    if n == 0 or x2.shape[0] == 0:
        return np.max(x2, axis=1, keepdims=True)  # numpy's error for an empty reduction
    if n >= 64 and x2.flags.c_contiguous:
        flat = x2.reshape(-1)
        return np.maximum.reduceat(flat, np.arange(0, flat.size, n))[:, None]
    if n >= 128:
        return np.max(x2, axis=1, keepdims=True)
    m = x2
    while n > 16:  # halve the rows while they are long enough for SIMD
        h = n // 2
        nxt = np.maximum(m[:, :h], m[:, h : 2 * h])
        if n % 2:
            np.maximum(nxt[:, :1], m[:, 2 * h :], out=nxt[:, :1])
        m, n = nxt, h
    # then one column at a time: each call runs down all the rows at once
    r = m[:, 0].copy()
    for j in range(1, n):
        np.maximum(r, m[:, j], out=r)
    return r[:, None]


def _as_rows(x: np.ndarray, axis: int) -> np.ndarray | None:
    """``x`` as a 2-D view whose rows run along ``axis``, when ``axis`` is the last one."""
    if x.ndim and axis % x.ndim == x.ndim - 1 and x.flags.c_contiguous:
        return x.reshape(-1, x.shape[-1])
    return None


# ---------------------------------------------------------------- softmax


_EXP_HI, _EXP_LO = 80.0, -80.0  # e^80 ~ 5.5e34 < float32's max 3.4e38; e^-80 ~ 1.8e-35 > its min normal


def exp_is_safe(x: np.ndarray, n: int) -> bool:
    """True when the exp of every entry of ``x`` is a normal float32 or exactly 0 (the entry is -inf, as in
    a masked attention score) and no sum of ``n`` of them overflows: then softmax needs no shift by the row
    maximum. NaN and +inf answer False."""
    if not x.size or not float(x.max()) <= _EXP_HI - math.log(n):
        return False
    low = float(x.min())
    if low == -math.inf:  # masked entries: the others decide
        low = float(np.min(x, where=x > -np.inf, initial=np.inf))
    return low >= _EXP_LO


def softmax_along(x: np.ndarray, axis: int) -> np.ndarray:
    """softmax of ``x`` along ``axis``: exp(x) / sum(exp(x)) when no exp can overflow or underflow (then no
    rounding of x - max enters, and the row maxima are not needed), otherwise shifted by the row maximum."""
    if not x.size:  # nothing to normalize (an empty softmax axis has no maximum)
        return x.copy()
    n = x.shape[axis] if x.ndim else 1
    safe = exp_is_safe(x, n)
    x2 = _as_rows(x, axis)
    if x2 is not None:
        y2 = np.empty_like(x2)

        def rows(lo: int, hi: int) -> None:
            xb, yb = x2[lo:hi], y2[lo:hi]
            if safe:
                np.exp(xb, out=yb)
            else:
                _exp_shifted(xb, row_max(xb), out=yb)
            yb /= row_sum(yb)

        for_rows(x2.shape[0], x2.size, rows)
        return y2.reshape(x.shape)
    y = np.exp(x) if safe else _exp_shifted(x, np.max(x, axis=axis, keepdims=True))
    y /= np.sum(y, axis=axis, keepdims=True)
    return y


def _exp_shifted(x: np.ndarray, m: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """exp(x - m) in one array: ``out`` when given, else a new one."""
    y = np.subtract(x, m, out=out)
    return np.exp(y, out=y)


def log_softmax_along(x: np.ndarray, axis: int) -> np.ndarray:
    """log(softmax(x)) along ``axis``, computed as x - max - log(sum(exp(x - max))).

    Always shifted (unlike :func:`softmax_along`): x - log(sum(exp(x))) cancels for a row's dominant entry,
    whose log-probability near 0 (a confident prediction's loss) would lose its relative precision.
    """
    if not x.size:  # nothing to normalize (an empty softmax axis has no maximum)
        return x.copy()
    x2 = _as_rows(x, axis)
    if x2 is not None:
        y = np.subtract(x2, row_max(x2))
        s = row_sum(np.exp(y))
        y -= np.log(s, out=s)
        return y.reshape(x.shape)
    y = np.subtract(x, np.max(x, axis=axis, keepdims=True))
    s = np.sum(np.exp(y), axis=axis, keepdims=True)
    y -= np.log(s, out=s)
    return y


def _flat_2d(fn, inputs: Inputs, attrs: Attrs) -> Outputs:
    """Opset < 13: the input is seen as a 2-D matrix split at ``axis``; each row is normalized."""
    x = inputs[0]
    if not x.size:
        return (x.copy(),)
    axis = _axis(attrs["axis"], x.ndim)
    rows = math.prod(x.shape[:axis])
    w = _work(x)
    y = fn(w.reshape(rows, -1), 1).reshape(x.shape)
    return (_back(y, x.dtype),)


def _axis(axis: int, rank: int) -> int:
    """``axis`` in [0, rank), from [-rank, rank); a scalar input is refused, as ONNX's shape rule does."""
    if not rank:
        raise ValueError("the input must have rank >= 1 (it is a scalar)")
    if not -rank <= axis < rank:
        raise ValueError(f"axis {axis} is out of range for an input of rank {rank}")
    return axis % rank


@kernel("Softmax", since=1)
def softmax_2d(inputs: Inputs, attrs: Attrs) -> Outputs:
    return _flat_2d(softmax_along, inputs, attrs)


@kernel("Softmax", since=13)
def softmax(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    return (_back(softmax_along(_work(x), _axis(attrs["axis"], x.ndim)), x.dtype),)


@kernel("LogSoftmax", since=1)
def log_softmax_2d(inputs: Inputs, attrs: Attrs) -> Outputs:
    return _flat_2d(log_softmax_along, inputs, attrs)


@kernel("LogSoftmax", since=13)
def log_softmax(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    return (_back(log_softmax_along(_work(x), _axis(attrs["axis"], x.ndim)), x.dtype),)


# ---------------------------------------------------------------- row statistics


def _standardize_rows(x2: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For a 2-D ``x2``: ((x - mean) * inv_std, mean, inv_std), statistics over each row (keepdims)."""
    n = x2.shape[1]
    mean = row_sum(x2)
    mean /= n
    d = np.subtract(x2, mean)
    var = row_dot(d, d)[:, None]
    var /= n
    var += eps
    inv = np.sqrt(var, out=var)
    reciprocal(inv, out=inv)
    d *= inv
    return d, mean, inv


def _affine_rows(x2: np.ndarray, eps: float, scale: np.ndarray, bias: np.ndarray | None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_standardize_rows`, then times ``scale`` plus ``bias`` (flat, one value per column)."""
    y, mean, inv = _standardize_rows(x2, eps)
    y *= scale
    if bias is not None:
        y += bias
    return y, mean, inv


def _stash_type(stash_type: int | None) -> np.dtype:
    """The numpy dtype of a ``stash_type`` attribute (float32 when absent)."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(stash_type)) if stash_type else _F32


def _stash_dtype(x: np.ndarray, stash_type: int | None) -> np.dtype:
    """The dtype statistics are computed in: the stash type, or the input's when that is wider."""
    st = _stash_type(stash_type)
    return x.dtype if x.dtype.kind == "f" and x.dtype.itemsize >= st.itemsize else st


def _as_flat(p: np.ndarray, shape: tuple[int, ...], n: int) -> np.ndarray:
    """A scale/bias broadcastable to ``shape``, as a flat vector of ``n`` elements."""
    return p.reshape(n) if p.size == n else np.broadcast_to(p, shape).reshape(n)


@kernel("LayerNormalization", since=17)
def layer_normalization(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, scale = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    nd = x.ndim
    axis = attrs["axis"]
    if not -nd <= axis < nd:
        raise ValueError(f"LayerNormalization axis {axis} is out of range for a rank-{nd} input")
    axis %= nd
    inner = x.shape[axis:]
    cols = math.prod(inner)
    if not cols:
        raise ValueError(f"LayerNormalization normalizes X.shape[{axis}:] = {inner}, of no element; "
                         "it must hold at least one (onnxruntime refuses it too)")
    sdt = _stash_dtype(x, attrs.get("stash_type"))
    x2 = x.reshape(-1, cols).astype(sdt, copy=False)
    # (the per-row and per-column operands walk long rows in place, not through numpy's buffer: buffering.py)
    b = None if bias is None else _as_flat(bias, inner, cols)
    y, mean, inv = call_with_buffer(run_size(cols, x2.size), _affine_rows, x2, attrs["epsilon"],
                                    _as_flat(scale, inner, cols), b)
    outs: list[np.ndarray | None] = [_back(y.reshape(x.shape), x.dtype)]
    if attrs.n_outputs > 1:
        # Mean and InvStdDev are of the stash type (float32 by default) even when computed wider
        st = _stash_type(attrs.get("stash_type"))
        stat_shape = x.shape[:axis] + (1,) * (nd - axis)
        used = attrs.output_used
        outs.append(_back(mean.reshape(stat_shape), st) if used[1] else None)
        if attrs.n_outputs > 2:
            outs.append(_back(inv.reshape(stat_shape), st) if used[2] else None)
    return outs


# ---------------------------------------------------------------- batch / instance / group


def _per_channel(v: np.ndarray, x3: np.ndarray) -> np.ndarray:
    """The per-channel vector ``v`` as an operand of ``x3`` (N, C, L), of its dtype, laid out over the
    planes where that pays (:mod:`onnxtrain.engine.kernels.spread`)."""
    v = v.astype(x3.dtype, copy=False)[:, None]
    shape = spread_shape(v.shape, x3.shape)
    return v if shape is None else spread(v, shape)


def _as_ncl(w: np.ndarray) -> np.ndarray:
    """An (N, C, ...) array as (N, C, L); an empty one too (where -1 cannot be resolved)."""
    n, c = w.shape[0], w.shape[1]
    return w.reshape(n, c, -1) if w.size else w.reshape(n, c, math.prod(w.shape[2:]))


def _batch_norm_infer(x, scale, bias, mean, var, eps) -> np.ndarray:
    w = _work(x)
    # folded in the work type: half parameters folded in their own type put a half ulp of error on b
    scale, bias, mean, var = (np.asarray(v).astype(w.dtype, copy=False) for v in (scale, bias, mean, var))
    a = scale / np.sqrt(var + w.dtype.type(eps))
    b = bias - mean * a
    x3 = _as_ncl(w)
    y = np.multiply(x3, _per_channel(a, x3))
    y += _per_channel(b, x3)
    return _back(y.reshape(x.shape), x.dtype)


def _per_channel_sum(x3: np.ndarray, y3: np.ndarray | None = None) -> np.ndarray:
    """Sum over axes 0 and 2 of ``x3`` (N, C, L) (of ``x3 * y3`` when given), by rows (see row_sum)."""
    n, c, length = x3.shape
    if length == 1:
        return np.add.reduce(x3[:, :, 0] if y3 is None else x3[:, :, 0] * y3[:, :, 0], axis=0)
    fast = channel_sum(x3, y3)  # by BLAS (16 × 96 × 32² BatchNorm: 1,317 → 1,119 µs)
    if fast is not None:
        return fast
    x2 = x3.reshape(n * c, length)
    rows = row_sum(x2)[:, 0] if y3 is None else row_dot(x2, y3.reshape(n * c, length))
    return np.add.reduce(rows.reshape(n, c), axis=0)


def _batch_norm_train(x, scale, bias, eps) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Y from the batch statistics, plus the batch mean and (population) variance per channel (NaN for
    an empty batch, 0 / 0, as onnxruntime gives)."""
    w = _work(x)
    x3 = _as_ncl(w)
    count = x3.shape[0] * x3.shape[2]
    mean = _per_channel_sum(x3) / count
    d = np.subtract(x3, _per_channel(mean, x3))
    var = _per_channel_sum(d, d) / count
    d *= _per_channel(scale / np.sqrt(var + eps), x3)
    d += _per_channel(bias, x3)
    return _back(d.reshape(x.shape), x.dtype), mean, var


def _running(stat: np.ndarray, batch: np.ndarray, momentum: float) -> np.ndarray:
    """stat·momentum + batch·(1 − momentum), computed in the wider of the two types (float32 for float16
    statistics: in float16, with momentum rounded to it, a third of them came out 1 ulp off) and rounded once
    to ``stat``'s type."""
    wd = np.promote_types(stat.dtype, batch.dtype)
    r = stat.astype(wd, copy=False) * momentum
    r += batch.astype(wd, copy=False) * (1 - momentum)
    return r.astype(stat.dtype, copy=False)


@kernel("BatchNormalization", since=9)
def batch_normalization_9(inputs: Inputs, attrs: Attrs) -> Outputs:
    """Opsets 9-13: training mode when the optional outputs are requested."""
    x, scale, bias, mean, var = inputs[:5]
    if attrs.n_outputs == 1:
        return (_batch_norm_infer(x, scale, bias, mean, var, attrs["epsilon"]),)
    m = attrs["momentum"]
    y, bm, bv = _batch_norm_train(x, scale, bias, attrs["epsilon"])
    run_mean, run_var = _running(mean, bm, m), _running(var, bv, m)
    outs = [y, run_mean, run_var, bm.astype(mean.dtype, copy=False), bv.astype(var.dtype, copy=False)]
    return outs[: attrs.n_outputs]


def batch_norm_training(inputs: Inputs,
                        attrs: Attrs) -> tuple[list[np.ndarray | None], np.ndarray, np.ndarray]:
    """The outputs of a training-mode BatchNormalization of opset 14+, and the batch mean and (population)
    variance per channel they were made from, (C,) in the work type: the engine's fusion hands the two to
    the gradient's recomputation of them (:mod:`onnxtrain.engine.fusion.batch_stats`)."""
    x, scale, bias, mean, var = inputs[:5]
    y, bm, bv = _batch_norm_train(x, scale, bias, attrs["epsilon"])
    m = attrs["momentum"]
    used = attrs.output_used
    outs: list[np.ndarray | None] = [y]
    if attrs.n_outputs > 1:  # running_mean = input_mean * momentum + batch_mean * (1 - momentum)
        outs.append(_running(mean, bm, m) if used[1] else None)
    if attrs.n_outputs > 2:
        outs.append(_running(var, bv, m) if used[2] else None)
    return outs, bm, bv


@kernel("BatchNormalization", since=14)
def batch_normalization(inputs: Inputs, attrs: Attrs) -> Outputs:
    if not attrs["training_mode"]:
        x, scale, bias, mean, var = inputs[:5]
        return (_batch_norm_infer(x, scale, bias, mean, var, attrs["epsilon"]),)
    return batch_norm_training(inputs, attrs)[0]


@kernel("InstanceNormalization", since=6)
def instance_normalization(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, scale, bias = inputs[0], inputs[1], inputs[2]
    n, c = x.shape[0], x.shape[1]
    if not x.size:  # an empty batch (or no channels, or empty images): an empty Y
        return (np.empty(x.shape, x.dtype),)
    w = _work(x)
    y, _, _ = _standardize_rows(w.reshape(n * c, -1), attrs["epsilon"])
    y = y.reshape(n, c, -1)
    y *= scale.astype(y.dtype, copy=False)[:, None]
    y += bias.astype(y.dtype, copy=False)[:, None]
    return (_back(y.reshape(x.shape), x.dtype),)


def _group_norm(inputs: Inputs, attrs: Attrs, per_channel: bool) -> Outputs:
    x, scale, bias = inputs[0], inputs[1], inputs[2]
    g = attrs["num_groups"]
    n, c = x.shape[0], x.shape[1]
    if g is None or g <= 0 or c % g:
        raise ValueError(f"GroupNormalization: num_groups={g} must divide the {c} channels")
    low = _F32 if _is_low(x.dtype) else x.dtype
    sdt = _stash_dtype(x, attrs.get("stash_type")) if per_channel else low
    y, _, _ = _standardize_rows(x.reshape(n * g, -1).astype(sdt, copy=False), attrs["epsilon"])
    groups = c if per_channel else g  # opset 18: one scale/bias per group; 21: per channel
    y = y.reshape(n, groups, -1)
    y *= scale.astype(sdt, copy=False)[:, None]
    y += bias.astype(sdt, copy=False)[:, None]
    return (_back(y.reshape(x.shape), x.dtype),)


@kernel("GroupNormalization", since=18)
def group_normalization_18(inputs: Inputs, attrs: Attrs) -> Outputs:
    return _group_norm(inputs, attrs, per_channel=False)


@kernel("GroupNormalization", since=21)
def group_normalization(inputs: Inputs, attrs: Attrs) -> Outputs:
    return _group_norm(inputs, attrs, per_channel=True)


# ---------------------------------------------------------------- Lp / mean-variance


@kernel("LpNormalization", since=1)
def lp_normalization(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    p, axis = attrs["p"], attrs["axis"]
    w = _work(x)
    if p == 2:
        norm = np.sqrt(np.add.reduce(np.multiply(w, w), axis=axis, keepdims=True))
    elif p == 1:
        norm = np.add.reduce(np.abs(w), axis=axis, keepdims=True)
    else:
        raise ValueError(f"LpNormalization supports p=1 or p=2, got p={p}")
    norm[norm == 0] = np.inf  # a slice of norm 0 (all zero, or its squares underflow) gives 0, as onnxruntime
    return (_back(np.divide(w, norm), x.dtype),)


@kernel("MeanVarianceNormalization", since=9)
def mean_variance_normalization(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    # (onnxtrain.ir.attrs) an axis named twice (-1 and 3) once, as onnxruntime's ReduceMean takes it
    axes = tuple(dict.fromkeys(a + x.ndim if a < 0 else a for a in mvn_axes(attrs["axes"], x.ndim)))
    w = _work(x)
    d = np.subtract(w, np.mean(w, axis=axes, keepdims=True))
    std = np.sqrt(np.mean(np.multiply(d, d), axis=axes, keepdims=True))
    std += 1e-9  # the epsilon of the ONNX function body
    d /= std
    return (_back(d, x.dtype),)


# ---------------------------------------------------------------- local response


def _channel_window_sum(x: np.ndarray, before: int, after: int) -> np.ndarray:
    """out[:, c] = sum of x[:, c - before : c + after + 1] along axis 1, clipped to the channels."""
    c = x.shape[1]
    padded = np.zeros((x.shape[0], c + before + after, *x.shape[2:]), dtype=x.dtype)
    padded[:, before:before + c] = x
    out = padded[:, :c].copy()
    for k in range(1, before + after + 1):
        out += padded[:, k:k + c]
    return out


@kernel("LRN", since=1)
def lrn(inputs: Inputs, attrs: Attrs) -> Outputs:
    # Y = X / (bias + alpha/size * S)^beta, S[c] = sum of X[i]^2 over i in [c - (size-1)//2, c + size//2]
    x = inputs[0]
    size = attrs.get("size")
    if size is None or size < 1:
        raise ValueError(f"LRN: size must be a positive integer, got {size}")
    if x.ndim < 2:
        raise ValueError(f"LRN: the input must be (N, C, ...), got shape {list(x.shape)}")
    w = _work(x)
    s = _channel_window_sum(w * w, (size - 1) // 2, size // 2)
    d = s * (attrs["alpha"] / size) + attrs["bias"]
    return (_back(w / d ** attrs["beta"], x.dtype),)
