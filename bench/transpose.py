"""Transposes that move the last axis: onnxtrain's InferenceSession against onnxruntime on one-node models.

    python -m bench.transpose [--repeats 7] [--quick]

Per model (float32): onnxtrain's run (its output a row-major copy: by OpenBLAS's omatcopy where
``engine/transpose_copy.py`` takes it), numpy's own copy of the transposed view (what the run cost before)
and onnxruntime's plain inference package, interleaved (``bench.common.compare``), medians in ms, and the
ratio of onnxtrain's time to onnxruntime's.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import onnx
from onnx import helper

from bench.common import add_repo_to_path, layer_bench_args, peers_row

add_repo_to_path()
import onnxtrain  # noqa: E402

# (name, X shape, perm, Reshape target after it or None)
CASES = [
    ("(64, 1024, 512) swap last two", (64, 1024, 512), [0, 2, 1], None),
    ("(4096, 1000) matrix", (4096, 1000), [1, 0], None),
    ("NHWC → NCHW 32×56²×64", (32, 56, 56, 64), [0, 3, 1, 2], None),
    ("NCHW → NHWC 32×64×56²", (32, 64, 56, 56), [0, 2, 3, 1], None),
    ("ViT tokens (16, 197, 768) → flat", (16, 197, 768), [0, 2, 1], [16, -1]),
    ("attention Kᵀ (8, 12, 197, 64)", (8, 12, 197, 64), [0, 1, 3, 2], None),
    ("(512, 16, 1024) swap last two", (512, 16, 1024), [0, 2, 1], None),
]
QUICK = [("(4, 96, 160) swap last two", (4, 96, 160), [0, 2, 1], None),
         ("(2, 48, 40, 16) → flat", (2, 48, 40, 16), [0, 3, 1, 2], [2, -1])]


def one_node(xs: tuple[int, ...], perm: list[int], target: list[int] | None) -> onnx.ModelProto:
    """Transpose(x, perm), then Reshape to ``target`` if given, as a float32 model (opset 17)."""
    nodes = [helper.make_node("Transpose", ["x"], ["t" if target else "y"], perm=perm)]
    inits = []
    if target:
        nodes.append(helper.make_node("Reshape", ["t", "shape"], ["y"]))
        inits.append(helper.make_tensor("shape", onnx.TensorProto.INT64, [len(target)], target))
    out = [xs[p] for p in perm]
    if target:
        known = int(np.prod([d for d in target if d != -1]))
        out = [d if d != -1 else int(np.prod(xs)) // known for d in target]
    graph = helper.make_graph(nodes, "transpose", [helper.make_tensor_value_info("x", 1, xs)],
                              [helper.make_tensor_value_info("y", 1, out)], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def main(argv: list[str] | None = None) -> int:
    import onnxruntime as ort

    quick, repeats = layer_bench_args("python -m bench.transpose", __doc__, argv, 7, 5)
    print(f"{'model':36s} {'onnxtrain ms':>12s} {'numpy copy ms':>13s} {'onnxruntime ms':>14s} {'ratio':>6s}")
    for name, xs, perm, target in QUICK if quick else CASES:
        model = one_node(xs, perm, target).SerializeToString()
        x = np.random.default_rng(0).standard_normal(xs, dtype=np.float32)
        ours = onnxtrain.InferenceSession(model)
        theirs = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        np.testing.assert_array_equal(ours.run(None, {"x": x})[0], theirs.run(None, {"x": x})[0])

        def numpy_copy(x=x, perm=perm, target=target) -> np.ndarray:
            y = x.transpose(perm).copy()
            return y.reshape(target) if target else y

        peers = {"onnxtrain": lambda: ours.run(None, {"x": x}),  # noqa: B023 - timed right here
                 "numpy": numpy_copy,
                 "onnxruntime": lambda: theirs.run(None, {"x": x})}  # noqa: B023
        print(peers_row(name, peers, (36, 12, 13, 14), repeats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
