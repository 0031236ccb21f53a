"""Sessions made and dropped in a loop (a hyper-parameter search, a notebook, a server), and long runs over
varying batch sizes, hold no more objects, threads, file descriptors or child processes as they go: each
session is freed as soon as it is dropped (by reference counting, with no cycle left for the collector),
and what the process keeps for all sessions (the worker threads, the locks' registry) does not grow."""

from __future__ import annotations

import gc
import os
import threading
import weakref

import numpy as np
import pytest

from onnxtrain import InferenceSession, TrainingSession, locks
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module, Optimizer
from tests.session.helpers import backend_options, batches, mlp_model, params
from tests.tiers import covering

NAMES = ("W1", "b1", "W2", "b2")


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    folder = tmp_path_factory.mktemp("art")
    artifacts.generate_artifacts(mlp_model(), requires_grad=list(NAMES), loss=None,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=str(folder))
    return folder


def _held() -> dict[str, int]:
    """What the process holds: Python containers, threads, descriptors, locks registered."""
    gc.collect()
    return {"objects": len(gc.get_objects()), "threads": threading.active_count(),
            "tasks": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd")),
            "locks": len(locks._held)}


def _one(kind: str, backend: str, art) -> list[object]:
    """Make a session of ``kind``, use it once, return the objects that make it up."""
    x, y = batches(1, 16)[0]
    so = backend_options(backend)
    if kind == "inference":
        s = InferenceSession(mlp_model().SerializeToString(), sess_options=so)
        s.run(None, {"x": x, "y": y})
        return [s]
    if kind == "legacy":
        s = TrainingSession(mlp_model().SerializeToString(), params("AdamOptimizer"), sess_options=so)
        s.run(["loss"], {"x": x, "y": y, "Learning_Rate": np.array([0.1], np.float32)})
        return [s]
    state = CheckpointState.load_checkpoint(str(art / "checkpoint"))
    module = Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"), session_options=so)
    opt = Optimizer(str(art / "optimizer_model.onnx"), module)
    module(x, y)
    opt.step()
    module.lazy_reset_grad()
    module.eval()
    module(x, y)
    return [state, module, opt]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors and threads in /proc")
# by default each kind once, the onnxruntime backend's resources with two of them; every pair with
# ONNXTRAIN_FULL_TESTS=1 (tests/tiers.py)
@pytest.mark.parametrize("kind,backend", covering(["inference", "legacy", "ondevice"],
                                                  ["onnxruntime", "numpy"], strength=1))
def test_dropped_sessions_leave_nothing_behind(kind, backend, art) -> None:
    for _ in range(2):  # warm-up: imports, the engine's shared workers, onnxruntime's environment
        _one(kind, backend, art)
    before = _held()
    was = gc.isenabled()
    try:
        for _ in range(12):
            refs = [weakref.ref(o) for o in _one(kind, backend, art)]
            gc.disable()  # freed by reference counting alone, as soon as dropped
            assert [r() for r in refs] == [None] * len(refs)
            gc.enable()
    finally:
        (gc.enable if was else gc.disable)()
    after = _held()
    assert after["objects"] - before["objects"] < 200, (before, after)
    # (no more than before: a thread or file of an earlier test may have ended meanwhile)
    assert all(after[k] <= before[k] for k in ("threads", "tasks", "fds", "locks")), (before, after)


def test_a_long_run_over_random_batch_sizes_stays_bounded(art) -> None:
    """300 steps of the on-device API over batch sizes drawn from 1..64 (a short last batch each epoch, in
    the extreme): the plans' scratch buffers (sized by the largest batch) and the objects held stop growing
    once each size was seen."""
    state = CheckpointState.load_checkpoint(str(art / "checkpoint"))
    module = Module(str(art / "training_model.onnx"), state)
    opt = Optimizer(str(art / "optimizer_model.onnx"), module)
    rng = np.random.default_rng(0)

    def steps(n: int) -> None:
        for _ in range(n):
            b = int(rng.integers(1, 65))
            module(rng.standard_normal((b, 8)).astype(np.float32), rng.integers(0, 4, b))
            opt.step()
            module.lazy_reset_grad()

    steps(150)
    before = _held()
    plans = [p for p in gc.get_objects() if type(p).__name__ == "Plan"]
    scratch = [p.scratch.nbytes for p in plans]
    steps(150)
    after = _held()
    assert after["objects"] - before["objects"] < 200, (before, after)
    assert [p.scratch.nbytes for p in plans] == scratch
    assert plans
    assert all(after[k] <= before[k] for k in ("threads", "tasks", "fds")), (before, after)
