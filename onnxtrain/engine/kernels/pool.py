"""Pooling kernels: MaxPool (with Indices), AveragePool, LpPool, their Global forms, and MaxUnpool.

Windowed pools pad the input once (with -inf / the dtype's minimum for max, 0 otherwise) and combine
one strided slice per kernel offset, so the Python loop runs over kernel positions, never pixels.
The geometry per input shape is cached in ``attrs.cache``.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from onnxtrain.engine.kernels.conv import explicit_pads, pad_input, spatial_attrs
from onnxtrain.engine.kernels.half import F32, in_float32, is_float, is_half
from onnxtrain.engine.kernels.reduce import empty_mean
from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel


def _pool_geometry(attrs: Attrs, xs: tuple[int, ...]) -> dict[str, Any]:
    nd = len(xs) - 2
    k = attrs.get("kernel_shape")
    if k is None or len(k) != nd:
        raise ValueError(f"kernel_shape {k} must list {nd} sizes for input shape {xs}")
    k = list(k)
    strides, dil = spatial_attrs(attrs, nd)
    in_sp = xs[2:]
    pb, pe = explicit_pads(attrs, in_sp, k, strides, dil)
    k_eff = [(k[i] - 1) * dil[i] + 1 for i in range(nd)]
    ceil_mode = bool(attrs.get("ceil_mode") or 0)
    out = []
    for i in range(nd):
        span = in_sp[i] + pb[i] + pe[i] - k_eff[i]
        o = (-(-span // strides[i]) if ceil_mode else span // strides[i]) + 1
        if ceil_mode and (o - 1) * strides[i] >= in_sp[i] + pb[i]:
            o -= 1  # the last window must start inside the input or the begin padding
        out.append(o)
    if min(out) < 0:  # (0: the window is one longer than the padded axis, an empty output as onnxruntime)
        raise ValueError(f"pool output would be empty: input {xs}, kernel {k}, pads {pb + pe}")
    sizes = [max((out[i] - 1) * strides[i] + k_eff[i], pb[i]) for i in range(nd)]
    # one (kernel index, slices into the padded input) per kernel offset
    offsets = []
    for kk in itertools.product(*(range(v) for v in k)):
        sl = tuple(slice(kk[i] * dil[i], kk[i] * dil[i] + (out[i] - 1) * strides[i] + 1, strides[i])
                   for i in range(nd))
        offsets.append((kk, (Ellipsis,) + sl))
    return {"nd": nd, "k": k, "strides": strides, "dil": dil, "pb": pb, "pe": pe, "sizes": sizes,
            "out": out, "offsets": offsets, "in": list(in_sp)}


def _geometry(attrs: Attrs, x: np.ndarray) -> dict[str, Any]:
    g = attrs.cache.get(x.shape)
    if g is None:
        g = attrs.cache[x.shape] = _pool_geometry(attrs, x.shape)
    return g


def _lowest(dtype: np.dtype) -> Any:
    return -np.inf if is_float(dtype) else np.iinfo(dtype).min  # bfloat16's kind is 'V'


def _counts(g: dict[str, Any], include_pad: bool) -> np.ndarray:
    """How many window elements each output position averages over, shape ``out``."""
    total = np.ones((), dtype=np.int64)
    for i in range(g["nd"]):
        pos = (np.arange(g["out"][i])[:, None] * g["strides"][i]
               + np.arange(g["k"][i])[None, :] * g["dil"][i])  # positions in padded coordinates
        lo, hi = g["pb"][i], g["pb"][i] + g["in"][i]
        if include_pad:  # explicit padding counts; a ceil-mode overhang beyond it does not
            lo, hi = 0, hi + g["pe"][i]
        total = np.multiply.outer(total, ((pos >= lo) & (pos < hi)).sum(axis=1))
    return total


def _window_sum(xp: np.ndarray, g: dict[str, Any]) -> np.ndarray:
    offs = g["offsets"]
    acc = xp[offs[0][1]].copy()
    for _, sl in offs[1:]:
        acc += xp[sl]
    return acc


@kernel("MaxPool", since=1)
def max_pool(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    g = _geometry(attrs, x)
    xp = pad_input(x, g["pb"], g["sizes"], _lowest(x.dtype))
    offs = g["offsets"]
    want_idx = attrs.n_outputs > 1 and attrs.output_used[1]
    y = xp[offs[0][1]].copy()
    if not want_idx:
        for _, sl in offs[1:]:
            np.maximum(y, xp[sl], out=y)
        return (y,)
    koff, base = _index_tables(attrs, g, x.shape)
    # which kernel offset holds each window's maximum, as a small code: offsets come in increasing order,
    # so "offset j is strictly greater" is code = max(code, better * j); one gather of the flat offsets
    # and one add of the window bases at the end (1.3-1.4x faster than keeping int64 indices throughout)
    ct = np.uint8 if len(offs) <= 256 else np.uint16 if len(offs) <= 65536 else np.int64
    code = np.zeros(y.shape, dtype=ct)
    staged = np.empty_like(y)  # each offset's strided window copied once, then read twice contiguously
    # (LeNet's 2×2 pools with indices, the loop alone: 0.32 → 0.25 ms for 64 × 6 × 28², 0.16 → 0.13 at 10²)
    for j, (_, sl) in enumerate(offs[1:], start=1):
        v = xp[sl]
        if not v.flags.c_contiguous:
            np.copyto(staged, v)
            v = staged
        better = np.greater(v, y)  # strict: the first maximum in row-major window order wins
        np.maximum(y, v, out=y)
        np.maximum(code, np.multiply(better, ct(j), dtype=ct), out=code)
    no_real = None
    if y.size:
        low = np.min(y)  # one pass; the two rare cases below only where it says so
        nan = is_float(y.dtype) and bool(np.isnan(low))
        if nan:
            _last_nan_window(xp, y, code, g)
        if (any(g["pb"]) or any(g["pe"])) and (nan or low <= _lowest(x.dtype)):
            no_real = _first_real_where_lowest(x, y, code, g)
    idx = np.take(np.asarray(koff, dtype=np.int64), code)
    idx += base
    if no_real is not None:
        idx[no_real] = -1  # a window wholly in the padding has no element to point at
    return (y, idx)


def _last_nan_window(xp: np.ndarray, y: np.ndarray, code: np.ndarray, g: dict[str, Any]) -> None:
    """In place: a window holding a NaN has a NaN maximum (np.maximum propagates it) and its index is that of
    its last NaN in row-major order, as torch's max_pool (which takes every NaN it meets; the gradient goes
    there); the comparisons of the main loop had left the index at the maximum before the first."""
    sel = np.nonzero(np.isnan(y))
    pick = code[sel]
    for j, (_, sl) in enumerate(g["offsets"]):
        pick[np.isnan(xp[sl][sel])] = j
    code[sel] = pick


def _first_real_where_lowest(x: np.ndarray, y: np.ndarray, code: np.ndarray,
                             g: dict[str, Any]) -> tuple[np.ndarray, ...] | None:
    """In place: a padded window whose maximum is the padding's own lowest value (its real values all -inf)
    takes its first real position, as onnxruntime's Indices, not the first padded one (only such windows can
    have picked the padding: any higher value is a real one). Returns the windows with no real position
    (wholly in the padding, with dilations), or None."""
    sel = np.nonzero(y == _lowest(x.dtype))
    if not sel[0].size:
        return None
    inside = pad_input(np.ones(x.shape, bool), g["pb"], g["sizes"], False)
    found = np.zeros(sel[0].size, bool)
    pick = np.zeros(sel[0].size, code.dtype)
    for j, (_, sl) in enumerate(g["offsets"]):
        real = inside[sl][sel] & ~found
        pick[real] = j
        found |= real
    code[sel] = pick
    return tuple(a[~found] for a in sel) if not found.all() else None


def _index_tables(attrs: Attrs, g: dict[str, Any], xs: tuple[int, ...]) -> tuple[list[int], np.ndarray]:
    """Flat-index parts of MaxPool's Indices: per kernel offset, and per (n, c, output position)."""
    key = ("idx", xs)
    t = attrs.cache.get(key)
    if t is not None:
        return t
    nd, in_sp = g["nd"], xs[2:]
    mult = [int(np.prod(in_sp[i + 1:])) for i in range(nd)]  # row-major spatial strides
    if int(attrs.get("storage_order") or 0) == 1:
        mult = [int(np.prod(in_sp[:i])) for i in range(nd)]  # column-major
    koff = [sum(kk[i] * g["dil"][i] * mult[i] for i in range(nd)) for kk, _ in g["offsets"]]
    base = np.zeros((), dtype=np.int64)
    for i in range(nd):
        start = np.arange(g["out"][i], dtype=np.int64) * g["strides"][i] - g["pb"][i]
        base = np.add.outer(base, start * mult[i])
    nc = np.arange(xs[0] * xs[1], dtype=np.int64).reshape(xs[:2] + (1,) * nd) * int(np.prod(in_sp))
    t = attrs.cache[key] = (koff, base + nc)
    return t


@kernel("AveragePool", since=1)
def average_pool(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    g = _geometry(attrs, x)
    if is_half(x.dtype):  # sum in float32, divide by the count there, round once (as ONNX and ORT)
        s = _window_sum(pad_input(x.astype(F32), g["pb"], g["sizes"]), g)
        key = ("cnt", x.shape)
        cnt = attrs.cache.get(key)
        if cnt is None:
            cnt = attrs.cache[key] = _counts(g, bool(attrs.get("count_include_pad") or 0)).astype(F32)
        s /= cnt
        return (s.astype(x.dtype),)
    xp = pad_input(x, g["pb"], g["sizes"])
    s = _window_sum(xp, g)
    key = ("div", x.shape, x.dtype)
    div = attrs.cache.get(key)
    if div is None:
        cnt = _counts(g, bool(attrs.get("count_include_pad") or 0))
        div = attrs.cache[key] = (1.0 / cnt).astype(x.dtype)
    s *= div
    return (s,)


@kernel("LpPool", since=1)
def lp_pool(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    if is_half(x.dtype):  # powers and sums in float32 (x² of float16 overflows from 256), rounded once
        return in_float32(lp_pool, inputs, attrs)
    p = float(attrs.get("p") or 2)
    g = _geometry(attrs, x)
    a = x * x if p == 2 else np.abs(x) ** np.asarray(p, dtype=x.dtype)
    s = _window_sum(pad_input(a, g["pb"], g["sizes"]), g)
    return (np.sqrt(s, out=s) if p == 2 else s ** np.asarray(1.0 / p, dtype=x.dtype),)


def _spatial_axes(x: np.ndarray) -> tuple[int, ...]:
    return tuple(range(2, x.ndim))


@kernel("GlobalAveragePool", since=1)
def global_average_pool(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    if is_half(x.dtype):  # np.mean of bfloat16 would accumulate in bfloat16
        return in_float32(global_average_pool, inputs, attrs)
    axes = _spatial_axes(x)
    mean = empty_mean(x, axes, True) if not x.size else np.mean(x, axis=axes, keepdims=True)
    return (np.asarray(mean, dtype=x.dtype),)


@kernel("GlobalMaxPool", since=1)
def global_max_pool(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    return (np.asarray(np.max(x, axis=_spatial_axes(x), keepdims=True)),)


@kernel("GlobalLpPool", since=2)
def global_lp_pool(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    if is_half(x.dtype):  # x² of float16 overflows from 256; np.sum of bfloat16 sums in bfloat16
        return in_float32(global_lp_pool, inputs, attrs)
    p = float(attrs.get("p") or 2)
    ax = _spatial_axes(x)
    if p == 2:
        s = np.sqrt(np.sum(x * x, axis=ax, keepdims=True))
    else:
        s = np.sum(np.abs(x) ** p, axis=ax, keepdims=True) ** (1.0 / p)
    return (np.asarray(s, dtype=x.dtype),)


@kernel("MaxUnpool", since=9)
def max_unpool(inputs: Inputs, attrs: Attrs) -> Outputs:
    # Y = zeros, Y.flat[I] = X. Without output_shape Y has the size MaxPool's input would have (from the
    # attributes); with it, Y has that shape (pads are then ignored) and the indices address it, as the
    # ONNX spec ("indices in [0, N x C x D1 x ... x Dn)") and onnxruntime read it (onnx.reference instead
    # scatters into the attribute size and pads at the end, which fails on MaxPool's indices).
    x, idx = inputs[0], inputs[1]
    nd = x.ndim - 2
    k = list(attrs.get("kernel_shape") or [])
    if len(k) != nd:
        raise ValueError(f"kernel_shape {k} must list {nd} sizes")
    if idx.shape != x.shape:
        raise ValueError(f"MaxUnpool indices of shape {idx.shape} must have X's shape {x.shape}")
    strides, _ = spatial_attrs(attrs, nd)
    pads = list(attrs.get("pads") or [0] * (2 * nd))
    shape = x.shape[:2] + tuple((x.shape[2 + i] - 1) * strides[i] + k[i] - pads[i] - pads[nd + i]
                                for i in range(nd))
    if len(inputs) > 2 and inputs[2] is not None:
        want = tuple(int(v) for v in np.asarray(inputs[2]).reshape(-1))
        if len(want) != x.ndim:
            raise ValueError(f"output_shape {list(want)} must list {x.ndim} sizes (X has shape {x.shape})")
        if int(np.prod(want)) < int(np.prod(shape)):
            raise ValueError(f"output_shape {list(want)} is smaller than the inferred shape {list(shape)}")
        shape = want
    size = int(np.prod(shape))
    y = np.zeros(size, dtype=x.dtype)
    try:  # (no range pass of its own: MaxPool's gradient runs this kernel on every step)
        y[idx.reshape(-1)] = x.reshape(-1)
    except IndexError as e:
        raise ValueError(f"MaxUnpool index out of range [0, {size}) for output shape {list(shape)}") from e
    return (y.reshape(shape),)
