"""Memory of the training step with recompute and mixed precision, as ratios to the plain step.

    python bench/transforms.py [--batch 32] [--seq 64] [--d 128] [--layers 2]

The exported transformer encoder of bench/gradient_graph.py (torch 2.13, TorchScript exporter, loss in
the graph). For each setting we build the legacy session's training graph (forward + backward + Adam
update, weights fed from the state store), run one step, and report the engine's ``Plan.peak_bytes``
(live tensors including weights, optimizer state and feeds) as a ratio to the plain float32 step, and
the step's wall time (one run after a warm-up; indicative only).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.gradient_graph import build, export  # noqa: E402 - run from a checkout
from onnxtrain import TrainingParameters, TrainingSession  # noqa: E402

MiB = 1 << 20
SETTINGS = {
    "float32": {},
    "transformer_layer_recompute": {"transformer_layer_recompute": True},
    "gelu_recompute": {"gelu_recompute": True},
    "mixed precision (float16)": {"use_mixed_precision": True},
    "float16 + transformer_layer_recompute": {
        "use_mixed_precision": True,
        "transformer_layer_recompute": True,
    },
}


def step_figures(model_bytes: bytes, feeds: dict[str, np.ndarray], options: dict) -> tuple[int, float]:
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "AdamOptimizer"
    for k, v in options.items():
        setattr(p, k, v)
    sess = TrainingSession(model_bytes, p)
    run_feeds = {**feeds, "Learning_Rate": np.array([1e-4], np.float32)}
    if sess.loss_scale_input_name:
        run_feeds[sess.loss_scale_input_name] = np.array([1024.0], np.float32)
    sess.run(["loss"], run_feeds)
    t0 = time.perf_counter()
    sess.run(["loss"], run_feeds)
    return sess._plan.peak_bytes, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--dropout", type=float, default=0.1)
    a = ap.parse_args(argv)
    module, feeds = build(a)
    model = export(module, feeds).SerializeToString()
    print(f"transformer encoder: {a.layers} layers, d={a.d}, seq={a.seq}, batch={a.batch}")
    print(f"{'setting':40s} {'peak MiB':>9s} {'ratio':>6s} {'step s':>7s}")
    base = None
    for name, options in SETTINGS.items():
        peak, dt = step_figures(model, feeds, options)
        base = base or peak
        print(f"{name:40s} {peak / MiB:9.1f} {peak / base:6.3f} {dt:7.3f}")


if __name__ == "__main__":
    main()
