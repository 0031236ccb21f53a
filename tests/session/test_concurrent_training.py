"""One training session, or one state's Module and Optimizer, driven from two threads: every run and step
counts (they run one at a time; two threads training one session at once lost updates)."""

from __future__ import annotations

import os

import numpy as np

from onnxtrain import TrainingSession
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module, Optimizer
from tests.session.helpers import batches, in_threads, mlp_model, params


def test_legacy_runs_from_two_threads_all_update() -> None:
    sess = TrainingSession(mlp_model(din=8, dh=256).SerializeToString(), params("AdamOptimizer"))
    data = batches(2, 64)
    lr = np.array([0.01], np.float32)

    def work(i: int) -> None:
        for _ in range(20):
            sess.run(["loss"], {"x": data[i][0], "y": data[i][1], "Learning_Rate": lr})

    assert in_threads(2, work, timeout=120) == []
    assert int(np.asarray(sess.get_state()["Update_Count_W1"]).ravel()[0]) == 41  # from 1: 40 updates


def test_module_calls_and_steps_from_two_threads(tmp_path) -> None:
    artifacts.generate_artifacts(mlp_model(din=8, dh=256), requires_grad=["W1", "b1", "W2", "b2"], loss=None,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=str(tmp_path))
    data = batches(2, 64)

    def make() -> tuple[CheckpointState, Module, Optimizer]:
        state = CheckpointState.load_checkpoint(os.path.join(tmp_path, "checkpoint"))
        module = Module(os.path.join(tmp_path, "training_model.onnx"), state)
        return state, module, Optimizer(os.path.join(tmp_path, "optimizer_model.onnx"), module)

    state, module, _ = make()
    for _ in range(15):  # the serial sum of 30 calls' gradients
        for x, y in data:
            module(x, y)
    serial = state.parameters["W1"].grad.copy()
    state, module, opt = make()
    assert in_threads(2, lambda i: [module(*data[i]) for _ in range(15)], timeout=120) == []
    np.testing.assert_allclose(state.parameters["W1"].grad, serial, rtol=1e-4, atol=1e-6)
    assert in_threads(2, lambda i: [opt.step() for _ in range(20)], timeout=120) == []
    assert opt.step_count == 40
