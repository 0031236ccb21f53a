"""Detection kernels: RoiAlign, MaxRoiPool and NonMaxSuppression.

The ROI ops loop over boxes; inside a box the work is vectorised. RoiAlign's bilinear samples factor
into a row table and a column table (a sample's weight is its row weight times its column weight), so
average mode is two small matrix products over the box's band of the feature map, and max mode one
gather of every (sample, corner) value.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel


def _axis_samples(start: Any, bin_size: Any, grid: int, pooled: int, size: int,
                  dt: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps of RoiAlign's samples along one axis: positions and weights, shape (pooled, grid, 2).

    Taps are (floor, floor + 1) of the sample coordinate clamped to [0, size - 1]; a sample outside
    [-1, size] gets zero weights (it contributes 0, which still counts in max mode).
    """
    p = np.arange(pooled, dtype=dt)[:, None]
    i = np.arange(grid, dtype=dt)[None, :]
    pos = (start + p * bin_size) + (i + dt.type(0.5)) * bin_size / dt.type(grid)
    valid = (pos >= -1) & (pos <= size)
    c = np.clip(pos, 0, size - 1)
    lo = np.floor(c).astype(np.int64)
    hi = np.minimum(lo + 1, size - 1)
    frac = c - lo.astype(dt)
    zero = dt.type(0)
    w = np.stack([np.where(valid, dt.type(1) - frac, zero), np.where(valid, frac, zero)], axis=-1)
    return np.stack([lo, hi], axis=-1), w


def _band_matrix(pos: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, int]:
    """The (pooled, band) matrix summing an axis' taps, and the band's first index."""
    first, last = int(pos.min()), int(pos.max())
    m = np.zeros((pos.shape[0], last - first + 1), dtype=w.dtype)
    rows = np.broadcast_to(np.arange(pos.shape[0])[:, None, None], pos.shape)
    np.add.at(m, (rows, pos - first), w)
    return m, first


def _roi_geometry(roi: np.ndarray, attrs: Attrs, dt: np.dtype, pooled: tuple[int, int]) -> tuple[Any, ...]:
    """(start_h, start_w, bin_h, bin_w, grid_h, grid_w) of one box [x1, y1, x2, y2]."""
    half = (attrs.get("coordinate_transformation_mode") or "output_half_pixel") == "half_pixel"
    scale = dt.type(attrs["spatial_scale"])
    offset = dt.type(0.5 if half else 0.0)
    x1, y1, x2, y2 = (roi[k] * scale - offset for k in range(4))
    rh, rw = y2 - y1, x2 - x1
    if not half:  # malformed boxes become 1x1
        rh, rw = max(rh, dt.type(1)), max(rw, dt.type(1))
    bh, bw = rh / dt.type(pooled[0]), rw / dt.type(pooled[1])
    ratio = int(attrs["sampling_ratio"])
    gh = ratio if ratio > 0 else int(np.ceil(bh))
    gw = ratio if ratio > 0 else int(np.ceil(bw))
    return y1, x1, bh, bw, gh, gw


@kernel("RoiAlign", since=10)
def roi_align(inputs: Inputs, attrs: Attrs) -> Outputs:
    # one kernel for opsets 10 and 16: opset 10 has no coordinate_transformation_mode and behaves as
    # output_half_pixel; opset 16 defaults to half_pixel (the schema default fills it in)
    x, rois, batch = inputs[0], inputs[1], np.asarray(inputs[2]).reshape(-1)
    if x.ndim != 4:
        raise ValueError(f"RoiAlign: X must be 4-D (N, C, H, W), got shape {x.shape}")
    if rois.ndim != 2 or rois.shape[1] != 4 or rois.shape[0] != batch.shape[0]:
        raise ValueError(f"RoiAlign: rois must be (num_rois, 4) matching batch_indices {batch.shape}, "
                         f"got {rois.shape}")
    if batch.size and (batch.min() < 0 or batch.max() >= x.shape[0]):
        raise ValueError(f"RoiAlign: batch_indices must lie in [0, {x.shape[0]}), got {batch}")
    mode = attrs["mode"]
    if mode not in ("avg", "max"):
        raise ValueError(f"RoiAlign: mode must be 'avg' or 'max', got {mode!r}")
    ph, pw = int(attrs["output_height"]), int(attrs["output_width"])
    n, c, h, w = x.shape
    # float16 and bfloat16 compute in float32 (as onnxruntime does): float16 sample positions are off by up
    # to 1/64 pixel at 20 pixels, and the bilinear weights and the validity test with them
    dt = np.dtype(np.float32) if x.dtype.itemsize < 4 else x.dtype
    y = np.zeros((rois.shape[0], c, ph, pw), dtype=x.dtype)
    for r in range(rois.shape[0]):
        sh, sw, bh, bw, gh, gw = _roi_geometry(rois[r].astype(dt), attrs, dt, (ph, pw))
        if gh <= 0 or gw <= 0:
            continue  # no samples: the output stays 0
        ypos, wy = _axis_samples(sh, bh, gh, ph, h, dt)
        xpos, wx = _axis_samples(sw, bw, gw, pw, w, dt)
        xb = x[batch[r]].astype(dt, copy=False)
        if mode == "avg":
            my, y0 = _band_matrix(ypos, wy)
            mx, x0 = _band_matrix(xpos, wx)
            band = xb[:, y0:y0 + my.shape[1], x0:x0 + mx.shape[1]]
            y[r] = (my @ band @ mx.T) / dt.type(max(gh * gw, 1))
        else:
            vals = xb[:, ypos.reshape(-1)][:, :, xpos.reshape(-1)]
            vals *= wy.reshape(-1)[:, None] * wx.reshape(-1)[None, :]
            y[r] = vals.reshape(c, ph, gh * 2, pw, gw * 2).max(axis=(2, 4))
    return (y,)


def _round_half_away(v: Any) -> int:
    return int(np.sign(v) * np.floor(np.abs(v) + 0.5))


def max_roi_windows(roi: np.ndarray, scale: Any, pooled: tuple[int, int],
                    size: tuple[int, int]) -> tuple[int, list[tuple[int, int]], list[tuple[int, int]]]:
    """Batch index and the clipped [start, end) row and column windows of one box [b, x1, y1, x2, y2].

    Box corners are rounded half away from zero and include both ends; bin ``p`` of a box of extent
    ``e`` spans [floor(p·e/P), ceil((p+1)·e/P)), in exact integer arithmetic.
    """
    b = int(roi[0])
    x1, y1, x2, y2 = (_round_half_away(roi[k] * scale) for k in range(1, 5))
    out = []
    for s, e, p, lim in ((y1, y2, pooled[0], size[0]), (x1, x2, pooled[1], size[1])):
        ext = max(e - s + 1, 1)
        out.append([(min(max(k * ext // p + s, 0), lim), min(max(-(-(k + 1) * ext // p) + s, 0), lim))
                    for k in range(p)])
    return b, out[0], out[1]


@kernel("MaxRoiPool", since=1)
def max_roi_pool(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, rois = inputs[0], inputs[1]
    if x.ndim != 4:
        raise ValueError(f"MaxRoiPool: X must be 4-D (N, C, H, W), got shape {x.shape}")
    if rois.ndim != 2 or rois.shape[1] != 5:
        raise ValueError(f"MaxRoiPool: rois must be (num_rois, 5), got {rois.shape}")
    pooled = attrs.get("pooled_shape")
    if pooled is None or len(pooled) != 2 or min(pooled) < 1:
        raise ValueError(f"MaxRoiPool: pooled_shape must be two positive sizes, got {pooled}")
    ph, pw = int(pooled[0]), int(pooled[1])
    n, c, h, w = x.shape
    # float16 corners scale in float32: a float16 scale (0.2998 for 0.3) moves the rounding of corners
    # near a half
    if rois.dtype.itemsize < 4:
        rois = rois.astype(np.float32)
    scale = rois.dtype.type(attrs["spatial_scale"])
    y = np.zeros((rois.shape[0], c, ph, pw), dtype=x.dtype)
    for r in range(rois.shape[0]):
        b, rows, cols = max_roi_windows(rois[r], scale, (ph, pw), (h, w))
        if not 0 <= b < n:
            raise ValueError(f"MaxRoiPool: batch index {b} of roi {r} is outside [0, {n})")
        if all(e <= s for s, e in rows) or all(e <= s for s, e in cols):
            continue
        lo, hi = min(s for s, _ in cols), max(e for _, e in cols)
        full = [i for i, (hs, he) in enumerate(rows) if he > hs]
        # per bin row: the max over its rows, (C, bins, band width); then per bin column
        row_max = np.stack([x[b, :, rows[i][0]:rows[i][1], lo:hi].max(axis=1) for i in full], axis=1)
        for j, (ws, we) in enumerate(cols):
            if we > ws:
                y[r, :, :, j][:, full] = row_max[:, :, ws - lo:we - lo].max(axis=2)
    return (y,)


def _corners(boxes: np.ndarray, center: bool) -> tuple[np.ndarray, ...]:
    """(y_min, x_min, y_max, x_max) of boxes given as corners [y1, x1, y2, x2] or centres [xc, yc, w, h]."""
    if center:
        hw, hh = boxes[:, 2] / 2, boxes[:, 3] / 2
        return boxes[:, 1] - hh, boxes[:, 0] - hw, boxes[:, 1] + hh, boxes[:, 0] + hw
    return (np.minimum(boxes[:, 0], boxes[:, 2]), np.minimum(boxes[:, 1], boxes[:, 3]),
            np.maximum(boxes[:, 0], boxes[:, 2]), np.maximum(boxes[:, 1], boxes[:, 3]))


def _overlaps(k: int, cand: np.ndarray, corners: tuple[np.ndarray, ...], thr: Any) -> np.ndarray:
    """Whether box ``k``'s IoU with each candidate box exceeds ``thr`` (degenerate boxes never do)."""
    y0, x0, y1, x1 = corners
    ix = np.minimum(x1[cand], x1[k]) - np.maximum(x0[cand], x0[k])
    iy = np.minimum(y1[cand], y1[k]) - np.maximum(y0[cand], y0[k])
    inter = ix * iy
    area_c = (x1[cand] - x0[cand]) * (y1[cand] - y0[cand])
    area_k = (x1[k] - x0[k]) * (y1[k] - y0[k])
    union = area_c + area_k - inter
    ok = (ix > 0) & (iy > 0) & (inter > 0) & (area_c > 0) & (area_k > 0) & (union > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return ok & (inter / np.where(ok, union, 1) > thr)


def _scalar(v: Any, default: Any) -> Any:
    if v is None or np.size(v) == 0:
        return default
    return np.asarray(v).reshape(-1)[0]


@kernel("NonMaxSuppression", since=10)
def non_max_suppression(inputs: Inputs, attrs: Attrs) -> Outputs:
    boxes, scores = inputs[0], inputs[1]
    get = lambda i: inputs[i] if len(inputs) > i else None  # noqa: E731
    limit = int(_scalar(get(2), 0))
    iou_thr = _scalar(get(3), boxes.dtype.type(0))
    score_thr = _scalar(get(4), None)
    center = int(attrs.get("center_point_box") or 0)
    if center not in (0, 1):
        raise ValueError(f"NonMaxSuppression: center_point_box must be 0 or 1, got {center}")
    if boxes.ndim != 3 or boxes.shape[2] != 4:
        raise ValueError(f"NonMaxSuppression: boxes must be (batches, boxes, 4), got {boxes.shape}")
    if scores.ndim != 3 or scores.shape[0] != boxes.shape[0] or scores.shape[2] != boxes.shape[1]:
        raise ValueError(f"NonMaxSuppression: scores must be (batches, classes, {boxes.shape[1]}), "
                         f"got {scores.shape}")
    picked: list[tuple[int, int, int]] = []
    if limit > 0:
        for b in range(boxes.shape[0]):
            corners = _corners(boxes[b], bool(center))
            for c in range(scores.shape[1]):
                s = scores[b, c]
                order = np.argsort(-s, kind="stable")  # highest score first, ties by lower index
                if score_thr is not None:
                    order = order[s[order] > score_thr]
                kept = 0
                while order.size and kept < limit:
                    k = int(order[0])
                    picked.append((b, c, k))
                    kept += 1
                    rest = order[1:]
                    order = rest[~_overlaps(k, rest, corners, iou_thr)]
    return (np.array(picked, dtype=np.int64).reshape(-1, 3),)
