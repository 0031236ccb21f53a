"""BatchNormalization running statistics kept as plain constants of on-device artifacts.

When the running mean and variance are neither in ``requires_grad`` nor in ``frozen_params``, they stay
initializers of the training model, not parameters of the checkpoint. onnxruntime-training 1.19.2 then
leaves them as they are: its checkpoint and state hold no statistics, and the training model's
BatchNormalization outputs for the new statistics go nowhere. onnxtrain's Module must do the same (it
writes back only statistics that are frozen parameters: tests/training/test_ondevice_bn_running_stats.py).
Oracles: onnxruntime-training 1.19.2 generating and training the same model (tests/ortt.py), and torch's
BatchNorm2d in eval mode with the exported (unchanged) statistics.
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import onnx
import pytest

from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module
from tests.ortt import PREAMBLE, ensure_ortt

torch = pytest.importorskip("torch")

from tests.training.bn_cnn import STATS, batch, open_artifacts, train_steps  # noqa: E402

STEPS, LR = 4, 0.1


def _trainable(model: onnx.ModelProto) -> list[str]:
    return [t.name for t in model.graph.initializer if "running" not in t.name]


def _stats_of(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t).copy() for t in model.graph.initializer if t.name in STATS}


def _train(folder: str) -> tuple[CheckpointState, Module, list[float]]:
    state, module, opt = open_artifacts(folder, LR)
    return state, module, train_steps(module, opt, [batch(i) for i in range(STEPS)])


_ORT_SCRIPT = PREAMBLE + r"""
import numpy as np
from onnxruntime.training import artifacts
from onnxruntime.training.api import CheckpointState

base, folder, trainable, data, steps, lr, saved = json.loads(sys.argv[1])
model = onnx.load(base)
model.ir_version = 10
artifacts.generate_artifacts(model, requires_grad=trainable, frozen_params=[],
                             loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.SGD,
                             artifact_directory=folder)
batches = np.load(data)
state, m, o = open_artifacts(folder, lr)
generated = [k for k, _ in state.parameters]
losses = []
for i in range(steps):
    losses.append(float(m(batches[f"x{i}"], batches[f"y{i}"]))); o.step(); m.lazy_reset_grad()
CheckpointState.save_checkpoint(state, saved)
print(json.dumps({"generated": generated, "losses": losses,
                  "final": {k: p.data.tolist() for k, p in state.parameters}}))
"""


@pytest.mark.slow
def test_constant_running_stats_untouched_like_onnxruntime_training(bn_cnn_exported):
    python = ensure_ortt()
    folder, net, model = bn_cnn_exported
    original = _stats_of(model)
    trainable = _trainable(model)
    theirs, ours = str(folder / "ort"), str(folder / "ot")
    os.makedirs(theirs, exist_ok=True)
    os.makedirs(ours, exist_ok=True)
    data = str(folder / "batches.npz")
    np.savez(data, **{f"{k}{i}": v for i in range(STEPS) for k, v in zip("xy", batch(i))})
    ort_saved = str(folder / "ort_saved.ckpt")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run([python, "-c", _ORT_SCRIPT, json.dumps([str(folder / "cnn.onnx"), theirs, trainable,
                                                                   data, STEPS, LR, ort_saved])],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = json.loads(proc.stdout.strip().splitlines()[-1])
    # onnxruntime-training: the statistics are no parameters, before or after training, and stay constants
    # of its training model with their exported values
    assert not set(STATS) & set(ref["generated"]) and not set(STATS) & set(ref["final"])
    assert not set(STATS) & set(CheckpointState.load_checkpoint(ort_saved).parameters.keys())
    ort_stats = _stats_of(onnx.load(os.path.join(theirs, "training_model.onnx")))
    assert set(ort_stats) == set(STATS)
    for s in STATS:
        np.testing.assert_array_equal(ort_stats[s], original[s])

    artifacts.generate_artifacts(model, requires_grad=trainable, frozen_params=[],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=ours)
    assert sorted(CheckpointState.load_checkpoint(os.path.join(ours, "checkpoint")).parameters.keys()) \
        == sorted(ref["generated"])
    for run_dir in (theirs, ours):  # onnxruntime-training's files, and onnxtrain's of the same model
        training_file = os.path.join(run_dir, "training_model.onnx")
        for s, value in _stats_of(onnx.load(training_file)).items():
            np.testing.assert_array_equal(value, original[s], err_msg=f"{run_dir} {s} generated")
        state, module, losses = _train(run_dir)
        np.testing.assert_allclose(losses, ref["losses"], rtol=1e-5, atol=1e-6, err_msg=run_dir)
        for k, p in state.parameters:
            np.testing.assert_allclose(p.data, np.array(ref["final"][k], np.float32), rtol=1e-4, atol=1e-5,
                                       err_msg=f"{run_dir} {k}")
        assert not set(STATS) & set(state.parameters.keys())
        saved = str(folder / f"{os.path.basename(run_dir)}_saved.ckpt")
        CheckpointState.save_checkpoint(state, saved)
        assert sorted(CheckpointState.load_checkpoint(saved).parameters.keys()) == sorted(ref["final"])
        for s, value in _stats_of(onnx.load(training_file)).items():  # the files are left alone too
            np.testing.assert_array_equal(value, original[s], err_msg=f"{run_dir} {s} after training")

    # onnxtrain's eval model and inference export run on the unchanged statistics: torch in eval mode with
    # the trained parameters and the exported statistics gives the same loss
    state, module, _ = _train(ours)
    path = str(folder / "inference.onnx")
    module.export_model_for_inferencing(path, ["output"])
    exported_stats = _stats_of(onnx.load(path))
    assert set(exported_stats) == set(STATS)
    for s in STATS:
        np.testing.assert_array_equal(exported_stats[s], original[s])
    with torch.no_grad():
        sd = net.state_dict()
        for k, p in state.parameters:
            sd[k].copy_(torch.from_numpy(np.array(p.data)))
        for s in STATS:
            sd[s].copy_(torch.from_numpy(original[s]))
    net.eval()
    x, y = batch(99)
    want = torch.nn.functional.cross_entropy(net(torch.tensor(x)), torch.tensor(y)).item()
    module.eval()
    assert float(module(x, y)) == pytest.approx(want, rel=1e-5, abs=1e-6)
