"""Detection kernels: RoiAlign, MaxRoiPool and NonMaxSuppression.

The ROI ops compute every box's geometry at once and go through the boxes in chunks of similar size
(a chunk's padded work stays under ``_ROI_BUDGET`` elements). RoiAlign avg: a bin's bilinear samples
factor into a row table and a column table, so each box costs two small products over the slice of X
under it. RoiAlign max and MaxRoiPool gather every candidate of every bin of the chunk, (candidate,
boxes, P, Q, C) with the channels last, and take the max over the leading axes.
NonMaxSuppression runs the greedy pass of every (batch, class) pair together, a block of candidates per
step; with few pairs, the boxes a step keeps suppress ahead (their pair's later candidates die at once, the
survivors are compacted), so a pair of thousands of boxes takes a few steps.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel

_ROI_BUDGET = 1 << 20  # elements of a chunk's gathered feature values


def _chunks(a: np.ndarray, b: np.ndarray, extra: np.ndarray, per: int) -> list[np.ndarray]:
    """Box indices in groups, smallest a·b first, such that a group's padded cost, its size times
    (per · max a · max b + max extra), stays within ``_ROI_BUDGET`` (a group holds one box at least)."""
    order = np.argsort(a * b, kind="stable")
    a, b, extra = a[order], b[order], extra[order]
    out, s = [], 0
    while s < order.size:
        big = np.maximum.accumulate
        top = per * big(a[s:]) * big(b[s:]) + big(extra[s:])
        e = s + max(int(np.searchsorted(np.arange(1, top.size + 1) * top, _ROI_BUDGET, side="right")), 1)
        out.append(order[s:e])
        s = e
    return out


class _Features:
    """X (N, C, H, W) read as channel vectors at (image, row, column) points, in dtype ``dt``. Many points
    read from a channels-last copy (a contiguous row of C per point); few from X itself, as copying a
    large map would cost more than the points."""

    def __init__(self, x: np.ndarray, dt: np.dtype, points: int):
        n, c, self.h, self.w = x.shape
        self.dt = dt
        self.last = 4 * points * c >= x.size
        if self.last:
            self.data = np.ascontiguousarray(x.transpose(0, 2, 3, 1), dtype=dt).reshape(-1, c)
        else:
            self.data = x.reshape(n, c, self.h * self.w)

    def take(self, b: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """X[b, :, rows, cols] (indices broadcast together) with the channels last."""
        if self.last:
            return np.take(self.data, (b * self.h + rows) * self.w + cols, axis=0)
        return self.data[b, :, rows * self.w + cols].astype(self.dt, copy=False)


# ---- RoiAlign -----------------------------------------------------------------------------------


def _roi_geometry(rois: np.ndarray, attrs: Attrs, dt: np.dtype,
                  pooled: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """Per box [x1, y1, x2, y2]: (start_h, start_w, bin_h, bin_w, grid_h, grid_w), grids int64."""
    half = (attrs.get("coordinate_transformation_mode") or "output_half_pixel") == "half_pixel"
    s = rois.astype(dt) * dt.type(attrs["spatial_scale"]) - dt.type(0.5 if half else 0.0)
    x1, y1, x2, y2 = s[:, 0], s[:, 1], s[:, 2], s[:, 3]
    rh, rw = y2 - y1, x2 - x1
    if not half:  # malformed boxes become 1x1
        rh, rw = np.maximum(rh, dt.type(1)), np.maximum(rw, dt.type(1))
    bh, bw = rh / dt.type(pooled[0]), rw / dt.type(pooled[1])
    ratio = int(attrs["sampling_ratio"])
    grids = [np.full(len(s), ratio, dtype=np.int64) if ratio > 0 else _ceil_int(v) for v in (bh, bw)]
    return y1, x1, bh, bw, grids[0], grids[1]


def _ceil_int(v: np.ndarray) -> np.ndarray:
    """ceil(v) as int64, NaN as 0 and magnitudes capped (no box samples more than 2^20 points a bin)."""
    return np.clip(np.nan_to_num(np.ceil(v)), -(1 << 20), 1 << 20).astype(np.int64)


def _axis_taps(start: np.ndarray, bin_size: np.ndarray, grid: np.ndarray, pooled: int, size: int,
               dt: np.dtype, pad_weight: bool) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps of RoiAlign's samples along one axis for R boxes: positions and weights, each
    (R, pooled, G, 2) with G the largest grid.

    Taps are (floor, floor + 1) of the sample coordinate clamped to [0, size - 1]; a sample outside
    [-1, size] gets zero weights (it contributes 0, which still counts in max mode). Samples past a
    box's grid repeat its first sample, with zero weights unless ``pad_weight`` (a repeat leaves a max
    unchanged); a box without samples gets zero weights.
    """
    g = max(int(grid.max()), 1)
    p = np.arange(pooled, dtype=dt)[None, :, None]
    i = np.arange(g, dtype=dt)[None, None, :]
    start, bin_size = start[:, None, None], bin_size[:, None, None]
    n = np.maximum(grid, 1).astype(dt)[:, None, None]
    pos = (start + p * bin_size) + (i + dt.type(0.5)) * bin_size / n
    exists = np.arange(g) < grid[:, None, None]
    pos = np.where(exists, pos, pos[:, :, :1])
    valid = (pos >= -1) & (pos <= size) & (exists | pad_weight) & (grid > 0)[:, None, None]
    c = np.clip(pos, 0, size - 1)
    lo = np.floor(c).astype(np.int64)
    hi = np.minimum(lo + 1, size - 1)
    frac = c - lo.astype(dt)
    zero = dt.type(0)
    w = np.stack([np.where(valid, dt.type(1) - frac, zero), np.where(valid, frac, zero)], axis=-1)
    return np.stack([lo, hi], axis=-1), w


def _bin_sums(slot: np.ndarray, w: np.ndarray, k: int, dt: np.dtype) -> np.ndarray:
    """(R, P, k) sums of the tap weights ``w`` (R, P, T) of each output bin on slots 0..k-1 of its box."""
    r, pooled, t = w.shape
    flat = (np.arange(r * pooled).reshape(r, pooled, 1) * k + slot.reshape(r, pooled, t)).ravel()
    return np.bincount(flat, weights=w.ravel(), minlength=r * pooled * k).reshape(r, pooled, k).astype(dt)


def _band(pos: np.ndarray, w: np.ndarray, dt: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """First position and extent (R,) of the band each box's taps cover, and the (R, P, K) matrix summing
    each output bin's tap weights on the band's positions (K the widest band)."""
    r, pooled = pos.shape[:2]
    pos = pos.reshape(r, pooled, -1)
    first = pos.min(axis=(1, 2))
    span = pos.max(axis=(1, 2)) - first + 1
    return first, span, _bin_sums(pos - first[:, None, None], w.reshape(r, pooled, -1), int(span.max()), dt)


def _roi_align_avg(x: np.ndarray, b: np.ndarray, taps: tuple[np.ndarray, ...], count: np.ndarray,
                   dt: np.dtype) -> np.ndarray:
    """Average-mode RoiAlign of R boxes, (R, C, P, Q): My · band · Mxᵀ / count per box, the band the slice of
    X under the box's taps (the geometry is batched; the loop runs two small products per box)."""
    y0, sy, my = _band(taps[0], taps[1], dt)
    x0, sx, mx = _band(taps[2], taps[3], dt)
    out = np.empty((len(b), x.shape[1], my.shape[1], mx.shape[1]), dtype=dt)
    ends = zip(b.tolist(), y0.tolist(), (y0 + sy).tolist(), x0.tolist(), (x0 + sx).tolist())
    for r, (n, top, bottom, left, right) in enumerate(ends):
        band = x[n, :, top:bottom, left:right].astype(dt, copy=False)
        out[r] = my[r, :, :bottom - top] @ band @ mx[r, :, :right - left].T
    return out / count.astype(dt)[:, None, None, None]


def _leading(a: np.ndarray) -> np.ndarray:
    """(R, P, ...) positions or weights as (T, R, P), T the product of the trailing axes."""
    return a.reshape(a.shape[0], a.shape[1], -1).transpose(2, 0, 1)


def _roi_align_max(xf: _Features, b: np.ndarray, taps: tuple[np.ndarray, ...]) -> np.ndarray:
    """Max-mode RoiAlign of R boxes, (R, C, P, Q): the largest weighted corner value w·X of the bin's
    samples (onnxruntime's definition: a sample's value is the max of its four weighted corners).
    Candidates are laid out (row tap, column tap, R, P, Q, C), so the max runs over leading axes."""
    ypos, wy, xpos, wx = (_leading(t) for t in taps)
    v = xf.take(b[:, None, None], ypos[:, None, :, :, None], xpos[None, :, :, None, :])
    v *= (wy[:, None, :, :, None] * wx[None, :, :, None, :])[..., None]
    return v.reshape(-1, *v.shape[2:]).max(axis=0).transpose(0, 3, 1, 2)


def _roi_align_check(x: np.ndarray, rois: np.ndarray, batch: np.ndarray, mode: Any) -> None:
    """Raise ValueError on malformed RoiAlign inputs."""
    if x.ndim != 4:
        raise ValueError(f"RoiAlign: X must be 4-D (N, C, H, W), got shape {x.shape}")
    if rois.ndim != 2 or rois.shape[1] != 4 or rois.shape[0] != batch.shape[0]:
        raise ValueError(f"RoiAlign: rois must be (num_rois, 4) matching batch_indices {batch.shape}, "
                         f"got {rois.shape}")
    if batch.size and (batch.min() < 0 or batch.max() >= x.shape[0]):
        raise ValueError(f"RoiAlign: batch_indices must lie in [0, {x.shape[0]}), got {batch}")
    if mode not in ("avg", "max"):
        raise ValueError(f"RoiAlign: mode must be 'avg' or 'max', got {mode!r}")


@kernel("RoiAlign", since=10)
def roi_align(inputs: Inputs, attrs: Attrs) -> Outputs:
    # one kernel for opsets 10 and 16: opset 10 has no coordinate_transformation_mode and behaves as
    # output_half_pixel; opset 16 defaults to half_pixel (the schema default fills it in)
    x, rois, batch = inputs[0], inputs[1], np.asarray(inputs[2]).reshape(-1).astype(np.int64)
    mode = attrs["mode"]
    _roi_align_check(x, rois, batch, mode)
    ph, pw = int(attrs["output_height"]), int(attrs["output_width"])
    n, c, h, w = x.shape
    # float16 and bfloat16 compute in float32 (as onnxruntime does): float16 sample positions are off by up
    # to 1/64 pixel at 20 pixels, and the bilinear weights and the validity test with them
    dt = np.dtype(np.float32) if x.dtype.itemsize < 4 else x.dtype
    y = np.zeros((rois.shape[0], c, ph, pw), dtype=x.dtype)
    if y.size == 0:
        return (y,)
    sh, sw, bh, bw, gh, gw = _roi_geometry(rois, attrs, dt, (ph, pw))
    a, b = 2 * ph * np.maximum(gh, 1), 2 * pw * np.maximum(gw, 1)  # taps per box along each axis
    if mode == "avg":  # no gather: the taps' positions, weights and band matrices
        chunks = _chunks(a, b, 2 * (a + b) + ph * h + pw * w, 0)
    else:
        xf = _Features(x, dt, int((a * b).sum()))
        chunks = _chunks(a, b, 2 * (a + b), c)
    for k in chunks:
        taps = (*_axis_taps(sh[k], bh[k], gh[k], ph, h, dt, mode == "max"),
                *_axis_taps(sw[k], bw[k], gw[k], pw, w, dt, mode == "max"))
        if mode == "avg":
            y[k] = _roi_align_avg(x, batch[k], taps, np.maximum(gh[k] * gw[k], 1), dt)
        else:
            y[k] = _roi_align_max(xf, batch[k], taps)
    return (y,)


# ---- MaxRoiPool ---------------------------------------------------------------------------------


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C's round (half away from zero) as int64, magnitudes capped at 2^30."""
    r = np.sign(v) * np.floor(np.abs(v) + v.dtype.type(0.5))
    return np.clip(np.nan_to_num(r), -(1 << 30), 1 << 30).astype(np.int64)


def _pool_windows(lo: np.ndarray, hi: np.ndarray, pooled: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Clipped [start, end) windows (R, pooled) of boxes with rounded corners lo..hi (both included).

    Bin ``p`` of a box of extent ``e`` spans [floor(p·e/P), ceil((p+1)·e/P)), in exact integer arithmetic.
    """
    ext = np.maximum(hi - lo + 1, 1)[:, None]
    k = np.arange(pooled)
    start = np.clip(k * ext // pooled + lo[:, None], 0, size)
    end = np.clip(-(-(k + 1) * ext // pooled) + lo[:, None], 0, size)
    return start, end


def _window_taps(start: np.ndarray, end: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions (K, R, P) covering each window, K its largest span, padded with the window's start (or
    any valid position for an empty window), and whether each window is non-empty (R, P)."""
    k = np.arange(max(int((end - start).max()), 1))[:, None, None]
    pos = start + k
    pos = np.where(pos < end, pos, start)
    return np.minimum(pos, size - 1), end > start


def _max_roi_pool_boxes(xf: _Features, b: np.ndarray, rows: tuple[np.ndarray, ...],
                        cols: tuple[np.ndarray, ...]) -> np.ndarray:
    """MaxRoiPool of R boxes (R, C, P, Q) from their row and column windows; empty bins give 0.
    Candidates are laid out (row, column, R, P, Q, C), so the max runs over leading axes."""
    (rpos, rfull), (cpos, cfull) = _window_taps(*rows, xf.h), _window_taps(*cols, xf.w)
    v = xf.take(b[:, None, None], rpos[:, None, :, :, None], cpos[None, :, :, None, :])
    out = v.reshape(-1, *v.shape[2:]).max(axis=0)  # (R, P, Q, C)
    out[~(rfull[:, :, None] & cfull[:, None, :])] = 0
    return out.transpose(0, 3, 1, 2)


def _max_roi_pool_check(x: np.ndarray, rois: np.ndarray, pooled: Any) -> None:
    """Raise ValueError on malformed MaxRoiPool inputs."""
    if x.ndim != 4:
        raise ValueError(f"MaxRoiPool: X must be 4-D (N, C, H, W), got shape {x.shape}")
    if rois.ndim != 2 or rois.shape[1] != 5:
        raise ValueError(f"MaxRoiPool: rois must be (num_rois, 5), got {rois.shape}")
    if pooled is None or len(pooled) != 2 or min(pooled) < 1:
        raise ValueError(f"MaxRoiPool: pooled_shape must be two positive sizes, got {pooled}")


def _max_roi_pool_boxes_of(rois: np.ndarray, scale: Any, pooled: tuple[int, int],
                           shape: tuple[int, ...]) -> tuple[np.ndarray, tuple, tuple]:
    """Batch indices (R,) and the (start, end) row and column windows (R, P) of boxes [b, x1, y1, x2, y2].

    Box corners are rounded half away from zero and include both ends; a float16 box scales in float32
    (a float16 scale, 0.2998 for 0.3, would move the rounding of corners near a half).
    """
    if rois.dtype.itemsize < 4:
        rois = rois.astype(np.float32)
    b = np.trunc(rois[:, 0])
    bad = np.flatnonzero(~((b >= 0) & (b < shape[0])))
    if bad.size:
        raise ValueError(f"MaxRoiPool: batch index {rois[bad[0], 0]:g} of roi {bad[0]} is outside "
                         f"[0, {shape[0]})")
    x1, y1, x2, y2 = (_round_half_away(rois[:, k] * rois.dtype.type(scale)) for k in range(1, 5))
    return (b.astype(np.int64), _pool_windows(y1, y2, pooled[0], shape[2]),
            _pool_windows(x1, x2, pooled[1], shape[3]))


@kernel("MaxRoiPool", since=1)
def max_roi_pool(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, rois = inputs[0], inputs[1]
    pooled = attrs.get("pooled_shape")
    _max_roi_pool_check(x, rois, pooled)
    ph, pw = int(pooled[0]), int(pooled[1])
    b, rows, cols = _max_roi_pool_boxes_of(rois, attrs["spatial_scale"], (ph, pw), x.shape)
    y = np.zeros((rois.shape[0], x.shape[1], ph, pw), dtype=x.dtype)
    if y.size == 0 or x.size == 0:  # no boxes or channels, or every window empty
        return (y,)
    span_h, span_w = (np.maximum((e - s).max(axis=1), 1) for s, e in (rows, cols))
    xf = _Features(x, x.dtype, int((ph * span_h * pw * span_w).sum()))
    for k in _chunks(ph * span_h, pw * span_w, np.zeros_like(span_h), x.shape[1]):
        y[k] = _max_roi_pool_boxes(xf, b[k], (rows[0][k], rows[1][k]), (cols[0][k], cols[1][k]))
    return (y,)


# ---- NonMaxSuppression --------------------------------------------------------------------------

_NMS_BLOCK = 32  # candidates decided per step of the blocked greedy pass
_NMS_BUDGET = 1 << 21  # elements of the largest IoU table of a step
_NMS_AHEAD_PAIRS = 16  # up to this many (batch, class) pairs suppress ahead (_nms_pairs), more go by blocks


def _box_table(boxes: np.ndarray, center: bool) -> np.ndarray:
    """(y_min, x_min, y_max, x_max, area) of each box, shape (5, batches, boxes), as onnxruntime forms them
    from corners [y1, x1, y2, x2] or centres [xc, yc, w, h]."""
    if center:
        hw, hh = boxes[..., 2] / 2, boxes[..., 3] / 2
        y0, x0, y1, x1 = boxes[..., 1] - hh, boxes[..., 0] - hw, boxes[..., 1] + hh, boxes[..., 0] + hw
    else:
        y0, y1 = np.minimum(boxes[..., 0], boxes[..., 2]), np.maximum(boxes[..., 0], boxes[..., 2])
        x0, x1 = np.minimum(boxes[..., 1], boxes[..., 3]), np.maximum(boxes[..., 1], boxes[..., 3])
    return np.stack([y0, x0, y1, x1, (x1 - x0) * (y1 - y0)])


def _suppresses(a: np.ndarray, b: np.ndarray, thr: Any) -> np.ndarray:
    """Whether IoU(a, b) > thr for box tables ``a`` (5, ..., I, 1) and ``b`` (5, ..., 1, J).

    onnxruntime rejects an empty intersection, a non-positive intersection, area or union before
    dividing; with the intersection clipped at 0 and thr >= 0 the quotient alone decides the same
    (a positive intersection bounds both areas and the union from below; NaN never passes).
    """
    ix = np.minimum(a[3], b[3])
    ix -= np.maximum(a[1], b[1])
    iy = np.minimum(a[2], b[2])
    iy -= np.maximum(a[0], b[0])
    np.maximum(ix, 0, out=ix)
    np.maximum(iy, 0, out=iy)
    ix *= iy
    union = a[4] + b[4]
    union -= ix
    positive = ix > 0 if thr < 0 else None
    with np.errstate(divide="ignore", invalid="ignore"):
        ix /= union
    out = ix > thr
    return out if positive is None else out & positive


def _greedy(inner: np.ndarray, alive: np.ndarray) -> np.ndarray:
    """Greedy keep mask of a block: ``alive`` (P, K) candidates, ``inner`` (P, K, K) whether the earlier
    one suppresses the later. Iterates keep = alive & ~(kept earlier suppressor) to its fixed point, which
    is unique (position j depends on positions < j only) and reached in at most K steps."""
    keep = alive
    while True:
        new = alive & ~(keep[:, :, None] & inner).any(axis=1)
        if np.array_equal(new, keep):
            return keep
        keep = new


def _nms_block(tab: np.ndarray, prev: np.ndarray, alive: np.ndarray, thr: Any) -> np.ndarray:
    """Which candidates of a block (tab (5, P, K), in score order) the greedy pass keeps, given the boxes
    already kept (prev (5, P, S), unused slots NaN, which never suppress) and the live candidates."""
    if prev.shape[2]:
        alive = alive & ~_suppresses(tab[:, :, :, None], prev[:, :, None, :], thr).any(axis=2)
    k = tab.shape[2]
    inner = _suppresses(tab[:, :, :, None], tab[:, :, None, :], thr)
    inner &= np.triu(np.ones((k, k), dtype=bool), 1)
    return _greedy(inner, alive)


def _nms_pairs_blocked(tab: np.ndarray, counts: np.ndarray, limit: int, thr: Any) -> np.ndarray:
    """_nms_pairs by blocks tested against the boxes kept before them (prev): many steps of small tables,
    better when many pairs share each step."""
    _, p, m = tab.shape
    cap = min(limit, m)
    sel = np.full((5, p, cap), np.nan, dtype=tab.dtype)
    nsel = np.zeros(p, dtype=np.int64)
    kept = np.zeros((p, m), dtype=bool)
    for start in range(0, m, _NMS_BLOCK):
        rows = np.flatnonzero((nsel < limit) & (counts > start))
        if rows.size == 0:
            break
        blk = tab[:, rows, start:start + _NMS_BLOCK]
        alive = start + np.arange(blk.shape[2]) < counts[rows, None]
        keep = _nms_block(blk, sel[:, rows, :nsel[rows].max()], alive, thr)
        rank = np.cumsum(keep, axis=1)
        keep &= rank <= (limit - nsel[rows])[:, None]
        kept[rows, start:start + blk.shape[2]] = keep
        r, c = np.nonzero(keep)
        sel[:, rows[r], nsel[rows[r]] + rank[r, c] - 1] = blk[:, r, c]
        nsel[rows] += keep.sum(axis=1)
    return kept


def _compact(live: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's live positions moved to the front, in order: (pos (P, W), live (P, W)), W the most live
    in a row; the padding slots hold position 0 and are dead."""
    rank = np.cumsum(live, axis=1)
    width = int(rank[:, -1].max()) if rank.size else 0
    r, c = np.nonzero(live)
    out = np.zeros((live.shape[0], width), dtype=np.int64)
    out[r, rank[r, c] - 1] = pos[r, c]
    return out, np.arange(width) < rank[:, -1:]


def _nms_pairs(tab: np.ndarray, counts: np.ndarray, limit: int, thr: Any) -> np.ndarray:
    """Greedy NMS of P (batch, class) pairs at once: ``tab`` (5, P, m) candidate boxes in score order, the
    first ``counts`` of each pair live. Returns the (P, m) mask of kept candidates (at most ``limit``).

    A step decides the first block of live candidates of every pair still short of ``limit`` (the greedy
    pass within the block), then the boxes it kept suppress ahead: every later live candidate of their pair
    they suppress dies, and the survivors move to the front. A live candidate has so been tested against
    every box kept before it, and clustered boxes die by the cluster, in a few steps."""
    _, p, m = tab.shape
    kept = np.zeros((p, m), dtype=bool)
    nsel = np.zeros(p, dtype=np.int64)
    rows = np.arange(p)
    width = int(counts.max()) if p else 0
    pos = np.broadcast_to(np.arange(width), (p, width))
    live = pos < counts[:, None]
    block = _NMS_BLOCK
    tri = np.triu(np.ones((block, block), dtype=bool), 1)
    while rows.size and pos.shape[1]:
        cur = tab[:, rows[:, None], pos]
        k = min(block, pos.shape[1])
        blk = cur[:, :, :k]
        inner = _suppresses(blk[:, :, :, None], blk[:, :, None, :], thr)
        inner &= tri[:k, :k]
        keep = _greedy(inner, live[:, :k])
        rank = np.cumsum(keep, axis=1)
        keep &= rank <= (limit - nsel[rows])[:, None]
        r, c = np.nonzero(keep)
        kept[rows[r], pos[r, c]] = True
        nsel[rows] += rank[:, -1].clip(max=limit - nsel[rows])
        go = nsel[rows] < limit
        rest, live = cur[:, go, k:], live[go, k:]
        rows, pos, keep, blk = rows[go], pos[go, k:], keep[go], blk[:, go]
        if rest.shape[2] == 0 or rows.size == 0:
            break
        nk = int(keep.sum(axis=1).max())
        if nk:  # the kept boxes first in each row, NaN (never suppressing) after them
            first = np.argsort(~keep, axis=1, kind="stable")[:, :nk]
            sup = np.take_along_axis(blk, first[None], axis=2)
            sup[:, ~np.take_along_axis(keep, first, axis=1)] = np.nan
            live &= ~_suppresses(sup[:, :, :, None], rest[:, :, None, :], thr).any(axis=1)
        pos, live = _compact(live, pos)
        alive = live.any(axis=1)
        rows, pos, live = rows[alive], pos[alive], live[alive]
    return kept


def _score_order(scores: np.ndarray) -> np.ndarray:
    """Per row of (P, n) float32 scores: box indices by score descending, ties by lower index, as
    onnxruntime's queue pops them. One sort of unique 64-bit keys (order-preserving bits of the
    negated score, then the index), much faster than a stable argsort of floats. NaN sorts last."""
    s = np.where(np.isnan(scores), np.float32(-np.inf), scores + np.float32(0))  # -0.0 ties with 0.0
    u = s.view(np.uint32)
    desc = np.where(u >> 31, u, ~u & 0x7FFFFFFF).astype(np.uint64)  # ascending in -score
    keys = (desc << 32) | np.arange(scores.shape[1], dtype=np.uint64)
    return (np.sort(keys, axis=1) & 0xFFFFFFFF).astype(np.int64)


def _scalar(v: Any, default: Any) -> Any:
    if v is None or np.size(v) == 0:
        return default
    return np.asarray(v).reshape(-1)[0]


def _nms_check(boxes: np.ndarray, scores: np.ndarray, center: int) -> None:
    """Raise ValueError on malformed NonMaxSuppression inputs."""
    if center not in (0, 1):
        raise ValueError(f"NonMaxSuppression: center_point_box must be 0 or 1, got {center}")
    if boxes.ndim != 3 or boxes.shape[2] != 4:
        raise ValueError(f"NonMaxSuppression: boxes must be (batches, boxes, 4), got {boxes.shape}")
    if scores.ndim != 3 or scores.shape[0] != boxes.shape[0] or scores.shape[2] != boxes.shape[1]:
        raise ValueError(f"NonMaxSuppression: scores must be (batches, classes, {boxes.shape[1]}), "
                         f"got {scores.shape}")


@kernel("NonMaxSuppression", since=10)
def non_max_suppression(inputs: Inputs, attrs: Attrs) -> Outputs:
    # candidates of each (batch, class) pair in onnxruntime's order (score descending, ties by index);
    # the greedy pass runs on all pairs at once, a block of candidates per step (see _nms_pairs: few pairs
    # suppress ahead, many go by blocks tested against the boxes kept before them)
    boxes, scores = inputs[0], inputs[1]
    get = lambda i: inputs[i] if len(inputs) > i else None  # noqa: E731
    limit = int(_scalar(get(2), 0))
    iou_thr = _scalar(get(3), boxes.dtype.type(0))
    score_thr = _scalar(get(4), None)
    center = int(attrs.get("center_point_box") or 0)
    _nms_check(boxes, scores, center)
    nb, nc, n = scores.shape
    if limit <= 0 or scores.size == 0:
        return (np.zeros((0, 3), dtype=np.int64),)
    flat = scores.reshape(nb * nc, n)
    order = _score_order(flat) if flat.dtype == np.float32 else np.argsort(-flat, axis=1, kind="stable")
    counts = np.full(nb * nc, n, dtype=np.int64)
    if score_thr is not None:  # scores above the threshold form a prefix of the order
        counts = (flat > score_thr).sum(axis=1)
    table = _box_table(boxes, bool(center)).reshape(5, nb * n)
    img = np.arange(nb * nc) // nc
    ahead = nb * nc <= _NMS_AHEAD_PAIRS
    run = _nms_pairs if ahead else _nms_pairs_blocked
    step = max(_NMS_BUDGET // ((max(int(counts.max()), 1) if ahead else min(limit, n)) * _NMS_BLOCK), 1)
    picks = []
    for s in range(0, nb * nc, step):
        sl = slice(s, s + step)
        tab = np.take(table, img[sl, None] * n + order[sl], axis=1)
        pair, pos = np.nonzero(run(tab, counts[sl], limit, iou_thr))
        pair += s
        picks.append(np.stack([img[pair], pair % nc, order[pair, pos]], axis=1))
    return (np.concatenate(picks).astype(np.int64),)
