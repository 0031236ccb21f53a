"""Review K: ``onnxtrain artifacts`` (the CLI) against onnxruntime-training 1.19.2's own generate_artifacts
for the same arguments (tests/ortt.py). The CLI's files are those ``onnxtrain.training.artifacts.
generate_artifacts`` writes for the same arguments, byte for byte; onnxruntime-training reads the CLI's
checkpoint (names, which train) and runs its eval model to its own artifacts' loss; and the CLI's artifacts,
trained by onnxtrain's Module and Optimizer (onnxruntime-training cannot train them: README, "Differences
from onnxruntime-training"), give the losses and weights of onnxruntime-training training its own artifacts
over three AdamW / SGD steps."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

from onnxtrain.training import artifacts as api
from tests.ortt import PREAMBLE, run_script, small_mlp

pytestmark = pytest.mark.slow

_SCRIPT = PREAMBLE + r"""
import os
import numpy as np
from onnxruntime.training import artifacts
from onnxruntime.training.api import CheckpointState, Module
model_path, ours, theirs, loss, optim, frozen = sys.argv[1:7]
os.makedirs(theirs, exist_ok=True)
frozen = [f for f in frozen.split(",") if f]
m = onnx.load(model_path)
requires = [t.name for t in m.graph.initializer if t.name not in frozen]
artifacts.generate_artifacts(m, requires_grad=requires, frozen_params=frozen,
                             loss=getattr(artifacts.LossType, loss),
                             optimizer=getattr(artifacts.OptimType, optim), artifact_directory=theirs)
x, y = (np.load(os.path.join(ours, "..", f)) for f in ("x.npy", "y.npy"))
# onnxtrain's checkpoint and eval model in onnxruntime-training (what it can read of them)
state = CheckpointState.load_checkpoint(ours + "/checkpoint")
mod = Module(theirs + "/training_model.onnx", state, ours + "/eval_model.onnx")
mod.eval()
read = {"eval": float(mod(x, y)), "params": sorted(k for k, _ in state.parameters),
        "trainable": sorted(k for k, p in state.parameters if p.requires_grad)}
state, module, opt = open_artifacts(theirs, 0.05)
module.train()
losses = []
for _ in range(3):
    losses.append(float(module(x, y)))
    opt.step()
    module.lazy_reset_grad()
params = {k: p.data.tolist() for k, p in state.parameters}
print(json.dumps({"read": read, "losses": losses, "params": params}))
"""


def _train_in_onnxtrain(folder: str, x: np.ndarray, y: np.ndarray) -> tuple[list[float], dict]:
    from onnxtrain.training.api import CheckpointState, Module, Optimizer

    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    module = Module(os.path.join(folder, "training_model.onnx"), state,
                    os.path.join(folder, "eval_model.onnx"))
    opt = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    opt.set_learning_rate(0.05)
    module.train()
    losses = []
    for _ in range(3):
        losses.append(float(np.asarray(module(x, y)).reshape(())))
        opt.step()
        module.lazy_reset_grad()
    return losses, {k: p.data for k, p in state.parameters}


@pytest.mark.parametrize(("loss", "optim", "frozen"), [("CrossEntropyLoss", "AdamW", ""),
                                                       ("MSELoss", "SGD", "fc1.weight,fc1.bias")])
def test_cli_artifacts_train_in_onnxruntime_training_as_its_own(tmp_path, loss, optim, frozen) -> None:
    model = str(tmp_path / "mlp.onnx")
    onnx.save(small_mlp(), model)
    ours = str(tmp_path / "ours")
    cmd = [sys.executable, "-m", "onnxtrain.cli", "artifacts", model, "-o", ours, "--loss", loss,
           "--optimizer", optim, *(["--frozen", frozen] if frozen else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # the CLI writes what the API writes for the same arguments
    same = str(tmp_path / "api")
    os.makedirs(same)
    names = [n for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias") if n not in frozen.split(",")]
    api.generate_artifacts(model, requires_grad=names, frozen_params=[f for f in frozen.split(",") if f],
                           loss=getattr(api.LossType, loss), optimizer=getattr(api.OptimType, optim),
                           artifact_directory=same)
    assert sorted(os.listdir(ours)) == sorted(os.listdir(same))
    for f in os.listdir(ours):
        assert filecmp.cmp(os.path.join(ours, f), os.path.join(same, f), shallow=False), f
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    y = (rng.integers(0, 3, 6).astype(np.int64) if loss == "CrossEntropyLoss"
         else rng.standard_normal((6, 3)).astype(np.float32))
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    got = run_script(_SCRIPT, model, ours, str(tmp_path / "theirs"), loss, optim, frozen)
    # onnxruntime-training reads the CLI's checkpoint (which parameters train) and runs its eval model
    assert got["read"]["params"] == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    assert got["read"]["trainable"] == sorted(names)
    np.testing.assert_allclose(got["read"]["eval"], got["losses"][0], rtol=1e-5)
    # the CLI's artifacts train in onnxtrain as onnxruntime-training trains its own
    losses, params = _train_in_onnxtrain(ours, x, y)
    np.testing.assert_allclose(losses, got["losses"], rtol=1e-5)
    assert losses[2] < losses[0]  # (it trains)
    for k, v in got["params"].items():
        np.testing.assert_allclose(params[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
