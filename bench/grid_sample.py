"""GridSample's forward (one-node model) in onnxtrain's engine against onnxruntime on the same model.

    python -m bench.grid_sample [--repeats 7] [--quick]

X is N×C×H×W float32 and the grid N×H×W×2, random in [-1.1, 1.1] (some points fall outside the image),
for linear mode with zeros and border padding and nearest mode with zeros padding (align_corners 0).
Both results are checked against each other first (within 1e-5); figures are medians of interleaved runs,
as ms and as onnxtrain's time over onnxruntime's (onnxruntime with 2 intra-op threads).
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

SHAPES = [(64, 1, 28, 28), (16, 32, 32, 32), (8, 64, 64, 64)]
QUICK = [(4, 1, 12, 12), (2, 5, 10, 10)]
MODES = [("linear", "zeros"), ("linear", "border"), ("nearest", "zeros")]


def grid_sample_model(shape: tuple[int, ...], mode: str, padding: str,
                      align_corners: int = 0) -> onnx.ModelProto:
    """One GridSample node (opset 20) on X of ``shape`` and a grid with X's spatial size."""
    n, c, h, w = shape
    node = helper.make_node("GridSample", ["X", "grid"], ["Y"], mode=mode, padding_mode=padding,
                            align_corners=align_corners)
    g = helper.make_graph([node], "grid_sample",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, [n, c, h, w]),
                           helper.make_tensor_value_info("grid", TensorProto.FLOAT, [n, h, w, 2])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [n, c, h, w])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)], ir_version=9)


def feeds(shape: tuple[int, ...], seed: int = 0) -> dict[str, np.ndarray]:
    n, c, h, w = shape
    rng = np.random.default_rng(seed)
    return {"X": rng.standard_normal(shape).astype(np.float32),
            "grid": rng.uniform(-1.1, 1.1, (n, h, w, 2)).astype(np.float32)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.grid_sample", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="small shapes, short samples (a smoke run)")
    args = p.parse_args(argv)
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    for mode, padding in MODES:
        for shape in QUICK if args.quick else SHAPES:
            model = grid_sample_model(shape, mode, padding)
            theirs = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
            ours = compile_model(model)
            f = feeds(shape)
            want, got = theirs.run(None, f)[0], ours.run(f)[0]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            label = f"{mode}/{padding} {'×'.join(map(str, shape))}"
            least = 0.02 if args.quick else 0.05
            line = timed_against_onnxruntime(label, ours, theirs, f, args.repeats, least)
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
