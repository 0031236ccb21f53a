"""Review R3 (of 3fcca018): an Optimizer's learning rate set past float32's range (+inf, or NaN), taken
silently since that commit as onnxruntime-training 1.19.2 takes it, then saved with the optimizer state.

onnxtrain saves the current rate as the property ``onnxtrain.learning_rate``; loading that file said
"not a learning rate onnxtrain wrote" warned, which was untrue (onnxtrain wrote it); now the rate resumes as
saved, as a finite rate (negative and 0 included) does."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

from tests.ortt import small_mlp


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from onnxtrain.training import artifacts

    d = str(tmp_path_factory.mktemp("r3_lr_ckpt"))
    artifacts.generate_artifacts(
        small_mlp(), requires_grad=["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"],
        loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW, artifact_directory=d)
    return d


def _save_and_resume(folder: str, lr: float) -> tuple[float, list[str]]:
    """(the resumed Optimizer's rate, the warnings of the save, load and resume) after
    set_learning_rate(lr)."""
    from onnxtrain.training.api import CheckpointState, Module, Optimizer

    def optimizer(state):
        return Optimizer(os.path.join(folder, "optimizer_model.onnx"),
                         Module(os.path.join(folder, "training_model.onnx"), state))

    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    optimizer(state).set_learning_rate(lr)
    path = os.path.join(folder, f"saved_{lr!r}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)
        resumed = optimizer(CheckpointState.load_checkpoint(path)).get_learning_rate()
    return resumed, [str(w.message) for w in caught]


@pytest.mark.parametrize("lr", [0.25, -0.5, 0.0])
def test_a_finite_rate_resumes_silently(folder, lr):
    resumed, caught = _save_and_resume(folder, lr)
    assert resumed == np.float32(lr) and caught == []


@pytest.mark.parametrize("lr", [float("inf"), 1e39, float("nan")])
def test_a_rate_past_float32_saved_by_onnxtrain_loads_without_a_false_warning(folder, lr):
    resumed, caught = _save_and_resume(folder, lr)
    assert not [w for w in caught if "onnxtrain wrote" in w], caught
    with np.errstate(over="ignore"):  # (as saved: 1e39 is +inf)
        assert np.isnan(resumed) if np.isnan(lr) else resumed == np.float32(lr)
