"""Resize (opsets 10-19) and the deprecated Upsample, as separable per-axis resampling.

Each resized axis gets a small plan, built once per (shape, scales/sizes, roi) and cached: an index
vector for nearest mode (one ``np.take``), or a dense (out, in) weight matrix for linear/cubic modes
(one BLAS matmul), plus a mask of positions that take ``extrapolation_value`` (tf_crop_and_resize).
Coordinates and weights are computed in float64, as the ONNX reference does, then cast to X's dtype.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from onnxtrain.engine.kernels.finite import all_finite
from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel
from onnxtrain.user_warning import warn

_DENSE_LIMIT = 1 << 22  # beyond out*in entries, gather taps instead of a dense matrix


def _source_coords(mode: str, out_len: int, in_len: int, scale: float, roi: tuple[float, float] | None,
                   dtype: np.dtype | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Source coordinate of every output index, and the mask of positions outside the roi (``dtype``: the
    input's, whose precision half_pixel_symmetric's offset takes)."""
    y = np.arange(out_len, dtype=np.float64)
    width = scale * in_len  # the unrounded output length, as the ONNX reference uses it
    if mode == "half_pixel":
        return (y + 0.5) / scale - 0.5, None
    if mode == "pytorch_half_pixel":
        # an output of one element samples position 0, as the operator's text and onnxruntime say
        # (onnx.reference's code samples -0.5, which a cubic kernel reads apart from X[0])
        return (np.zeros(out_len) if out_len == 1 else (y + 0.5) / scale - 0.5), None
    if mode == "half_pixel_symmetric":
        # as onnxruntime computes it for inputs below float64: the offset in float32, the rest in float64,
        # the position rounded to float32 (in float64 throughout, the offset of 7 pixels at scale 0.5 lands
        # an ulp above 0.5, and output 3 of 5 pixels at scale 2.5 two ulps above 1.0: a nearest "ceil" then
        # takes the next pixel)
        f = np.float32 if dtype is not None and dtype != np.float64 else np.float64
        offset = f(in_len) / f(2) * (f(1) - f(out_len) / f(f(scale) * f(in_len)))
        x = float(offset) + (y + 0.5) / float(f(scale)) - 0.5
        return (x.astype(np.float32).astype(np.float64) if f is np.float32 else x), None
    if mode == "align_corners":
        if out_len > 1 and abs(width - out_len) > 1e-6 * out_len:
            _warn_unrounded(in_len, scale, width, out_len)
        return (np.zeros(out_len) if width == 1 else y * (in_len - 1) / (width - 1)), None
    if mode == "asymmetric":
        return y / scale, None
    if mode == "tf_half_pixel_for_nn":
        # Resize-11/12 only (tf2onnx), dropped from ONNX at 13 and from onnx.reference; onnxruntime, which
        # still runs it (also at 13+), defines it, in float32: (y + 0.5) / scale rounded as it does, so
        # that nearest modes round positions such as 1.5 / 0.6 the same way
        return ((y.astype(np.float32) + np.float32(0.5)) / np.float32(scale)).astype(np.float64), None
    if mode == "tf_crop_and_resize":
        # spaced by the output length, as the operator's text and onnxruntime (unlike align_corners, whose
        # ONNX test data spaces by the unrounded one, ONNX's tf_crop_and_resize data is given by sizes)
        lo, hi = roi if roi is not None else (0.0, 1.0)
        if out_len == 1:
            x = np.full(out_len, (hi - lo) * (in_len - 1) / 2)
        else:
            x = y * (hi - lo) * (in_len - 1) / (out_len - 1)
        x = x + lo * (in_len - 1)
        return x, (x < 0) | (x > in_len - 1)
    raise ValueError(f"unknown coordinate_transformation_mode {mode!r}")


def _warn_unrounded(in_len: int, scale: float, width: float, out_len: int) -> None:
    warn(f"Resize with align_corners: scale {scale:g} on an axis of {in_len} gives {width:g}, not a whole "
         f"length; as ONNX defines it (and its test data), positions are spaced by (length − 1)/({width:g} − "
         f"1), where onnxruntime and torch use the output length {out_len} ({out_len} − 1): the values "
         "differ from theirs. Give the output sizes instead of scales to get the same values everywhere "
         "(torch: F.interpolate(size=...)).")


def _nearest_index(x: np.ndarray, nearest_mode: str, in_len: int) -> np.ndarray:
    f = np.floor(x)
    frac = x - f
    if nearest_mode == "round_prefer_floor":
        up = frac > 0.5
    elif nearest_mode == "round_prefer_ceil":
        up = frac >= 0.5
    elif nearest_mode == "floor":
        up = np.zeros(x.shape, bool)
    elif nearest_mode == "ceil":
        up = frac > 0
    else:
        raise ValueError(f"unknown nearest_mode {nearest_mode!r}")
    return np.clip(f + up, 0, in_len - 1).astype(np.intp)


def _cubic(d: np.ndarray, a: float) -> np.ndarray:
    d = np.abs(d)
    d2, d3 = d * d, d * d * d
    near = (a + 2) * d3 - (a + 3) * d2 + 1
    far = a * d3 - 5 * a * d2 + 8 * a * d - 4 * a
    return np.where(d <= 1, near, np.where(d < 2, far, 0.0))


def _taps(x: np.ndarray, in_len: int, scale: float, attrs: Attrs, mode: str
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(indices, weights, reads), all (out, n): the input taps of each output position, clamped to the edge,
    and which of them the filter reads (None: all). An antialias filter stretched over a downsampled axis
    has taps past its support, and exclude_outside drops the taps off the image: both weigh 0, and an inf or
    NaN there must not reach the output."""
    antialias = bool(attrs.get("antialias") or 0)
    s = min(scale, 1.0) if antialias else 1.0  # antialias stretches the filter when downsampling
    radius = 1 if mode == "linear" else 2
    n = 2 * math.ceil(radius / s)
    j = np.floor(x)[:, None] + (1 - n // 2) + np.arange(n)[None, :]
    d = (j - x[:, None]) * s
    w = np.clip(1 - np.abs(d), 0, 1) if mode == "linear" else _cubic(d, float(attrs.get("cubic_coeff_a")))
    reads = np.abs(d) < radius if s < 1 else None
    if antialias:
        w = w / w.sum(axis=1, keepdims=True)
    if attrs.get("exclude_outside"):
        inside = (j >= 0) & (j < in_len)
        reads = inside if reads is None else reads & inside
        w = np.where(inside, w, 0.0)
        tot = w.sum(axis=1, keepdims=True)
        w = w / np.where(tot == 0, 1.0, tot)
    return np.clip(j, 0, in_len - 1).astype(np.intp), w, reads


def _axis_plan(attrs: Attrs, mode: str, in_len: int, out_len: int, scale: float,
               roi: tuple[float, float] | None, dtype: np.dtype) -> tuple[Any, ...]:
    x, outside = _source_coords(attrs["coordinate_transformation_mode"], out_len, in_len, scale, roi, dtype)
    if mode == "nearest":
        nearest = attrs["nearest_mode"]
        if nearest == "simple":  # Resize-10 / Upsample: rounds up when downsampling, down otherwise
            nearest = "ceil" if scale < 1 else "floor"
        return ("take", _nearest_index(x, nearest, in_len), outside)
    if mode not in ("linear", "cubic"):
        raise ValueError(f"unknown Resize mode {mode!r}")
    idx, w, reads = _taps(x, in_len, scale, attrs, mode)
    wdt = dtype if dtype.kind == "f" else np.dtype(np.float32)
    wt = w.astype(wdt)
    if out_len * in_len <= _DENSE_LIMIT:
        mat = _tap_matrix(idx, w, in_len)
        # the taps too: an X with an inf or NaN is resampled by them (see _apply)
        return ("dense", mat.astype(wdt), np.ascontiguousarray(mat.T).astype(wdt), idx, wt, reads, outside)
    return ("taps", idx, wt, reads, outside)


def _tap_matrix(idx: np.ndarray, w: np.ndarray, in_len: int) -> np.ndarray:
    """The (out, in) float64 matrix whose row i holds the weights ``w[i]`` at the taps ``idx[i]``
    (repeated taps add up)."""
    mat = np.zeros((idx.shape[0], in_len))
    np.add.at(mat, (np.repeat(np.arange(idx.shape[0]), idx.shape[1]), idx.ravel()), w.ravel())
    return mat


def _by_taps(x3: np.ndarray, idx: np.ndarray, w: np.ndarray, reads: np.ndarray | None) -> np.ndarray:
    """X laid (pre, in, post) resampled along axis 1 by the taps ``idx`` of weights ``w``, (out, n) each; with
    ``reads``, the taps it marks False add nothing (not even an inf or NaN times their zero weight)."""
    def tap(t: int) -> np.ndarray:
        part = np.take(x3, idx[:, t], axis=1) * w[:, t, None]
        if reads is not None:
            part[:, ~reads[:, t]] = 0
        return part

    y = tap(0)
    for t in range(1, idx.shape[1]):
        y += tap(t)
    return y


def _apply(x: np.ndarray, axis: int, plan: tuple[Any, ...], extrapolation: float) -> np.ndarray:
    kind = plan[0]
    if x.size == 0:  # nothing to sample (the reshapes below cannot infer a size from 0 values)
        n = len(plan[1]) if kind == "take" else plan[1].shape[0]
        return np.zeros(x.shape[:axis] + (n,) + x.shape[axis + 1:], x.dtype)
    if kind == "take":
        y = np.take(x, plan[1], axis=axis)
    else:
        pre = int(np.prod(x.shape[:axis]))
        post = int(np.prod(x.shape[axis + 1:]))
        xf = x if x.dtype.kind == "f" else x.astype(np.float32)
        idx, w, reads = plan[-4], plan[-3], plan[-2]
        x3 = xf.reshape(pre, -1, post)
        if kind == "dense":
            mat, mat_t = plan[1], plan[2]
            y = xf.reshape(pre, -1) @ mat_t if post == 1 else np.matmul(mat, x3)
            if not all_finite(y):
                # the matrix's zeros times an inf or NaN of X made NaN of outputs whose taps do not read it
                y = _by_taps(x3, idx, w, reads)
        else:
            y = _by_taps(x3, idx, w, None)
            if reads is not None and not all_finite(y):
                y = _by_taps(x3, idx, w, reads)
        y = y.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 1:])
    outside = plan[-1]
    if outside is not None and outside.any():
        shape = [1] * y.ndim
        shape[axis] = -1
        y = np.where(outside.reshape(shape), np.asarray(extrapolation, dtype=y.dtype), y)
    return y


def _to_dtype(y: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if y.dtype == dtype:
        return y
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.clip(np.rint(y), info.min, info.max).astype(dtype)
    return y.astype(dtype)


def _present(v: Any) -> bool:
    return v is not None and np.size(v) > 0


def _resize_plan(attrs: Attrs, xs: tuple[int, ...], dtype: np.dtype, roi: Any, scales: Any, sizes: Any
                 ) -> list[tuple[int, tuple[Any, ...]]]:
    r = len(xs)
    axes = attrs.get("axes")
    axes = list(range(r)) if axes is None else [a + r if a < 0 else a for a in axes]
    if len(set(axes)) != len(axes) or not all(0 <= a < r for a in axes):
        raise ValueError(f"bad axes {attrs.get('axes')} for rank {r}")
    scale = [1.0] * r
    out = list(xs)
    if _present(sizes):
        sizes = [int(v) for v in np.asarray(sizes).ravel()]
        if len(sizes) != len(axes):
            raise ValueError(f"sizes {sizes} must have {len(axes)} values")
        for a, v in zip(axes, sizes, strict=True):
            out[a] = v
            scale[a] = v / xs[a] if xs[a] else 1.0
        policy = attrs.get("keep_aspect_ratio_policy") or "stretch"
        if policy != "stretch":
            pick = {"not_larger": min, "not_smaller": max}.get(policy)
            if pick is None:
                raise ValueError(f"unknown keep_aspect_ratio_policy {policy!r}")
            common = pick(scale[a] for a in axes)
            for a in axes:
                scale[a] = common
                out[a] = int(common * xs[a] + 0.5)
    elif _present(scales):
        vals = [float(v) for v in np.asarray(scales).ravel()]
        if len(vals) != len(axes):
            raise ValueError(f"scales {vals} must have {len(axes)} values")
        if min(vals) <= 0:
            raise ValueError(f"scales {vals} must be positive")
        for a, v in zip(axes, vals, strict=True):
            scale[a] = v
            # in float32, as onnxruntime (and TensorFlow) size it: 3 · 1.6666666f is 5.0 there, where the
            # float64 product 4.99999988 floors to 4 (tf2onnx writes tf.image.resize to 5 rows as scale 5/3)
            out[a] = int(np.float32(v) * np.float32(xs[a]))
    else:
        raise ValueError("Resize needs scales or sizes")
    rois: list[tuple[float, float] | None] = [None] * r
    if _present(roi):
        rv = [float(v) for v in np.asarray(roi).ravel()]
        if len(rv) != 2 * len(axes):
            raise ValueError(f"roi {rv} must have {2 * len(axes)} values")
        for i, a in enumerate(axes):
            rois[a] = (rv[i], rv[len(axes) + i])
    plans = []
    for a in axes:
        trivial_roi = rois[a] is None or (math.isclose(rois[a][0], 0.0) and math.isclose(rois[a][1], 1.0))
        if math.isclose(scale[a], 1.0) and out[a] == xs[a] and trivial_roi:
            continue  # identity along this axis
        if out[a] < 0:
            raise ValueError(f"negative output size {out[a]} on axis {a}")
        plans.append((a, _axis_plan(attrs, attrs["mode"], xs[a], out[a], scale[a], rois[a], dtype)))
    return plans


def axis_matrices(attrs: Attrs, xs: tuple[int, ...], dtype: np.dtype, roi: Any, sizes: Any
                  ) -> list[tuple[int, np.ndarray]]:
    """Per resized axis, the (out, in) matrix of the node's resize along it (rows of extrapolated outputs
    are zero): Y = X ×_axis M for each, in turn. For gradients of resizes with constant sizes."""
    out = []
    for axis, plan in _resize_plan(attrs, xs, dtype, roi, None, sizes):
        kind, n = plan[0], xs[axis]
        if kind == "dense":
            mat = np.array(plan[1], dtype=dtype)
        elif kind == "take":
            mat = np.zeros((plan[1].shape[0], n), dtype)
            mat[np.arange(mat.shape[0]), plan[1]] = 1
        else:
            mat = _tap_matrix(plan[1], plan[2], n).astype(dtype)
        outside = plan[-1]
        if outside is not None:
            mat[np.asarray(outside)] = 0
        out.append((axis, mat))
    return out


def _resize(attrs: Attrs, x: np.ndarray, roi: Any, scales: Any, sizes: Any) -> np.ndarray:
    def key_of(v: Any) -> Any:
        return None if v is None else tuple(np.asarray(v).ravel().tolist())

    key = (x.shape, x.dtype, key_of(roi), key_of(scales), key_of(sizes))
    plans = attrs.cache.get(key)
    if plans is None:
        plans = attrs.cache[key] = _resize_plan(attrs, x.shape, x.dtype, roi, scales, sizes)
    y = x
    extrap = float(attrs.get("extrapolation_value") or 0.0)
    for axis, plan in plans:
        y = _apply(y, axis, plan, extrap)
    if y is x:
        y = x.copy()
    return _to_dtype(y, x.dtype)


def _legacy_attrs(attrs: Attrs) -> Attrs:
    """Attributes of Resize-10 / Upsample: asymmetric coordinates; nearest rounds down, or up on an axis
    that is downsampled (onnxruntime's "simple" mode, and ONNX's opset-10 test data)."""
    la = attrs.cache.get("legacy")
    if la is None:
        mode = attrs.get("mode") or "nearest"
        mode = "linear" if mode == "bilinear" else mode  # (Upsample-1's name for it)
        la = Attrs({"mode": mode, "coordinate_transformation_mode": "asymmetric",
                    "nearest_mode": "simple", "cubic_coeff_a": -0.75, "exclude_outside": 0,
                    "extrapolation_value": 0.0, "antialias": 0})
        attrs.cache["legacy"] = la
    return la


@kernel("Resize", since=10)
def resize_10(inputs: Inputs, attrs: Attrs) -> Outputs:
    return (_resize(_legacy_attrs(attrs), inputs[0], None, inputs[1], None),)


@kernel("Resize", since=11)
def resize(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    roi = inputs[1] if len(inputs) > 1 else None
    scales = inputs[2] if len(inputs) > 2 else None
    sizes = inputs[3] if len(inputs) > 3 else None
    return (_resize(attrs, x, roi, scales, sizes),)


@kernel("Upsample", since=1)
def upsample_1(inputs: Inputs, attrs: Attrs) -> Outputs:
    """Upsample-1 (experimental): the last two axes scaled by ``height_scale`` and ``width_scale``."""
    x = inputs[0]
    h, w = attrs.get("height_scale"), attrs.get("width_scale")
    if h is None or w is None or x.ndim < 2:
        raise ValueError("Upsample-1 needs height_scale, width_scale and an input of rank 2 or more")
    scales = np.array([1.0] * (x.ndim - 2) + [h, w], np.float32)
    return (_resize(_legacy_attrs(attrs), x, None, scales, None),)


@kernel("Upsample", since=7)
def upsample(inputs: Inputs, attrs: Attrs) -> Outputs:
    scales = inputs[1] if len(inputs) > 1 else attrs.get("scales")
    if scales is None:
        raise ValueError("Upsample needs scales")
    return (_resize(_legacy_attrs(attrs), inputs[0], None, scales, None),)
