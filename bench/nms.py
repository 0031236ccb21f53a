"""NonMaxSuppression in onnxtrain's engine against onnxruntime on detection-style inputs.

    python -m bench.nms [--repeats 7] [--quick]

Boxes are clustered as a detector's are (jittered around 50 centres of an image, sizes varying around each
centre's), scores uniform random: (a) 1 batch × 80 classes × 1,000 boxes, score threshold 0.05, IoU 0.5,
at most 100 a class (YOLO/SSD-like); (b) 1 × 1 class × 5,000 boxes, at most 300; (c) 8 batches × 20
classes × 200 boxes; (d) case (a) with centre boxes (center_point_box=1). The selected indices are checked
equal to onnxruntime's first; figures are medians of interleaved runs, as ms and as onnxtrain's time over
onnxruntime's (onnxruntime with its default threads).
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import onnx
from onnx import TensorProto, helper

from bench.common import add_repo_to_path, timed_against_onnxruntime

add_repo_to_path()
from onnxtrain.engine import compile_model  # noqa: E402

CENTRES = 50


def model(center: bool) -> onnx.ModelProto:
    """One NonMaxSuppression node (opset 11) taking boxes, scores and the three scalars as inputs."""
    names = ["boxes", "scores", "max_output", "iou", "score_threshold"]
    node = helper.make_node("NonMaxSuppression", names, ["selected"], center_point_box=int(center))
    ins = [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [None, None, 4]),
           helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, None, None]),
           helper.make_tensor_value_info("max_output", TensorProto.INT64, [1]),
           helper.make_tensor_value_info("iou", TensorProto.FLOAT, [1]),
           helper.make_tensor_value_info("score_threshold", TensorProto.FLOAT, [1])]
    g = helper.make_graph([node], "nms", ins, [helper.make_tensor_value_info("selected", TensorProto.INT64,
                                                                              [None, 3])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)], ir_version=7)


def inputs(batches: int, classes: int, n: int, limit: int, center: bool, score: float = 0.05,
           iou: float = 0.5, seed: int = 0) -> dict[str, np.ndarray]:
    """Feeds: ``n`` boxes an image jittered around CENTRES centres of a 640-pixel image (box sizes 20-200
    pixels a centre, a box jittered by 5% of its size (s.d.) and scaled by 0.9-1.1), uniform random scores."""
    rng = np.random.default_rng(seed)
    centre = rng.uniform(0, 640, (batches, CENTRES, 2))
    size = rng.uniform(20, 200, (batches, CENTRES, 2))
    which = rng.integers(CENTRES, size=(batches, n))
    pick = lambda a: np.take_along_axis(a, which[:, :, None], axis=1)  # noqa: E731
    c, s = pick(centre), pick(size)
    c = c + rng.normal(0, 0.05, (batches, n, 2)) * s
    s = s * rng.uniform(0.9, 1.1, (batches, n, 2))
    if center:  # [x_centre, y_centre, width, height]
        boxes = np.concatenate([c[:, :, ::-1], s[:, :, ::-1]], axis=2)
    else:  # [y1, x1, y2, x2]
        boxes = np.concatenate([c - s / 2, c + s / 2], axis=2)
    return {"boxes": boxes.astype(np.float32),
            "scores": rng.random((batches, classes, n)).astype(np.float32),
            "max_output": np.array([limit], np.int64), "iou": np.array([iou], np.float32),
            "score_threshold": np.array([score], np.float32)}


CASES = [
    # label, (batches, classes, boxes), max output a class, center_point_box
    ("(a) 1 × 80 classes × 1,000 boxes, max 100", (1, 80, 1000), 100, False),
    ("(b) 1 × 1 class × 5,000 boxes, max 300", (1, 1, 5000), 300, False),
    ("(c) 8 × 20 classes × 200 boxes, max 100", (8, 20, 200), 100, False),
    ("(d) as (a), center_point_box=1", (1, 80, 1000), 100, True),
]
QUICK = [("(a') 1 × 8 classes × 300 boxes, max 50", (1, 8, 300), 50, False),
         ("(d') as (a'), center_point_box=1", (1, 8, 300), 50, True)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="smaller inputs, fewer rounds")
    args = p.parse_args(argv)
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    for label, shape, limit, center in QUICK if args.quick else CASES:
        m = model(center)
        theirs = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        ours = compile_model(m)
        feeds = inputs(*shape, limit, center)
        want, got = theirs.run(None, feeds)[0], ours.run(feeds)[0]
        assert got.dtype == want.dtype and np.array_equal(got, want), f"{label}: selected indices differ"
        print(timed_against_onnxruntime(f"{label} ({len(want)} selected)", ours, theirs, feeds, args.repeats,
                                        0.02 if args.quick else 0.1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
