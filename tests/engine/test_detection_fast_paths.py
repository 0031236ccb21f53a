"""The batched paths of the detection kernels against onnxruntime, on sizes that take them.

NonMaxSuppression decides candidates in blocks for all (batch, class) pairs at once and splits the pairs
into groups under a memory budget; RoiAlign and MaxRoiPool go through boxes in chunks and read X either
channels-last or in place. The budgets and block size are shrunk here so that small inputs cross every
boundary; onnxruntime is the oracle (exact indices for NMS and the max modes, float32 rounding for avg).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from onnxtrain.engine.kernels import detection
from tests.op_cases import OpCase
from tests.op_cases.harness import feeds_of, one_node_model, run_ours

ort = pytest.importorskip("onnxruntime")


def _both(op: str, inputs: list[Any], opset: int, **attrs: Any) -> tuple[np.ndarray, np.ndarray]:
    """(ours, onnxruntime's) output of one ``op`` node on ``inputs``."""
    model = one_node_model(OpCase(op, attrs=attrs, opset=opset), inputs)
    feeds = feeds_of(inputs)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return run_ours(model, feeds)[0], sess.run(None, feeds)[0]


# ---- NonMaxSuppression ----------------------------------------------------------------------------


def _nms_inputs(rng: np.random.Generator, shape: tuple[int, int, int], center: bool, limit: int,
                iou: float, score: float | None, ties: bool = False, spread: float = 60.0,
                grid: bool = False) -> list[Any]:
    """Boxes over a ``spread``-wide square (denser when smaller; on the integer grid, where IoUs hit
    thresholds like 1/2 exactly, if ``grid``), scores, and the scalar inputs."""
    nb, nc, n = shape
    c = rng.uniform(0, spread, (nb, n, 2))
    size = rng.uniform(0.0, 8.0, (nb, n, 2))
    if grid:
        c, size = np.round(c), np.round(size / 2) * 2
    size[rng.random((nb, n, 2)) < 0.02] = 0  # some degenerate boxes
    return nms_feeds(rng, c, size, nc, center, limit, iou, score, ties)


def nms_feeds(rng: np.random.Generator, c: np.ndarray, size: np.ndarray, nc: int, center: bool, limit: int,
              iou: float, score: float | None, ties: bool, nan: float | None = None) -> list[Any]:
    """NonMaxSuppression's inputs for boxes of centres ``c`` and sizes ``size`` (nb, n, 2): the boxes as
    centre boxes or as corners in either order, ``nc`` classes of scores (rounded to eighths when ``ties``;
    a fraction ``nan`` NaN, drawn unless None), and the scalar inputs."""
    nb, n = c.shape[:2]
    if center:  # [x_centre, y_centre, width, height]
        boxes = np.concatenate([c, size], axis=2)
    else:  # [y1, x1, y2, x2], corners in either order
        flip = rng.random((nb, n, 1)) < 0.3
        lo, hi = c - size / 2, c + size / 2
        boxes = np.concatenate([np.where(flip, hi, lo), np.where(flip, lo, hi)], axis=2)
    scores = rng.random((nb, nc, n))
    if ties:
        scores = np.round(scores * 8) / 8
    if nan is not None:
        scores[rng.random(scores.shape) < nan] = np.nan
    out = [boxes.astype(np.float32), scores.astype(np.float32), np.array([limit], np.int64),
           np.array([iou], np.float32)]
    return out if score is None else [*out, np.array([score], np.float32)]


_NMS_CASES = [
    # (batches, classes, boxes), center, limit, iou, score threshold, ties, spread[, grid]
    ((2, 3, 400), False, 50, 0.5, 0.05, False, 60.0),
    ((2, 2, 300), False, 300, 0.5, None, False, 12.0, True),
    ((2, 2, 300), True, 300, 0.25, None, True, 12.0, True),
    ((2, 3, 400), True, 1000, 0.5, None, False, 60.0),
    ((1, 4, 300), False, 2**40, 0.3, 0.2, True, 30.0),
    ((2, 2, 250), True, 7, 0.0, None, True, 60.0),
    ((2, 2, 250), False, 300, 1.0, 0.5, False, 20.0),
    ((3, 2, 500), False, 120, 0.6, None, False, 10.0),  # dense: long suppression chains
    ((1, 1, 97), False, 96, 0.4, 0.9, False, 15.0),
]


@pytest.mark.parametrize("k", range(len(_NMS_CASES)))
@pytest.mark.parametrize("small", [False, True])
def test_nms_matches_onnxruntime(k: int, small: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    shape, center, limit, iou, score, ties, spread, *grid = _NMS_CASES[k]
    if small:  # blocks of 5 candidates, one pair per group
        monkeypatch.setattr(detection, "_NMS_BLOCK", 5)
        monkeypatch.setattr(detection, "_NMS_BUDGET", 1)
    inputs = _nms_inputs(np.random.default_rng(k), shape, center, limit, iou, score, ties, spread, *grid)
    got, want = _both("NonMaxSuppression", inputs, 11, center_point_box=int(center))
    assert got.dtype == np.int64 and got.shape == want.shape and len(want) > 0
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("case", ["limit0", "no_boxes", "no_classes", "all_below_threshold"])
def test_nms_empty_results_match_onnxruntime(case: str) -> None:
    shape = {"no_boxes": (2, 3, 0), "no_classes": (2, 0, 40)}.get(case, (2, 3, 40))
    inputs = _nms_inputs(np.random.default_rng(1), shape, False, 0 if case == "limit0" else 10, 0.5,
                         2.0 if case == "all_below_threshold" else 0.1)
    got, want = _both("NonMaxSuppression", inputs, 11)
    assert got.shape == want.shape == (0, 3)


def test_nms_score_order_is_stable_descending() -> None:
    rng = np.random.default_rng(3)
    s = np.round(rng.standard_normal((4, 300)) * 3).astype(np.float32) / 3
    s[0, :20] = -0.0
    s[0, 20:40] = 0.0
    s[1, :10], s[1, 10:20] = np.inf, -np.inf
    s[2, :10], s[2, 10:20] = np.float32(1e-45), -np.float32(1e-45)
    np.testing.assert_array_equal(detection._score_order(s), np.argsort(-s, axis=1, kind="stable"))


# ---- RoiAlign and MaxRoiPool ----------------------------------------------------------------------


def _rois(rng: np.random.Generator, n: int, extent: float, size: float,
          batches: int) -> tuple[np.ndarray, ...]:
    """``n`` boxes [x1, y1, x2, y2] starting in [-4, extent) with sides up to ``size``, some reversed, and
    batch indices."""
    xy = rng.uniform(-4, extent, (n, 2))
    wh = rng.uniform(-0.1 * size, size, (n, 2))
    boxes = np.concatenate([xy, xy + wh], axis=1).astype(np.float32)
    return boxes, rng.integers(0, batches, n).astype(np.int64)


def _small_chunks(monkeypatch: pytest.MonkeyPatch, in_place: bool) -> None:
    """Chunks of a few boxes; X read in place (not channels-last) when ``in_place``."""
    monkeypatch.setattr(detection, "_ROI_BUDGET", 4000)
    if in_place:
        class InPlace(detection._Features):
            def __init__(self, x: np.ndarray, dt: np.dtype, points: int):
                super().__init__(x, dt, 0)

        monkeypatch.setattr(detection, "_Features", InPlace)


_ROI_CASES = [  # mode, coordinate_transformation_mode, sampling_ratio, spatial_scale, (P, Q)
    ("avg", "half_pixel", 2, 1.0, (7, 7)),
    ("avg", "half_pixel", 0, 0.5, (3, 5)),
    ("avg", "output_half_pixel", 0, 1.0, (4, 2)),
    ("avg", "output_half_pixel", 3, 0.25, (2, 2)),
    ("max", "half_pixel", 2, 1.0, (7, 7)),
    ("max", "half_pixel", 0, 0.5, (3, 5)),
    ("max", "output_half_pixel", 0, 1.0, (4, 2)),
    ("max", "output_half_pixel", 1, 0.25, (5, 3)),
]


@pytest.mark.parametrize("k", range(len(_ROI_CASES)))
@pytest.mark.parametrize("chunks", ["default", "small", "small_in_place"])
def test_roi_align_many_boxes_match_onnxruntime(k: int, chunks: str, monkeypatch: pytest.MonkeyPatch) -> None:
    mode, ctm, ratio, scale, (ph, pw) = _ROI_CASES[k]
    if chunks != "default":
        _small_chunks(monkeypatch, chunks == "small_in_place")
    rng = np.random.default_rng(10 + k)
    x = rng.standard_normal((3, 4, 19, 23)).astype(np.float32)
    boxes, batch = _rois(rng, 300, 24 / scale, 14 / scale, 3)
    if ctm == "half_pixel":  # onnxruntime overflows on a negative adaptive grid
        boxes[:, 2:] = np.maximum(boxes[:, 2:], boxes[:, :2])
    got, want = _both("RoiAlign", [x, boxes, batch], 16, mode=mode, coordinate_transformation_mode=ctm,
                      sampling_ratio=ratio, spatial_scale=scale, output_height=ph, output_width=pw)
    assert got.shape == want.shape == (300, 4, ph, pw)
    if mode == "max":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunks", ["default", "small", "small_in_place"])
@pytest.mark.parametrize("pooled, scale", [((7, 7), 1.0), ((3, 4), 0.5), ((1, 1), 0.3)])
def test_max_roi_pool_many_boxes_match_onnxruntime(pooled: tuple[int, int], scale: float, chunks: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # positive inputs: onnxruntime starts each bin's max at the smallest positive float
    if chunks != "default":
        _small_chunks(monkeypatch, chunks == "small_in_place")
    rng = np.random.default_rng(int(scale * 10))
    x = rng.uniform(0.1, 2.0, (2, 5, 17, 21)).astype(np.float32)
    boxes, batch = _rois(rng, 250, 24 / scale, 16 / scale, 2)
    boxes[::7] = np.round(boxes[::7] * 2) / 2  # halves: rounding away from zero
    rois = np.concatenate([batch[:, None].astype(np.float32), boxes], axis=1)
    got, want = _both("MaxRoiPool", [x, rois], 1, pooled_shape=list(pooled), spatial_scale=scale)
    assert got.shape == want.shape == (250, 5, *pooled)
    np.testing.assert_array_equal(got, want)


def test_chunks_respect_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(detection, "_ROI_BUDGET", 500)
    rng = np.random.default_rng(0)
    a, b, extra = rng.integers(1, 12, 200), rng.integers(1, 12, 200), rng.integers(0, 30, 200)
    groups = detection._chunks(a, b, extra, 3)
    np.testing.assert_array_equal(np.sort(np.concatenate(groups)), np.arange(200))
    for g in groups:
        assert len(g) == 1 or len(g) * (3 * a[g].max() * b[g].max() + extra[g].max()) <= 500

