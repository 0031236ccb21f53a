"""Sampling kernels: GridSample, AffineGrid and DeformConv.

GridSample and DeformConv share one N-D sampler: per spatial axis, every sampling point reads ``k``
taps (1 nearest, 2 linear, 4 cubic) around ``floor(u)``, each with a weight that is a polynomial in its
distance from ``u``; the taps of all axes combine into ``k**r`` flat indices into the spatial plane.
The Python loop runs over those taps, never over pixels. The tap tables (``TAPS``), the coordinate
maps (``unnormalize``, ``bounds``) and DeformConv's geometry are shared with the gradient rules in
autodiff/rules/sampling.py, which rebuild the same sampler from ONNX ops.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from onnxtrain.engine.kernels.finite import all_finite
from onnxtrain.engine.parallel import parallel_for, split, width
from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel

CUBIC_A = -0.75  # the Keys cubic coefficient GridSample uses (as torch's bicubic grid_sample)


def _cubic_coeffs(a: float) -> list[list[float]]:
    """Keys cubic weights of the taps at floor(u) - 1 .. floor(u) + 2 as polynomials in the tap's
    distance d from u (highest power first): outer taps (1 <= d <= 2) and inner taps (d <= 1)."""
    outer = [a, -5 * a, 8 * a, -4 * a]
    inner = [a + 2, -(a + 3), 0.0, 1.0]
    return [list(c) for c in zip(outer, inner, inner, outer, strict=True)]


# mode -> (tap offsets from floor(u), sign s with distance d = s * (t - offset) for t = u - floor(u),
#          weight polynomial coefficients in d per tap, highest power first)
TAPS: dict[str, tuple[list[int], list[int], list[list[float]]]] = {
    "linear": ([0, 1], [1, -1], [[-1.0, -1.0], [1.0, 1.0]]),  # w = 1 - d
    "cubic": ([-1, 0, 1, 2], [1, 1, -1, -1], _cubic_coeffs(CUBIC_A)),
}

_MODES = {"bilinear": "linear", "bicubic": "cubic", "linear": "linear", "cubic": "cubic",
          "nearest": "nearest"}


def grid_mode(attrs: dict[str, Any], opset: int) -> str:
    """GridSample's mode as ``linear``/``nearest``/``cubic`` (opset 16 spells them bilinear/bicubic)."""
    mode = attrs.get("mode") or ("linear" if opset >= 20 else "bilinear")
    allowed = ("linear", "nearest", "cubic") if opset >= 20 else ("bilinear", "nearest", "bicubic")
    if mode not in allowed:
        raise ValueError(f"GridSample: mode {mode!r} is not one of {allowed} at opset {opset}")
    return _MODES[mode]


def unnormalize(sizes: np.ndarray, align_corners: bool) -> tuple[np.ndarray, np.ndarray]:
    """(scale, shift) per axis mapping a normalized grid value g in [-1, 1] to pixel units g*scale+shift."""
    scale = (sizes - 1) / 2.0 if align_corners else sizes / 2.0
    return scale, (sizes - 1) / 2.0


def bounds(sizes: np.ndarray, align_corners: bool) -> tuple[np.ndarray, np.ndarray]:
    """The pixel-unit interval a coordinate may take before padding_mode moves it: the corner pixels'
    centres (align_corners=1) or their outer edges (align_corners=0)."""
    if align_corners:
        return np.zeros_like(sizes), sizes - 1.0
    return np.full_like(sizes, -0.5), sizes - 0.5


def reflect(u: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``u`` folded into [lo, hi] by repeated reflection at both ends (a triangle wave); an empty
    interval (one pixel with align_corners=1) folds with period 2, the caller clips."""
    span = np.maximum(hi - lo, 1.0)
    z = u - lo
    m = z - np.floor(z / (2 * span)) * (2 * span)
    return lo + span - np.abs(m - span)


def adjust_coords(u: np.ndarray, sizes: np.ndarray, padding: str, align_corners: bool) -> np.ndarray:
    """Pixel coordinates outside ``bounds`` clamped (border) or reflected (reflection) into them.

    Linear and nearest modes move the coordinate first; cubic mode does not (torch and onnxruntime
    pad only its taps; onnx.reference also clamps the coordinate, which changes border-mode values
    beyond the edge: there the engine follows torch and onnxruntime)."""
    if padding == "zeros":
        return u
    lo, hi = bounds(sizes, align_corners)
    out = (u < lo) | (u > hi)
    moved = np.minimum(np.maximum(u, 0), sizes - 1) if padding == "border" else reflect(u, lo, hi)
    return np.where(out, moved, u)


def _polyval(coeffs: list[float], d: np.ndarray) -> np.ndarray:
    acc = coeffs[0] * d
    for c in coeffs[1:-1]:
        acc += c
        acc *= d
    acc += coeffs[-1]
    return acc


def _axis_taps(ua: np.ndarray, size: int, mode: str, padding: str, align_corners: bool
               ) -> list[tuple[np.ndarray, np.ndarray | None, np.ndarray | None]]:
    """(index, weight, inside) of each tap of one axis for coordinates ``ua`` (B, P); indices are padded
    (zeros: an outside tap gets index 0 and weight 0, and ``inside`` marks the others; border: clamped;
    reflection: reflected; ``inside`` None)."""
    if mode == "nearest":
        taps: list[tuple[np.ndarray, np.ndarray | None]] = [(np.rint(ua), None)]  # ties to the even index
    else:
        offs, sgn, coeffs = TAPS[mode]
        base = np.floor(ua)
        t = ua - base
        taps = [(base + o, _polyval([c[j] for c in coeffs], (t - o) * s))
                for j, (o, s) in enumerate(zip(offs, sgn, strict=True))]
    out = []
    for idx, w in taps:
        valid = None
        if padding == "zeros":
            valid = (idx >= 0) & (idx <= size - 1)
            idx = np.where(valid, idx, 0)
            w = valid.astype(ua.dtype) if w is None else w * valid
        elif padding == "reflection":
            lo, hi = bounds(np.asarray(float(size)), align_corners)
            idx = np.clip(reflect(idx, lo, hi), 0, size - 1)
        else:
            idx = np.clip(idx, 0, size - 1)
        out.append((idx.astype(np.int64), w, valid))
    return out


def _framed(x: np.ndarray, padding: str, last: bool) -> np.ndarray:
    """``x`` (B, C, H, W) inside a frame of one pixel before and two after each spatial axis, as
    (B, H + 3, W + 3, C) (``last``) or (B, C, H + 3, W + 3): zeros, or (border, reflection) the edge pixels,
    which is what border and half-pixel reflection read there."""
    b, c, h, w = x.shape
    shape = (b, h + 3, w + 3, c) if last else (b, c, h + 3, w + 3)
    out = np.zeros(shape, x.dtype) if padding == "zeros" else np.empty(shape, x.dtype)
    img = out.transpose(0, 3, 1, 2) if last else out  # (B, C, H + 3, W + 3) view
    step = TRANSPOSE_CHANNELS if last else c
    for j in range(0, c, step):  # see TRANSPOSE_CHANNELS
        img[:, j:j + step, 1:h + 1, 1:w + 1] = x[:, j:j + step]
    if padding != "zeros":
        img[:, :, :1], img[:, :, h + 1:] = img[:, :, 1:2], img[:, :, h:h + 1]
        img[:, :, :, :1], img[:, :, :, w + 1:] = img[:, :, :, 1:2], img[:, :, :, w:w + 1]
    return out


# numpy's transposing copy of NCHW into channels-last runs 2-3× faster 8 channels at a time than on all
# (16×32×32×32: 2.2 → 0.8 ms; 8×64×64×64: 11 → 5.7 ms)
TRANSPOSE_CHANNELS = 8
# channels up to which the framed image stays channels-first and each channel is gathered on its own; above,
# a channels-last copy gives one gather of a C-vector per tap
FEW_CHANNELS = 4
# a part of the batch holds whole images, up to PART_POINTS points and PART_VALUES sampled values (points ×
# channels), at least one image: its arrays stay in the caches (and out of fresh pages: 64×1×28×28 from a
# 28×28 grid, 1.5 ms of CPU at once, 0.55 ms in parts of 16K points), and parts are shared out among threads
PART_POINTS = 1 << 14
PART_VALUES = 1 << 16


def _bilinear_part(x: np.ndarray, uy: np.ndarray, ux: np.ndarray, padding: str, out: np.ndarray) -> None:
    """:func:`_bilinear` of ``x`` (B, C, H, W) at coordinates ``uy``, ``ux`` (B, P) into ``out`` (B, C, P)."""
    b, c, h, w = x.shape
    hp, wp = h + 3, w + 3
    last = c > FEW_CHANNELS
    rows = _framed(x, padding, last).reshape(-1, c) if last else _framed(x, padding, False).reshape(-1)
    if padding == "zeros":
        uy, ux = np.clip(uy, -1, h), np.clip(ux, -1, w)
    fy, fx = np.floor(uy), np.floor(ux)
    ty, tx = uy - fy, ux - fx
    wy0, wx0 = 1 - ty, 1 - tx  # TAPS["linear"]: w = 1 - d, d = t for the tap at floor(u)
    # and d = (t - 1)·(-1) for the tap after it: rounding to nearest is symmetric, so (t - 1)·(-1) is
    # exactly 1 - t as rounded, and that tap's weight 1 - (1 - t) as rounded
    wy1, wx1 = np.subtract(1, wy0, out=ty), np.subtract(1, wx0, out=tx)
    if hp * wp < 1 << 24:  # (floor(uy)·wp + floor(ux)) exact in float32 and float64
        fy *= wp
        fy += fx
        base = fy.astype(np.intp)
    else:
        base = fy.astype(np.intp) * wp + fx.astype(np.intp)
    # + 1 row and column of frame, and the image's (or the image's channel's) offset
    first = np.arange(b * (1 if last else c), dtype=np.intp) * (hp * wp) + (wp + 1)
    if last:
        base += first[:, None]
        weights = ((0, wy0 * wx0), (1, wy0 * wx1), (wp, wy1 * wx0), (wp + 1, wy1 * wx1))
        y = None
        for off, weight in weights:
            v = rows[off:].take(base, axis=0)  # (B, P, C)
            v *= weight[:, :, None]  # in the weights' (coordinates') precision, rounded once to X's dtype
            if y is None:
                y = v
            else:
                y += v
        out[...] = y.transpose(0, 2, 1)  # type: ignore[union-attr]
        return
    idx = base[:, None, :] + first.reshape(b, c, 1)  # (B, C, P)
    y = None
    for k, (off, wa, wb) in enumerate(((0, wy0, wx0), (1, wy0, wx1), (wp, wy1, wx0), (wp + 1, wy1, wx1))):
        v = rows[off:].take(idx)  # (B, C, P)
        v *= (wa * wb)[:, None, :]
        if y is None:
            y = v
        else:
            np.add(y, v, out=out if k == 3 else y)


def _bilinear(x: np.ndarray, u: np.ndarray | None, padding: str, uy: np.ndarray | None = None,
              ux: np.ndarray | None = None) -> np.ndarray:
    """:func:`sample` for 2-D linear sampling with zeros, border or (half-pixel) reflection padding: the
    image gets a frame of one pixel before and two after each axis (zeros, or its edge pixels, which is what
    border and half-pixel reflection read there), so that every point's four taps are one base index plus
    fixed offsets, with no per-tap masks. Zeros padding first clips coordinates to [-1, size], where all
    their taps read the frame. The weights are those of ``TAPS["linear"]``, combined and summed in
    :func:`sample`'s order, each product in the weights' dtype (the same bits, but that a point with no tap
    inside under zeros padding is +0 here and may be -0 there). ``u`` (B, P, 2), or its axes ``uy``, ``ux``
    (B, P) with ``u`` None.

    Up to FEW_CHANNELS channels, each channel is gathered from the channels-first framed image (flat
    indices: no transposes); above, whole pixels from a channels-last copy, the sum transposed back. The
    batch is cut into parts (PART_POINTS, PART_VALUES) shared out among the run's threads; every value is
    computed by the same operations in the same order either way. 32×3×64×64 from a 64×64 grid: the
    sampling 10.2 → 4.6 ms, the whole GridSample 12.2 → 6.9 ms (onnxruntime 2.4–3.1 ms); then in parts,
    per-channel below 5 channels, see bench/HISTORY.md (2026-12-03) and ``python -m bench.grid_sample``."""
    b, c = x.shape[:2]
    if u is not None:
        uy, ux = u[:, :, 0], u[:, :, 1]
    assert uy is not None and ux is not None
    p = uy.shape[1]
    out = np.empty((b, c, p), x.dtype)
    per = max(1, min(PART_POINTS // max(1, p), PART_VALUES // max(1, p * c)))
    parts = max(-(-b // per), min(width(), b) if b * p * c >= PART_VALUES else 1)
    ranges = split(b, parts)
    if len(ranges) == 1:
        _bilinear_part(x, uy, ux, padding, out)
    else:
        parallel_for(len(ranges), lambda i: _bilinear_part(
            x[ranges[i][0]:ranges[i][1]], uy[ranges[i][0]:ranges[i][1]], ux[ranges[i][0]:ranges[i][1]],
            padding, out[ranges[i][0]:ranges[i][1]]))
    return out


def _bilinear_pads(padding: str, align_corners: bool) -> bool:
    """Whether :func:`_bilinear`'s frame stands for ``padding``."""
    return padding in ("zeros", "border") or (padding == "reflection" and not align_corners)


def sample(x: np.ndarray, u: np.ndarray, mode: str, padding: str, align_corners: bool) -> np.ndarray:
    """Interpolate ``x`` (B, C, *S) at pixel coordinates ``u`` (B, P, r), axis order, → (B, C, P).

    ``u`` has already been moved by ``adjust_coords``; here each tap index is padded on its own:
    zeros drops taps outside the image, border clamps them, reflection reflects them. Arrays stay
    (B, P)-shaped: the loops run over the k taps per axis and their k**r combinations."""
    if not np.isfinite(u).all():  # one pass (.all(axis=-1) over r = 2: 0.7 ms instead of 7 µs on 50K points)
        finite = np.isfinite(u).all(axis=-1)  # (B, P): a NaN or infinite coordinate has no tap to read
        y = sample(x, np.where(finite[..., None], u, 0), mode, padding, align_corners)
        if y.dtype.kind != "f":
            y = y.astype(np.float64)
        y.transpose(0, 2, 1)[~finite] = np.nan  # such a point is NaN
        return y
    if mode == "linear" and x.ndim == 4 and x.dtype.kind == "f" and _bilinear_pads(padding, align_corners):
        return _bilinear(x, u, padding)
    y = _gather(x, u, mode, padding, align_corners, False)
    if padding == "zeros" and y.dtype.kind == "f" and not all_finite(y.transpose(0, 2, 1)):  # (laid out so)
        # a tap outside the image reads pixel 0 with weight 0: an inf or NaN there spreads
        y = _gather(x, u, mode, padding, align_corners, True)
    return y


def _gather(x: np.ndarray, u: np.ndarray, mode: str, padding: str, align_corners: bool,
            exact: bool) -> np.ndarray:
    """:func:`sample` by its taps; ``exact``: the taps outside the image (zeros padding) add exact zeros
    rather than their (first pixel's) value times weight 0."""
    b, c = x.shape[:2]
    sp = x.shape[2:]
    r = len(sp)
    axes = [_axis_taps(np.ascontiguousarray(u[:, :, a]), sp[a], mode, padding, align_corners)
            for a in range(r)]
    size = int(np.prod(sp))
    strides = [int(np.prod(sp[a + 1:])) for a in range(r)]
    # gather whole pixels (rows of C values) from a channels-last copy of X: per tap, on 4096 points per
    # image, 0.4 ms instead of 1.2 ms for per-channel gathers at 32x3 channels, 1.1 ms instead of 12 ms
    # at 8x64 (the transposes of X and Y cost about one tap each)
    rows = np.empty((b, size, c), x.dtype)
    step = TRANSPOSE_CHANNELS
    for j in range(0, c, step):  # as in _framed
        rows[:, :, j:j + step] = x.reshape(b, c, size)[:, j:j + step].transpose(0, 2, 1)
    rows = rows.reshape(b * size, c)
    first = (np.arange(b, dtype=np.int64) * size)[:, None]
    y = None
    for combo in itertools.product(*axes):
        flat = first + combo[0][0] * strides[0]
        weight, inside = combo[0][1], combo[0][2]
        for a in range(1, r):
            flat += combo[a][0] * strides[a]
            w = combo[a][1]
            weight = w if weight is None else weight if w is None else weight * w
            if exact and inside is not None:
                inside = inside & combo[a][2]
        v = rows.take(flat, axis=0)  # (B, P, C), a new array: safe to scale in place
        if weight is not None:
            if v.dtype.kind == "f":
                v *= weight[:, :, None]
            else:
                v = v * weight[:, :, None]
        if exact and inside is not None:
            v[~inside] = 0
        if y is None:
            y = v
        else:
            y += v
    return y.transpose(0, 2, 1)  # type: ignore[union-attr]


@kernel("GridSample", since=16)
def grid_sample(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, grid = inputs[0], inputs[1]
    mode = grid_mode(attrs, attrs.opset)
    padding = attrs.get("padding_mode") or "zeros"
    if padding not in ("zeros", "border", "reflection"):
        raise ValueError(f"GridSample: unknown padding_mode {padding!r}")
    align = bool(attrs.get("align_corners") or 0)
    r = x.ndim - 2
    if r < 1 or grid.ndim != x.ndim or grid.shape[-1] != r or grid.shape[0] != x.shape[0]:
        raise ValueError(f"GridSample: grid {grid.shape} does not fit X {x.shape}: want (N, *out, {r})")
    if attrs.opset < 20 and r != 2:
        raise ValueError(f"GridSample: X must be 4-D before opset 20, got {x.shape}")
    n, c = x.shape[:2]
    out_sp = grid.shape[1:-1]
    if x.size == 0 or grid.size == 0:
        return (np.zeros((n, c, *out_sp), dtype=x.dtype),)
    ct = np.promote_types(grid.dtype, np.float32)  # coordinates in float32 at least
    sizes = np.asarray(x.shape[2:], dtype=ct)
    scale, shift = unnormalize(sizes, align)
    g = grid.reshape(n, -1, r)
    axes = []  # per axis, (N, P): numpy's loops over a last axis of 2 or 3 cost 20-30× a contiguous pass
    for a in range(r):
        ua = np.multiply(g[:, :, r - 1 - a], scale[a], dtype=ct)  # grid lists the last axis first
        ua += shift[a]
        if mode == "nearest":
            np.rint(ua, out=ua)
        if mode != "cubic":  # cubic pads each tap on its own (as torch and onnxruntime; see adjust_coords)
            ua = adjust_coords(ua, sizes[a:a + 1], padding, align)
        axes.append(ua)
    if (mode == "linear" and r == 2 and x.dtype.kind == "f" and _bilinear_pads(padding, align)
            and all(np.isfinite(ua).all() for ua in axes)):
        y = _bilinear(x, None, padding, axes[0], axes[1])
    else:
        y = sample(x, np.stack(axes, axis=-1), mode, padding, align)
    return (y.reshape(n, c, *out_sp).astype(x.dtype, copy=False),)


def base_grid(sizes: list[int], align_corners: bool, dtype: Any) -> np.ndarray:
    """AffineGrid's untransformed positions in homogeneous form, (prod(sizes), r + 1): per point the
    normalized coordinates with the last spatial axis first, then 1."""
    axes = []
    for d in sizes:
        i = np.arange(d, dtype=np.float64)
        if align_corners:
            axes.append(i * (2.0 / (d - 1)) - 1 if d > 1 else np.full(1, -1.0))
        else:
            axes.append((2 * i + 1) / d - 1)
    mesh = np.meshgrid(*axes, indexing="ij")
    cols = [m.reshape(-1) for m in mesh[::-1]] + [np.ones(int(np.prod(sizes)))]
    return np.stack(cols, axis=1).astype(dtype)


@kernel("AffineGrid", since=20)
def affine_grid(inputs: Inputs, attrs: Attrs) -> Outputs:
    theta, size = inputs[0], [int(v) for v in np.asarray(inputs[1]).reshape(-1)]
    r = len(size) - 2
    if r not in (2, 3) or theta.ndim != 3 or theta.shape[1:] != (r, r + 1):
        raise ValueError(f"AffineGrid: theta {theta.shape} and size {size} must be (N, 2, 3) with 4 sizes "
                         "or (N, 3, 4) with 5 sizes")
    if size[0] != theta.shape[0]:
        raise ValueError(f"AffineGrid: size's batch {size[0]} differs from theta's {theta.shape[0]}")
    if min(size) < 0:
        raise ValueError(f"AffineGrid: size {size} has a negative entry")
    align = bool(attrs.get("align_corners") or 0)
    base = attrs.cached((tuple(size[2:]), theta.dtype), lambda: base_grid(size[2:], align, theta.dtype))
    grid = np.matmul(base, theta.transpose(0, 2, 1))  # (N, P, r)
    return (grid.reshape(theta.shape[0], *size[2:], r),)


def deform_geometry(attrs: dict[str, Any], xs: tuple[int, ...], ws: tuple[int, ...]) -> dict[str, Any]:
    """Kernel size, output size, groups and the offset-free sampling positions (K, P, r) of a
    DeformConv node for X of shape ``xs`` and W of shape ``ws``."""
    r = len(xs) - 2
    k = list(attrs.get("kernel_shape") or ws[2:])
    if r < 1 or len(ws) != len(xs) or len(k) != r or list(ws[2:]) != k:
        raise ValueError(f"DeformConv: W {ws} and kernel_shape {k} do not fit X {xs}")
    strides = list(attrs.get("strides") or [1] * r)
    dil = list(attrs.get("dilations") or [1] * r)
    pads = list(attrs.get("pads") or [0] * (2 * r))
    if len(strides) != r or len(dil) != r or len(pads) != 2 * r:
        raise ValueError(f"DeformConv: strides {strides}, dilations {dil} or pads {pads} do not fit {r} axes")
    if min(strides) < 1 or min(dil) < 1 or min(pads) < 0:
        raise ValueError(f"DeformConv: strides {strides} and dilations {dil} must be >= 1, pads {pads} >= 0")
    out = [(xs[2 + a] + pads[a] + pads[r + a] - (k[a] - 1) * dil[a] - 1) // strides[a] + 1 for a in range(r)]
    group, og = attrs.get("group"), attrs.get("offset_group")
    group, og = int(1 if group is None else group), int(1 if og is None else og)
    if group < 1 or og < 1:
        raise ValueError(f"DeformConv: group={group} and offset_group={og} must be >= 1")
    c, m = xs[1], ws[0]
    if c != ws[1] * group or m % group or c % og:
        raise ValueError(f"DeformConv: channels do not match: X {xs}, W {ws}, group={group}, "
                         f"offset_group={og}")
    if min(out) < 1:
        raise ValueError(f"DeformConv: empty output {out} for X {xs}, W {ws}")
    grids = np.meshgrid(*[np.arange(v) for v in k], *[np.arange(v) for v in out], indexing="ij")
    base = np.stack([grids[a] * dil[a] + grids[r + a] * strides[a] - pads[a] for a in range(r)], axis=-1)
    return {"r": r, "K": int(np.prod(k)), "out": out, "P": int(np.prod(out)), "group": group, "og": og,
            "base": base.reshape(int(np.prod(k)), -1, r)}


@kernel("DeformConv", since=19)
def deform_conv(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, w, offset = inputs[0], inputs[1], inputs[2]
    bias = inputs[3] if len(inputs) > 3 else None
    mask = inputs[4] if len(inputs) > 4 else None
    geo = attrs.cached((x.shape[1:], w.shape), lambda: deform_geometry(attrs, x.shape, w.shape))
    r, kk, p, group, og = geo["r"], geo["K"], geo["P"], geo["group"], geo["og"]
    n, c = x.shape[:2]
    m = w.shape[0]
    if offset.shape != (n, og * kk * r, *geo["out"]):
        raise ValueError(f"DeformConv: offset {offset.shape} must be (N, {og * kk * r}, *{geo['out']})")
    if mask is not None and mask.shape != (n, og * kk, *geo["out"]):
        raise ValueError(f"DeformConv: mask {mask.shape} must be (N, {og * kk}, *{geo['out']})")
    if bias is not None and bias.shape != (m,):
        raise ValueError(f"DeformConv: bias B {bias.shape} must be ({m},), one per output channel")
    ct = np.promote_types(offset.dtype, np.float32)
    u = offset.reshape(n * og, kk, r, p).transpose(0, 1, 3, 2) + geo["base"].astype(ct)
    cols = sample(x.reshape(n * og, c // og, *x.shape[2:]), u.reshape(n * og, kk * p, r), "linear", "zeros",
                  True)
    cols = cols.reshape(n, og, c // og, kk, p)
    if mask is not None:
        cols = cols * mask.reshape(n, og, 1, kk, p)
    y = np.matmul(w.reshape(group, m // group, -1), cols.reshape(n, group, -1, p))  # (N, group, m/group, P)
    y = y.reshape(n, m, *geo["out"])
    if bias is not None:
        y = y + bias.reshape((1, m) + (1,) * r)
    return (y.astype(x.dtype, copy=False),)
