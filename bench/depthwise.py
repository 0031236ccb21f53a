"""A depthwise convolution's training graph in onnxtrain's engine against onnxruntime on the same graph.

    python -m bench.depthwise [--repeats 15] [--quick]

For MobileNetV2's depthwise 3×3 layers at batch 16 (channels, size, stride), the graph is the Conv, a
squared-sum loss and its gradients with respect to the input and the weight (``build_gradient_model``:
a ConvTranspose with one output channel per group and a grouped Conv with few outputs, the kernels of
onnxtrain/engine/kernels/depthwise.py). onnxruntime's plain inference package runs the same graph with its
default threads. Both results are checked against each other first; figures are medians of interleaved
runs, quoted as ms and as onnxtrain's time over onnxruntime's, with the engine's slowest ops.
"""

from __future__ import annotations

import collections
import os
import sys
import time

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import onnx
from onnx import helper, numpy_helper

from bench.common import add_repo_to_path, layer_bench_args

add_repo_to_path()
from onnxtrain.autodiff import build_gradient_model  # noqa: E402
from onnxtrain.engine import compile_model  # noqa: E402

# batch, channels, input size, stride: MobileNetV2's depthwise layers at 224 px, batch 16
CASES = [(16, 32, 112, 1), (16, 96, 112, 2), (16, 144, 56, 1), (16, 144, 56, 2), (16, 192, 28, 1),
         (16, 384, 14, 1), (16, 576, 14, 2), (16, 960, 7, 1)]
QUICK = [(2, 32, 16, 1), (2, 48, 16, 2)]


def gradient_graph(n: int, c: int, size: int, stride: int) -> onnx.ModelProto:
    """Conv(x, w, group=c) → Σ y² and the gradients of x and w."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((c, 1, 3, 3)) * 0.3).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], group=c, pads=[1, 1, 1, 1], strides=[stride] * 2),
             helper.make_node("Mul", ["y", "y"], ["y2"]),
             helper.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "depthwise", [helper.make_tensor_value_info("x", 1, (n, c, size, size))],
                              [helper.make_tensor_value_info("loss", 1, [])],
                              initializer=[numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return build_gradient_model(model, "loss", ["x", "w"])


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def main(argv: list[str] | None = None) -> int:
    import onnxruntime as ort

    quick, repeats = layer_bench_args("python -m bench.depthwise", __doc__, argv, 15, 3)
    print(f"{'layer':28s} {'onnxtrain ms':>12s} {'onnxruntime ms':>14s} {'ratio':>6s}  slowest ops (ms)")
    for n, c, size, stride in QUICK if quick else CASES:
        gm = gradient_graph(n, c, size, stride)
        x = np.random.default_rng(1).standard_normal((n, c, size, size)).astype(np.float32)
        plan = compile_model(gm)
        sess = ort.InferenceSession(gm.SerializeToString(), providers=["CPUExecutionProvider"])
        for ours, theirs in zip(plan.run({"x": x}), sess.run(None, {"x": x}), strict=True):
            np.testing.assert_allclose(ours, theirs, rtol=2e-3, atol=2e-3 * float(np.abs(theirs).max()))
        mine, peer = [], []
        for _ in range(repeats):  # interleaved, so that both see the same load
            mine.append(median_ms(lambda: plan.run({"x": x}), 1))  # noqa: B023 - timed right here
            peer.append(median_ms(lambda: sess.run(None, {"x": x}), 1))  # noqa: B023
        plan.profiling, plan.profile = True, []
        plan.run({"x": x})
        by_op: dict[str, float] = collections.defaultdict(float)
        for e in plan.profile:
            by_op[e.op] += e.dur_ns / 1e6
        plan.profiling = False
        top = ", ".join(f"{k} {v:.1f}" for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:3])
        t_ours, t_ort = float(np.median(mine)), float(np.median(peer))
        name = f"{n}×{c}×{size}² stride {stride}"
        print(f"{name:28s} {t_ours:12.2f} {t_ort:14.2f} {t_ours / t_ort:6.2f}  {top}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
