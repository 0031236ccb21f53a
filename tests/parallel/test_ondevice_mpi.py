"""The on-device ``Module``/``Optimizer`` under ``mpiexec -n 2``: 2 ranks on half batches end with the same
weights as 1 process on whole batches (AdamW, 20 steps), and ranks holding different weights are refused.

This file is also the worker: ``mpiexec -n 2 python test_ondevice_mpi.py ARTIFACTS OUT`` trains on each
rank's half of every batch and saves ``OUT/rank<r>.npz``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from onnxtrain.training.api import CheckpointState, Module, Optimizer  # noqa: E402

STEPS, BATCH, DIN, CLASSES, LR = 20, 16, 12, 5, 0.01


def batch(i: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(500 + i)
    x = rng.standard_normal((BATCH, DIN), np.float32)
    return x, rng.integers(0, CLASSES, BATCH).astype(np.int64)


def open_artifacts(folder: str) -> tuple[CheckpointState, Module, Optimizer]:
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    module = Module(os.path.join(folder, "training_model.onnx"), state)
    opt = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    opt.set_learning_rate(LR)
    return state, module, opt


def train(module: Module, opt: Optimizer, part: Callable[[np.ndarray], np.ndarray]) -> list[float]:
    losses = []
    for i in range(STEPS):
        x, y = batch(i)
        losses.append(float(module(part(x), part(y))))
        opt.step()
        module.lazy_reset_grad()
    return losses


def weights(state: CheckpointState) -> dict[str, np.ndarray]:
    return {n: np.array(p.data) for n, p in state.parameters if p.requires_grad}


def worker(folder: str, out: str) -> None:
    """One rank: train on this rank's half of every batch; then try an Optimizer over perturbed weights
    on rank 1, which every rank must refuse."""
    from onnxtrain.parallel import split_batch, world

    w = world()
    state, module, opt = open_artifacts(folder)
    losses = train(module, opt, split_batch)
    np.savez(os.path.join(out, f"rank{w.rank}.npz"), **weights(state))
    state2, module2, _ = open_artifacts(folder)
    if w.rank == 1:
        name = next(iter(weights(state2)))
        state2.parameters[name] = state2.parameters[name].data + 1
    try:
        Optimizer(os.path.join(folder, "optimizer_model.onnx"), module2)
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    with open(os.path.join(out, f"rank{w.rank}.json"), "w") as f:
        json.dump({"losses": losses, "refused": refused, "world": list(w), "flat": opt._flat is not None}, f)


# ---- the tests (run by pytest in one process) ---------------------------------------------------

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def artifacts_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from onnxtrain import zoo
    from onnxtrain.training import artifacts

    model = zoo.mlp([DIN, 16, CLASSES], seed=3, loss=False)
    folder = str(tmp_path_factory.mktemp("ondevice_mpi"))
    artifacts.generate_artifacts(model, requires_grad=[t.name for t in model.graph.initializer],
                                 loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=folder)
    return folder


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def test_two_ranks_half_batch_equal_one_process_whole_batch(artifacts_dir: str, tmp_path) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "MPI_", "PMIX_"))}
    r = subprocess.run(["mpiexec", "-n", "2", sys.executable, os.path.abspath(__file__), artifacts_dir,
                        str(tmp_path)], capture_output=True, text=True, timeout=120, env=clean)
    assert r.returncode == 0, r.stdout + r.stderr
    state, module, opt = open_artifacts(artifacts_dir)
    ref_losses = train(module, opt, lambda a: a)
    want = weights(state)
    assert np.mean(ref_losses[-5:]) < np.mean(ref_losses[:5])  # it learns
    for rank in range(2):
        got = dict(np.load(tmp_path / f"rank{rank}.npz"))
        assert sorted(got) == sorted(want)
        for k, v in want.items():
            err = rel_err(got[k], v)
            assert err <= 1e-6, f"rank {rank} {k}: relative error {err:.3g}"
        info = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert info["world"][:2] == [rank, 2]
        assert info["flat"]  # the update over flat buffers, its gathered gradients averaged over the ranks
        # the mean of the two half-batch losses is the whole-batch loss
        assert "parameter values" in info["refused"] and "rank 1 differs" in info["refused"], info
    halves = [json.loads((tmp_path / f"rank{k}.json").read_text())["losses"] for k in range(2)]
    np.testing.assert_allclose(np.mean(halves, axis=0), ref_losses, rtol=1e-5)


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
