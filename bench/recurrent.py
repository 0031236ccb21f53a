"""Recurrent layers and bag pooling trained through onnxtrain against torch eager, in the same run.

    python -m bench.recurrent [--repeats 7] [--quick]

Each model is a torch module with its loss, exported by torch 2.13's TorchScript exporter and trained by
the legacy ``TrainingSession`` with SGD; torch eager runs the same module with ``torch.optim.SGD``. Both
peers are timed in turn (bench/common.py), with a pause before each turn so that the other peer's idle
threads have gone to sleep, one training step per call, and quoted as ms per step and as
onnxtrain's time over torch's (no target: figures to track):

* ``nn.LSTM(64, 128)`` and ``nn.GRU(64, 128)`` over 50 steps at batch 32, the last state to 10 classes;
* ``nn.EmbeddingBag(1000, 32, mode="mean")`` over 256 bags of 8 ids and a linear head (the exported
  bag-pooling Loop, onnxtrain/engine/bag_loops.py).
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from bench.common import add_repo_to_path, compare

add_repo_to_path()
PAUSE = 0.15  # seconds before each peer's turn: the other peer's idle BLAS/OpenMP threads go to sleep


def _cases(quick: bool):
    """(title, torch module with its loss, feeds in forward order, dynamic axes)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Recurrent(nn.Module):
        def __init__(self, kind: str) -> None:
            super().__init__()
            self.rnn = getattr(nn, kind)(64, 128, batch_first=True)
            self.head = nn.Linear(128, 10)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out, _ = self.rnn(x)
            return F.cross_entropy(self.head(out[:, -1]), y)

    class Bags(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = nn.EmbeddingBag(1000, 32, mode="mean")
            self.head = nn.Linear(32, 1)

        def forward(self, ids: torch.Tensor, offsets: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return ((self.head(self.bag(ids, offsets)).squeeze(-1) - target) ** 2).mean()

    rng = np.random.default_rng(0)
    steps = 10 if quick else 50
    seq = {"x": rng.standard_normal((32, steps, 64), np.float32), "y": rng.integers(0, 10, 32)}
    seq_axes = {"x": {0: "batch"}, "y": {0: "batch"}}
    bags = 32 if quick else 256
    bag_feeds = {"ids": rng.integers(0, 1000, bags * 8), "offsets": np.arange(0, bags * 8, 8),
                 "target": rng.standard_normal(bags).astype(np.float32)}
    bag_axes = {"ids": {0: "n"}, "offsets": {0: "b"}, "target": {0: "b"}}
    torch.manual_seed(0)
    return [
        (f"LSTM 64→128, {steps} steps, batch 32", Recurrent("LSTM"), seq, seq_axes),
        (f"GRU 64→128, {steps} steps, batch 32", Recurrent("GRU"), seq, seq_axes),
        (f"EmbeddingBag 1000×32 mean, {bags} bags of 8", Bags(), bag_feeds, bag_axes),
    ]


def bench_case(title: str, module, feeds: dict, axes: dict, repeats: int) -> float:
    """Both peers' training step on one model; returns onnxtrain's time over torch's."""
    import torch

    from onnxtrain import TrainingParameters, TrainingSession
    from tests.models import export_torchscript

    names = list(feeds)
    model = export_torchscript(module, tuple(torch.from_numpy(v) for v in feeds.values()), names, ["loss"],
                               axes, training=True)
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    sess = TrainingSession(model.SerializeToString(), p)
    ours_feeds = {**feeds, "Learning_Rate": np.array([1e-3], np.float32)}
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    args = [torch.from_numpy(v) for v in feeds.values()]

    def theirs() -> None:
        opt.zero_grad()
        module(*args).backward()
        opt.step()

    t = compare({"onnxtrain": lambda: sess.run(["loss"], ours_feeds), "torch eager": theirs}, repeats=repeats,
                pause=PAUSE)
    ours, torch_s = t["onnxtrain"].median, t["torch eager"].median
    print(f"{title}: onnxtrain {ours * 1e3:.2f} ms vs torch eager {torch_s * 1e3:.2f} ms per training step "
          f"→ ratio {ours / torch_s:.2f}×")
    return ours / torch_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="small sizes, 5 repeats (a smoke run)")
    a = ap.parse_args(argv)
    repeats = 5 if a.quick else a.repeats
    for title, module, feeds, axes in _cases(a.quick):
        bench_case(title, module, feeds, axes, repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
