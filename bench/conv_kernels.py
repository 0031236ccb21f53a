"""Time onnxtrain's Conv forward against onnxruntime on the same one-node model.

    python bench/conv_kernels.py [--repeat 50]

Prints, per case, the best-of-N wall time of ``Plan.run`` and of ``InferenceSession.run`` and their
ratio (onnxtrain time / onnxruntime time; lower is better, 1.0 is parity). onnxruntime uses its default
thread pool; numpy uses whatever BLAS threads it has.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from onnxtrain.engine import compile_model  # noqa: E402 - after the path shim for a checkout

# (name, op, X shape, W shape, attributes)
CASES = [
    ("lenet conv1 64x1x28x28, 6@5x5 pad 2", "Conv", (64, 1, 28, 28), (6, 1, 5, 5), {"pads": [2, 2, 2, 2]}),
    ("lenet conv2 64x6x14x14, 16@5x5", "Conv", (64, 6, 14, 14), (16, 6, 5, 5), {}),
]
EXTRA = [
    ("resnet 3x3 16x16x32x32, 16@3x3 pad 1", "Conv", (16, 16, 32, 32), (16, 16, 3, 3),
     {"pads": [1, 1, 1, 1]}),
    ("stride-2 3x3 16x32x32x32, 64@3x3", "Conv", (16, 32, 32, 32), (64, 32, 3, 3),
     {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ("depthwise 16x32x32x32, 3x3", "Conv", (16, 32, 32, 32), (32, 1, 3, 3),
     {"pads": [1, 1, 1, 1], "group": 32}),
    ("convtranspose 16x32x16x16 -> 16@4x4 s2", "ConvTranspose", (16, 32, 16, 16), (32, 16, 4, 4),
     {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
]


def one_node(op: str, xs: tuple[int, ...], w: np.ndarray, b: np.ndarray, attrs: dict) -> onnx.ModelProto:
    node = helper.make_node(op, ["x", "w", "b"], ["y"], **attrs)
    graph = helper.make_graph(
        [node], op, [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, xs)],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def best_time(fn: Callable[[], object], repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    import onnxruntime as ort

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--all", action="store_true",
                   help="also time larger, strided, depthwise and transposed convs")
    a = p.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'case':44s} {'onnxtrain ms':>12s} {'onnxruntime ms':>14s} {'ratio':>6s}")
    for name, op, xs, ws, attrs in CASES + (EXTRA if a.all else []):
        x = rng.standard_normal(xs).astype(np.float32)
        w = (rng.standard_normal(ws) * 0.1).astype(np.float32)
        m_out = ws[0] if op == "Conv" else ws[1] * attrs.get("group", 1)
        b = rng.standard_normal(m_out).astype(np.float32)
        model = one_node(op, xs, w, b, attrs)
        plan = compile_model(model)
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        ours, theirs = plan.run({"x": x})[0], sess.run(None, {"x": x})[0]
        np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-3)
        t_ours = best_time(lambda: plan.run({"x": x}), a.repeat)  # noqa: B023 - timed right here
        t_ort = best_time(lambda: sess.run(None, {"x": x}), a.repeat)  # noqa: B023
        print(f"{name:44s} {t_ours * 1e3:12.3f} {t_ort * 1e3:14.3f} {t_ours / t_ort:6.2f}")


if __name__ == "__main__":
    main()
