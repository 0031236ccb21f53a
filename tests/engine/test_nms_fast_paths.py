"""NonMaxSuppression's two greedy passes, by blocks tested against the boxes kept before them and with
suppression ahead (each step's kept boxes kill the later candidates they overlap, the survivors compacted),
against onnxruntime: identical selected indices, in the same order, on clustered boxes as detectors produce
them, with score ties, many classes, batches, limits of 0, 1 and more than the boxes, with and without a
score threshold, both box formats, degenerate boxes (zero area, flipped corners) and NaN scores (which a
score threshold drops); each case by both passes, and also with tiny blocks and one pair a group, so that
every branch (compaction, rows finishing early) runs many times."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from onnxtrain.engine.kernels import detection
from tests.engine.test_detection_fast_paths import nms_feeds
from tests.op_cases import OpCase
from tests.op_cases.harness import feeds_of, one_node_model, run_ours

ort = pytest.importorskip("onnxruntime")


def _both(inputs: list[Any], center: bool) -> tuple[np.ndarray, np.ndarray]:
    """(ours, onnxruntime's) selected indices of one NonMaxSuppression node (opset 11) on ``inputs``."""
    model = one_node_model(OpCase("NonMaxSuppression", attrs={"center_point_box": int(center)}, opset=11),
                           inputs)
    feeds = feeds_of(inputs)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return run_ours(model, feeds)[0], sess.run(None, feeds)[0]


def _clustered(rng: np.random.Generator, shape: tuple[int, int, int], center: bool, limit: int, iou: float,
               score: float | None, ties: bool = True, nan: float = 0.0, degenerate: float = 0.05,
               centres: int = 12) -> list[Any]:
    """Boxes jittered around ``centres`` centres per image (some zero-area, some with flipped corners),
    scores (rounded to eighths when ``ties``; a fraction ``nan`` NaN) and the scalar inputs."""
    nb, nc, n = shape
    centre = rng.uniform(0, 100, (nb, centres, 2))
    size = rng.uniform(5, 40, (nb, centres, 2))
    which = rng.integers(centres, size=(nb, n))
    c = np.take_along_axis(centre, which[:, :, None], axis=1)
    s = np.take_along_axis(size, which[:, :, None], axis=1)
    c = c + rng.normal(0, 0.08, (nb, n, 2)) * s
    s = s * rng.uniform(0.8, 1.2, (nb, n, 2))
    s[rng.random((nb, n, 2)) < degenerate] = 0
    return nms_feeds(rng, c, s, nc, center, limit, iou, score, ties, nan)


_CASES = {
    # name: (batches, classes, boxes), center, limit, iou, score threshold, extra keywords
    "many_classes": ((1, 40, 300), False, 100, 0.5, 0.05, {}),
    "batches": ((3, 5, 200), False, 30, 0.5, None, {}),
    "center": ((2, 6, 250), True, 50, 0.45, 0.1, {}),
    "center_no_threshold": ((2, 3, 300), True, 1000, 0.3, None, {}),
    "limit1": ((2, 7, 150), False, 1, 0.5, None, {}),
    "limit_large": ((1, 4, 400), False, 2**40, 0.6, None, {"centres": 40}),
    "one_pair_many_boxes": ((1, 1, 3000), False, 300, 0.5, 0.2, {"centres": 30}),
    "dense": ((2, 2, 500), False, 200, 0.7, None, {"centres": 3}),
    "iou0": ((2, 3, 120), True, 20, 0.0, None, {}),
    "iou1": ((1, 3, 200), False, 500, 1.0, 0.3, {}),
    "no_ties": ((2, 4, 300), False, 60, 0.5, 0.05, {"ties": False}),
    "degenerate": ((2, 3, 200), False, 100, 0.4, None, {"degenerate": 0.5}),
    "nan_scores": ((2, 4, 300), False, 50, 0.5, 0.05, {"nan": 0.1}),
    "nan_scores_center": ((1, 5, 300), True, 80, 0.5, 0.0, {"nan": 0.3}),
}


@pytest.mark.parametrize("name", list(_CASES))
@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("ahead", [False, True])
def test_nms_matches_onnxruntime(name: str, small: bool, ahead: bool,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    shape, center, limit, iou, score, extra = _CASES[name]
    monkeypatch.setattr(detection, "_NMS_AHEAD_PAIRS", 1 << 30 if ahead else 0)
    if small:  # blocks of 3 candidates, one pair per group
        monkeypatch.setattr(detection, "_NMS_BLOCK", 3)
        monkeypatch.setattr(detection, "_NMS_BUDGET", 1)
    inputs = _clustered(np.random.default_rng(len(name)), shape, center, limit, iou, score, **extra)
    got, want = _both(inputs, center)
    assert got.dtype == np.int64 and got.shape == want.shape and len(want) > 0
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("center", [False, True])
@pytest.mark.parametrize("score", [None, 0.5])
def test_nms_limit0_selects_nothing(center: bool, score: float | None) -> None:
    got, want = _both(_clustered(np.random.default_rng(5), (2, 3, 100), center, 0, 0.5, score), center)
    assert got.shape == want.shape == (0, 3)


@pytest.mark.parametrize("seed", range(8))
def test_nms_random_shapes_match_onnxruntime(seed: int) -> None:  # either path, by the pairs' count
    rng = np.random.default_rng(100 + seed)
    shape = (int(rng.integers(1, 4)), int(rng.integers(1, 30)), int(rng.integers(1, 700)))
    center = bool(rng.integers(2))
    score = None if rng.random() < 0.4 else float(rng.uniform(0, 0.5))
    inputs = _clustered(rng, shape, center, int(rng.integers(1, 200)), float(rng.uniform(0.1, 0.9)), score,
                        ties=bool(rng.integers(2)), centres=int(rng.integers(1, 40)))
    got, want = _both(inputs, center)
    np.testing.assert_array_equal(got, want)
