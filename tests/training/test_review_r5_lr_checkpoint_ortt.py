"""Review R5 of b21a5d95: a learning rate set past float32's range (+inf, -inf, NaN) and saved by onnxtrain,
then loaded and saved again by onnxruntime-training 1.19.2 (in its venv: it keeps the property, and the
parameters and step the rate belongs to), resumes here as saved and without a warning. One 1.19.2 spawn."""

from __future__ import annotations

import json
import math
import os
import warnings

from tests.ortt import PREAMBLE, run_script, small_mlp

RATES = [float("inf"), float("-inf"), float("nan")]

_RESAVE = PREAMBLE + r"""
from onnxruntime.training.api import CheckpointState
kept = {}
for path in json.loads(sys.argv[1]):
    s = CheckpointState.load_checkpoint(path)
    kept[path] = str(s.properties["onnxtrain.learning_rate"])
    CheckpointState.save_checkpoint(s, path + ".ortt", True)
print(json.dumps(kept))
"""


def test_a_rate_past_float32_survives_a_save_by_onnxruntime_training(tmp_path) -> None:
    from onnxtrain.training import artifacts
    from onnxtrain.training.api import CheckpointState, Module, Optimizer

    d = str(tmp_path)
    artifacts.generate_artifacts(
        small_mlp(), requires_grad=["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"],
        loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW, artifact_directory=d)

    def optimizer(state: CheckpointState) -> Optimizer:
        module = Module(os.path.join(d, "training_model.onnx"), state)
        return Optimizer(os.path.join(d, "optimizer_model.onnx"), module)

    paths = []
    for k, lr in enumerate(RATES):
        state = CheckpointState.load_checkpoint(os.path.join(d, "checkpoint"))
        optimizer(state).set_learning_rate(lr)
        paths.append(os.path.join(d, f"saved_{k}"))
        CheckpointState.save_checkpoint(state, paths[-1], include_optimizer_state=True)
    kept = run_script(_RESAVE, json.dumps(paths))
    for lr, path in zip(RATES, paths):
        assert kept[path].partition("@")[0] == repr(lr), kept  # (1.19.2 read the property as written)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            resumed = optimizer(CheckpointState.load_checkpoint(path + ".ortt")).get_learning_rate()
        assert math.isnan(resumed) if math.isnan(lr) else resumed == lr, (lr, resumed)


