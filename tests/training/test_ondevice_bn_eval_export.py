"""A model exported in eval mode (torch's default) trains its BatchNormalization with batch statistics.

onnxruntime-training's generator rewrites every BatchNormalization of the training model into a
training-mode one (its BatchNormReplacement), whatever mode the export wrote; onnxtrain's generator does the
same, and the eval model keeps the running statistics. Oracles: onnxruntime-training 1.19.2 generating and
training the same file (tests/ortt.py), with the running statistics as constants and as frozen parameters
(which its training steps update), and torch's BatchNorm2d in training mode for the first loss.
"""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest

from onnxtrain.training import artifacts
from tests.ortt import PREAMBLE, ensure_ortt, run_script

torch = pytest.importorskip("torch")

from tests.training.bn_cnn import open_artifacts, train_steps  # noqa: E402

STEPS, LR = 3, 0.1
STATS = ("bn.running_mean", "bn.running_var")


def _export(folder) -> tuple[torch.nn.Module, onnx.ModelProto]:
    """Linear → BatchNorm1d → ReLU → Linear, running statistics away from the defaults, exported in eval
    mode (torch's default)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential()
    net.add_module("fc1", torch.nn.Linear(4, 8))
    net.add_module("bn", torch.nn.BatchNorm1d(8))
    net.add_module("relu", torch.nn.ReLU())
    net.add_module("fc2", torch.nn.Linear(8, 3))
    with torch.no_grad():
        net.bn.running_mean.uniform_(-0.5, 0.5)
        net.bn.running_var.uniform_(0.5, 2.0)
    net.eval()
    path = os.path.join(folder, "mlp_bn.onnx")
    torch.onnx.export(net, torch.randn(2, 4), path, input_names=["input"], output_names=["output"],
                      dynamic_axes={"input": {0: "b"}}, dynamo=False, opset_version=17,
                      do_constant_folding=False)
    return net, onnx.load(path)


def batch(i: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(20 + i)
    return rng.standard_normal((6, 4)).astype(np.float32) * 2 + 0.5, rng.integers(0, 3, 6)

_ORT_SCRIPT = PREAMBLE + r"""
import numpy as np
from onnxruntime.training import artifacts

base, folder, trainable, frozen, data, steps, lr = json.loads(sys.argv[1])
model = onnx.load(base)
model.ir_version = 10
artifacts.generate_artifacts(model, requires_grad=trainable, frozen_params=frozen,
                             loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.SGD,
                             artifact_directory=folder)
batches = np.load(data)
from onnxruntime.training.api import CheckpointState, Module, Optimizer
state = CheckpointState.load_checkpoint(folder + "/checkpoint")
m = Module(folder + "/training_model.onnx", state, folder + "/eval_model.onnx")  # its eval() needs it
o = Optimizer(folder + "/optimizer_model.onnx", m)
o.set_learning_rate(lr)
losses = []
for i in range(steps):
    losses.append(float(m(batches[f"x{i}"], batches[f"y{i}"]))); o.step(); m.lazy_reset_grad()
m.eval()
evals = [float(m(batches[f"x{i}"], batches[f"y{i}"])) for i in range(steps)]
print(json.dumps({"losses": losses, "evals": evals,
                  "final": {k: np.asarray(p.data).tolist() for k, p in state.parameters}}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("stats", ["constants", "frozen"])
def test_eval_export_trains_batch_norm_like_onnxruntime_training(stats, tmp_path):
    python = ensure_ortt()
    net, model = _export(tmp_path)
    bn = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    assert bn and not any(a.name == "training_mode" and a.i for n in bn for a in n.attribute)  # eval export
    trainable = [t.name for t in model.graph.initializer if t.name not in STATS]
    frozen = list(STATS) if stats == "frozen" else []
    data = str(tmp_path / "batches.npz")
    np.savez(data, **{f"{k}{i}": v for i in range(STEPS) for k, v in zip("xy", batch(i))})
    theirs, ours = str(tmp_path / "ort"), str(tmp_path / "ot")
    os.makedirs(theirs)
    os.makedirs(ours)
    args = json.dumps([str(tmp_path / "mlp_bn.onnx"), theirs, trainable, frozen, data, STEPS, LR])
    ref = run_script(_ORT_SCRIPT, args, python=python)

    artifacts.generate_artifacts(model, requires_grad=trainable, frozen_params=frozen,
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=ours)
    state, module, opt = open_artifacts(ours, LR)
    losses = train_steps(module, opt, [batch(i) for i in range(STEPS)])
    module.eval()
    evals = [float(module(*batch(i))) for i in range(STEPS)]
    np.testing.assert_allclose(losses, ref["losses"], rtol=1e-5)
    np.testing.assert_allclose(evals, ref["evals"], rtol=1e-4)
    for k, p in state.parameters:
        want = np.array(ref["final"][k], np.float32)
        np.testing.assert_allclose(p.data, want, rtol=1e-4, atol=1e-5, err_msg=k)
    exported = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    if stats == "frozen":  # updated by the training steps, as onnxruntime-training's are
        assert not np.allclose(state.parameters["bn.running_mean"].data, exported["bn.running_mean"])
    net.train()  # the first loss: torch's BatchNorm in training mode, batch statistics
    x, y = batch(0)
    want = torch.nn.functional.cross_entropy(net(torch.tensor(x)), torch.tensor(y)).item()
    assert losses[0] == pytest.approx(want, rel=1e-5)
