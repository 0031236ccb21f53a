"""Softmax, LogSoftmax and the normalizations (Layer, Batch, Instance, Group, Lp, MeanVariance).

Statistics of float16/bfloat16 inputs are computed in float32 (LayerNormalization's and
GroupNormalization's ``stash_type``); outputs keep the input dtype.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import helper

from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel

_F32 = np.dtype(np.float32)


def _is_low(dt: np.dtype) -> bool:
    return dt.itemsize < 4 and dt.kind in "fV"


def _work(x: np.ndarray) -> np.ndarray:
    """``x`` in a dtype good enough to accumulate statistics: float32 for half precision."""
    return x.astype(_F32) if _is_low(x.dtype) else x


def _back(y: np.ndarray, dt: np.dtype) -> np.ndarray:
    return y if y.dtype == dt else y.astype(dt)


# ---------------------------------------------------------------- softmax


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    y = np.subtract(x, np.max(x, axis=axis, keepdims=True))
    np.exp(y, out=y)
    y /= np.sum(y, axis=axis, keepdims=True)
    return y


def _log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    y = np.subtract(x, np.max(x, axis=axis, keepdims=True))
    s = np.sum(np.exp(y), axis=axis, keepdims=True)
    y -= np.log(s, out=s)
    return y


def _flat_2d(fn, inputs: Inputs, attrs: Attrs) -> Outputs:
    """Opset < 13: the input is seen as a 2-D matrix split at ``axis``; each row is normalized."""
    x = inputs[0]
    axis = attrs["axis"] % x.ndim
    rows = math.prod(x.shape[:axis])
    w = _work(x)
    y = fn(w.reshape(rows, -1), 1).reshape(x.shape)
    return (_back(y, x.dtype),)


@kernel("Softmax", since=1)
def softmax_2d(inputs: Inputs, attrs: Attrs) -> Outputs:
    return _flat_2d(_softmax, inputs, attrs)


@kernel("Softmax", since=13)
def softmax(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    return (_back(_softmax(_work(x), attrs["axis"]), x.dtype),)


@kernel("LogSoftmax", since=1)
def log_softmax_2d(inputs: Inputs, attrs: Attrs) -> Outputs:
    return _flat_2d(_log_softmax, inputs, attrs)


@kernel("LogSoftmax", since=13)
def log_softmax(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    return (_back(_log_softmax(_work(x), attrs["axis"]), x.dtype),)


# ---------------------------------------------------------------- row statistics


def _standardize_rows(x2: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For a 2-D ``x2``: ((x - mean) * inv_std, mean, inv_std), statistics over each row (keepdims)."""
    n = x2.shape[1]
    mean = np.add.reduce(x2, axis=1, keepdims=True)
    mean /= n
    d = np.subtract(x2, mean)
    sq = np.multiply(d, d)
    var = np.add.reduce(sq, axis=1, keepdims=True)
    var /= n
    var += eps
    inv = np.sqrt(var, out=var)
    np.reciprocal(inv, out=inv)
    d *= inv
    return d, mean, inv


def _stash_dtype(x: np.ndarray, stash_type: int | None) -> np.dtype:
    """The dtype statistics are computed in: the stash type, or the input's when that is wider."""
    st = np.dtype(helper.tensor_dtype_to_np_dtype(stash_type)) if stash_type else _F32
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
    sdt = _stash_dtype(x, attrs.get("stash_type"))
    x2 = x.reshape(-1, cols).astype(sdt, copy=False)
    y, mean, inv = _standardize_rows(x2, attrs["epsilon"])
    y *= _as_flat(scale, inner, cols)
    if bias is not None:
        y += _as_flat(bias, inner, cols)
    outs: list[np.ndarray | None] = [_back(y.reshape(x.shape), x.dtype)]
    if attrs.n_outputs > 1:
        stat_shape = x.shape[:axis] + (1,) * (nd - axis)
        used = attrs.output_used
        outs.append(mean.reshape(stat_shape) if used[1] else None)
        if attrs.n_outputs > 2:
            outs.append(inv.reshape(stat_shape) if used[2] else None)
    return outs


# ---------------------------------------------------------------- batch / instance / group


def _channel_shape(x: np.ndarray) -> tuple[int, ...]:
    """Shape that broadcasts a per-channel vector against ``x`` (N, C, ...)."""
    return (-1,) + (1,) * (x.ndim - 2)


def _batch_norm_infer(x, scale, bias, mean, var, eps) -> np.ndarray:
    w = _work(x)
    a = (scale / np.sqrt(var + eps)).astype(w.dtype, copy=False)
    b = (bias - mean * a).astype(w.dtype, copy=False)
    cs = _channel_shape(x)
    y = np.multiply(w, a.reshape(cs))
    y += b.reshape(cs)
    return _back(y, x.dtype)


def _batch_norm_train(x, scale, bias, eps) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Y from the batch statistics, plus the batch mean and (population) variance per channel."""
    w = _work(x)
    n, c = x.shape[0], x.shape[1]
    x3 = w.reshape(n, c, -1)
    count = x3.shape[0] * x3.shape[2]
    mean = np.add.reduce(x3, axis=(0, 2)) / count
    d = np.subtract(x3, mean[:, None])
    sq = np.multiply(d, d)
    var = np.add.reduce(sq, axis=(0, 2)) / count
    a = (scale / np.sqrt(var + eps)).astype(w.dtype, copy=False)
    d *= a[:, None]
    d += bias.astype(w.dtype, copy=False)[:, None]
    return _back(d.reshape(x.shape), x.dtype), mean, var


@kernel("BatchNormalization", since=9)
def batch_normalization_9(inputs: Inputs, attrs: Attrs) -> Outputs:
    """Opsets 9-13: training mode when the optional outputs are requested."""
    x, scale, bias, mean, var = inputs[:5]
    if attrs.n_outputs == 1:
        return (_batch_norm_infer(x, scale, bias, mean, var, attrs["epsilon"]),)
    m = attrs["momentum"]
    y, bm, bv = _batch_norm_train(x, scale, bias, attrs["epsilon"])
    run_mean = (mean * m + bm * (1 - m)).astype(mean.dtype, copy=False)
    run_var = (var * m + bv * (1 - m)).astype(var.dtype, copy=False)
    outs = [y, run_mean, run_var, bm.astype(mean.dtype, copy=False), bv.astype(var.dtype, copy=False)]
    return outs[: attrs.n_outputs]


@kernel("BatchNormalization", since=14)
def batch_normalization(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, scale, bias, mean, var = inputs[:5]
    eps = attrs["epsilon"]
    if not attrs["training_mode"]:
        return (_batch_norm_infer(x, scale, bias, mean, var, eps),)
    y, bm, bv = _batch_norm_train(x, scale, bias, eps)
    m = attrs["momentum"]
    used = attrs.output_used
    outs: list[np.ndarray | None] = [y]
    if attrs.n_outputs > 1:  # running_mean = input_mean * momentum + batch_mean * (1 - momentum)
        outs.append((mean * m + bm * (1 - m)).astype(mean.dtype, copy=False) if used[1] else None)
    if attrs.n_outputs > 2:
        outs.append((var * m + bv * (1 - m)).astype(var.dtype, copy=False) if used[2] else None)
    return outs


@kernel("InstanceNormalization", since=6)
def instance_normalization(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, scale, bias = inputs[0], inputs[1], inputs[2]
    n, c = x.shape[0], x.shape[1]
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
    if per_channel:
        sdt = _stash_dtype(x, attrs.get("stash_type"))
    else:
        sdt = _F32 if _is_low(x.dtype) else x.dtype
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
    norm[norm == 0] = 1  # an all-zero slice stays zero
    return (_back(np.divide(w, norm), x.dtype),)


@kernel("MeanVarianceNormalization", since=9)
def mean_variance_normalization(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    axes = tuple(attrs["axes"])
    w = _work(x)
    d = np.subtract(w, np.mean(w, axis=axes, keepdims=True))
    std = np.sqrt(np.mean(np.multiply(d, d), axis=axes, keepdims=True))
    std += 1e-9  # the epsilon of the ONNX function body
    d /= std
    return (_back(d, x.dtype),)
