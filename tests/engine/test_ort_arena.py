"""The onnxruntime backend's memory over many input shapes: an inference graph keeps its own arena, and a
training step's graphs, which share one that grows by exactly what is asked, give its free regions back
after a run on new shapes. Before, the shared arena kept regions sized for every batch size: +300 MiB over
95 batch sizes of LeNet inference, +450 MiB training it (onnxruntime alone: a few MiB)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("onnxruntime")

SCRIPT = r"""
import sys
import numpy as np
import onnxtrain
from onnxtrain import zoo

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

so = onnxtrain.SessionOptions()
so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
rng = np.random.default_rng(0)
if sys.argv[1] == "inference":
    s = onnxtrain.InferenceSession(zoo.cnn(image=(1, 32, 32), loss=False).SerializeToString(), so)
    def step(n):
        s.run(None, {"x": rng.standard_normal((n, 1, 32, 32)).astype(np.float32)})
else:
    p = onnxtrain.TrainingParameters()
    p.loss_output_name, p.training_optimizer_name = "loss", "AdamOptimizer"
    s = onnxtrain.TrainingSession(zoo.cnn(image=(1, 32, 32)).SerializeToString(), p, so)
    lr = np.array([1e-4], np.float32)
    def step(n):
        s.run(["loss"], {"x": rng.standard_normal((n, 1, 32, 32)).astype(np.float32),
                         "y": rng.integers(0, 10, n).astype(np.int64), "Learning_Rate": lr})
step(1)
start = rss()
for n in range(2, 97):
    step(n)
print(rss() - start)
"""


@pytest.mark.parametrize("what, limit", [("inference", 80), ("training", 200)])
def test_backend_memory_over_many_batch_sizes_stays_bounded(what: str, limit: float) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, what], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    growth = float(done.stdout.split()[-1])
    assert growth < limit, f"RSS grew {growth:.0f} MiB over 95 batch sizes ({what})"
