"""Op table rows for the detection kernels (onnxtrain/engine/kernels/detection.py)."""

from __future__ import annotations

import numpy as np

from tests.op_cases import OpCase

_X = (2, 3, 8, 9)


def roi_boxes(rng: np.random.Generator, n: int, extent: tuple[float, float], dt, outside: float = 2.0):
    """``n`` random boxes [x1, y1, x2, y2] over an image of ``extent`` (width, height), some reaching up
    to ``outside`` beyond its border."""
    w, h = extent
    x1 = rng.uniform(-outside, w * 0.7, n)
    y1 = rng.uniform(-outside, h * 0.7, n)
    x2 = x1 + rng.uniform(1.0, w * 0.6 + outside, n)
    y2 = y1 + rng.uniform(1.0, h * 0.6 + outside, n)
    return np.stack([x1, y1, x2, y2], axis=1).astype(dt)


def _roi_align_inputs(scale: float, n_rois: int = 5, reversed_box: bool = False):
    """X (2, 3, 8, 9), boxes in image coordinates (the map times 1/scale) and their batch indices."""

    def make(rng, dt):
        x = rng.uniform(-2, 2, _X).astype(dt)
        rois = roi_boxes(rng, n_rois, (_X[3] / scale, _X[2] / scale), dt)
        if reversed_box:  # x2 < x1: no samples under half_pixel (output 0), 1 pixel wide otherwise
            rois[0, [0, 2]] = rois[0, [2, 0]]
        return [x, rois, rng.integers(0, _X[0], n_rois).astype(np.int64)]

    return make


def _max_roi_pool_inputs(n_rois: int = 5):
    def make(rng, dt):
        x = rng.uniform(-2, 2, _X).astype(dt)
        boxes = roi_boxes(rng, n_rois, (2 * _X[3], 2 * _X[2]), dt)
        batch = rng.integers(0, _X[0], (n_rois, 1)).astype(dt)
        return [x, np.concatenate([batch, boxes], axis=1)]

    return make


def nms_inputs(batches: int, classes: int, n: int, center: bool, limit: int | None,
               iou: float | None = 0.5, score: float | None = 0.3, ties: bool = False):
    """Boxes in a few clusters (so that some overlap), scores, and the optional scalar inputs. Boxes and
    scores are float32 whatever the row's dtype: the schema admits float32 only."""

    def make(rng, dt):
        centres = rng.uniform(0, 10, (batches, 3, 2))[:, rng.integers(0, 3, n)]
        c = centres + rng.normal(0, 0.6, (batches, n, 2))
        size = rng.uniform(0.5, 3.0, (batches, n, 2))
        if center:
            boxes = np.concatenate([c, size], axis=2)
        else:  # [y1, x1, y2, x2], corners in either order
            lo, hi = c - size / 2, c + size / 2
            flip = rng.random((batches, n, 1)) < 0.3
            boxes = np.concatenate([np.where(flip, hi, lo)[..., ::-1], np.where(flip, lo, hi)[..., ::-1]], 2)
        scores = rng.uniform(0, 1, (batches, classes, n))
        if ties:
            scores = np.round(scores * 4) / 4
        out = [boxes.astype(np.float32), scores.astype(np.float32)]
        extra = [None if limit is None else np.array([limit], dtype=np.int64),
                 None if iou is None else np.array([iou], dtype=np.float32),
                 None if score is None else np.array([score], dtype=np.float32)]
        while extra and extra[-1] is None:
            extra.pop()
        return out + extra

    return make


_NO_MAXROIPOOL_REF = ("onnx.reference has no MaxRoiPool; tests/engine/test_detection.py checks it against "
                      "plain loops, onnxruntime and float64 finite differences")
_OPSET10 = ("onnx.reference applies opset 16's half_pixel default at opset 10 too; "
            "tests/engine/test_detection.py "
            "checks this row against onnxruntime and float64 finite differences")
_ORT_EMPTY = ("onnxruntime's RoiAlign fails (integer overflow) on a box with x2 < x1 under half_pixel, "
              "whose adaptive sample grid is negative")
_ROI = {"output_height": 3, "output_width": 2, "spatial_scale": 0.5}

CASES = [
    OpCase("RoiAlign", attrs={**_ROI, "sampling_ratio": 2}, make_inputs=_roi_align_inputs(0.5), wrt=(0,),
           opset=16, variant="half_pixel_ratio2"),
    OpCase("RoiAlign", attrs=dict(_ROI), make_inputs=_roi_align_inputs(0.5), wrt=(0,), opset=16,
           variant="half_pixel_adaptive"),
    OpCase("RoiAlign", attrs=dict(_ROI), make_inputs=_roi_align_inputs(0.5, reversed_box=True), wrt=(0,),
           opset=16, variant="half_pixel_empty_box", ort_skip=_ORT_EMPTY),
    OpCase("RoiAlign", attrs={**_ROI, "mode": "max"}, make_inputs=_roi_align_inputs(0.5, reversed_box=True),
           wrt=(0,), opset=16, variant="max_empty_box", ort_skip=_ORT_EMPTY),
    OpCase("RoiAlign", attrs={**_ROI, "coordinate_transformation_mode": "output_half_pixel"},
           make_inputs=_roi_align_inputs(0.5, reversed_box=True), wrt=(0,), opset=16,
           variant="output_half_pixel_adaptive"),
    OpCase("RoiAlign", attrs={"output_height": 2, "output_width": 3, "sampling_ratio": 3},
           make_inputs=_roi_align_inputs(1.0), wrt=(0,), opset=10, variant="opset10", skip=_OPSET10),
    OpCase("RoiAlign", attrs={**_ROI, "mode": "max", "sampling_ratio": 2}, make_inputs=_roi_align_inputs(0.5),
           wrt=(0,), opset=16, variant="max_ratio2"),
    OpCase("RoiAlign", attrs={**_ROI, "mode": "max"}, make_inputs=_roi_align_inputs(0.5), wrt=(0,),
           opset=16, variant="max_adaptive"),
    OpCase("RoiAlign", attrs={**_ROI, "mode": "max", "coordinate_transformation_mode": "output_half_pixel"},
           make_inputs=_roi_align_inputs(0.5, reversed_box=True), wrt=(0,), opset=16,
           variant="max_output_half_pixel"),
    OpCase("MaxRoiPool", attrs={"pooled_shape": [3, 2], "spatial_scale": 0.5},
           make_inputs=_max_roi_pool_inputs(), wrt=(0,), skip=_NO_MAXROIPOOL_REF),
    OpCase("NonMaxSuppression", make_inputs=nms_inputs(2, 3, 12, False, 4), grad=False),
    OpCase("NonMaxSuppression", attrs={"center_point_box": 1},
           make_inputs=nms_inputs(1, 2, 15, True, 5, 0.3, None), grad=False, variant="center"),
    OpCase("NonMaxSuppression", make_inputs=nms_inputs(2, 2, 10, False, 20, 0.0, None, ties=True),
           grad=False, variant="ties_iou0"),
]
