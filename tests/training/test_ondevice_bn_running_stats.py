"""BatchNormalization running statistics in the on-device API's training step.

A torch CNN exported in training mode has training-mode BatchNormalization nodes whose running mean and
variance are frozen parameters of the artifacts. The training step must write their new values into the
checkpoint state, as onnxruntime-training does, so that eval mode, the exported inference model and saved
checkpoints use them. Oracles: torch's BatchNorm2d (the mean directly; the variance after converting its
unbiased batch variance to the biased one ONNX specifies) and onnxruntime-training 1.19.2 running the
same files (tests/ortt.py).
"""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest

from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module
from tests.ortt import PREAMBLE, ensure_ortt, run_script

torch = pytest.importorskip("torch")

from tests.training.bn_cnn import BATCH, STATS, batch, open_artifacts  # noqa: E402

STEPS, LR = 4, 0.1


def _names(model: onnx.ModelProto) -> tuple[list[str], list[str]]:
    inits = [t.name for t in model.graph.initializer]
    return ([n for n in inits if "running" not in n and "num_batches" not in n],
            [n for n in inits if "running" in n])


def _onnxtrain_artifacts(folder, model) -> str:
    out = str(folder / "ot")
    os.makedirs(out, exist_ok=True)
    trainable, frozen = _names(model)
    artifacts.generate_artifacts(model, requires_grad=trainable, frozen_params=frozen,
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=out)
    return out


def _train_onnxtrain(folder: str, steps: int = STEPS) -> tuple[CheckpointState, Module, list[dict]]:
    state, module, opt = open_artifacts(folder, LR)
    held = {s: state.parameters[s].data for s in STATS}
    history = []
    for i in range(steps):
        module(*batch(i))
        opt.step()
        module.lazy_reset_grad()
        history.append({s: state.parameters[s].data.copy() for s in STATS})
    for s in STATS:  # updated in place: arrays taken before training see the new statistics
        assert held[s] is state.parameters[s].data
    return state, module, history


def test_running_stats_follow_torch(bn_cnn_exported):
    """onnxtrain's own artifacts: after each Module + SGD step the state's running mean is torch's, and the
    running variance torch's with the biased batch variance; eval mode and the export use them."""
    folder, net, model = bn_cnn_exported
    out = _onnxtrain_artifacts(folder, model)
    before = {s: CheckpointState.load_checkpoint(os.path.join(out, "checkpoint")).parameters[s].data.copy()
              for s in STATS}
    state, module, history = _train_onnxtrain(out)

    sgd = torch.optim.SGD(net.parameters(), lr=LR)
    n = BATCH * 6 * 6  # values per channel that BatchNorm2d averages
    rv = torch.tensor(before["bn.running_var"])
    for i in range(STEPS):
        x, y = batch(i)
        old_var = net.bn.running_var.clone()
        sgd.zero_grad()
        torch.nn.functional.cross_entropy(net(torch.tensor(x)), torch.tensor(y)).backward()
        sgd.step()
        unbiased = (net.bn.running_var - 0.9 * old_var) / 0.1  # torch's update: 0.9 old + 0.1 unbiased
        rv = 0.9 * rv + 0.1 * unbiased * (n - 1) / n  # ONNX: 0.9 old + 0.1 biased
        np.testing.assert_allclose(history[i]["bn.running_mean"], net.bn.running_mean.detach().numpy(),
                                   rtol=1e-5, atol=1e-6, err_msg=f"step {i}")
        np.testing.assert_allclose(history[i]["bn.running_var"], rv.detach().numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=f"step {i}")
    assert not np.allclose(history[-1]["bn.running_mean"], before["bn.running_mean"])

    # eval mode runs on the updated statistics: torch's eval with the state's statistics gives its outputs
    with torch.no_grad():
        net.bn.running_var.copy_(torch.tensor(state.parameters["bn.running_var"].data))
    net.eval()
    x, y = batch(99)
    want = torch.nn.functional.cross_entropy(net(torch.tensor(x)), torch.tensor(y)).item()
    module.eval()
    assert float(module(x, y)) == pytest.approx(want, rel=1e-5, abs=1e-6)
    path = str(folder / "inference.onnx")
    module.export_model_for_inferencing(path, ["output"])
    exported_inits = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}
    for s in STATS:
        np.testing.assert_array_equal(exported_inits[s], state.parameters[s].data)
    saved = str(folder / "after.ckpt")
    CheckpointState.save_checkpoint(state, saved)
    np.testing.assert_array_equal(CheckpointState.load_checkpoint(saved).parameters["bn.running_mean"].data,
                                  state.parameters["bn.running_mean"].data)


def test_user_outputs_unchanged_and_accumulation(bn_cnn_exported):
    """The statistics are no user output; each training call updates them, also while accumulating."""
    folder, _, model = bn_cnn_exported
    out = _onnxtrain_artifacts(folder, model)
    state = CheckpointState.load_checkpoint(os.path.join(out, "checkpoint"))
    module = Module(os.path.join(out, "training_model.onnx"), state)
    assert module.output_names() == [o.name for o in onnx.load(os.path.join(out, "training_model.onnx"))
                                     .graph.output if not o.name.endswith("_grad.accumulation.out")]
    seen = [state.parameters["bn.running_mean"].data.copy()]
    for i in range(3):  # no reset: accumulating calls
        module(*batch(i))
        seen.append(state.parameters["bn.running_mean"].data.copy())
    assert all(not np.array_equal(a, b) for a, b in zip(seen, seen[1:]))


_ORT_SCRIPT = PREAMBLE + r"""
import numpy as np
from onnxruntime.training import artifacts

base, generate_into, run_dirs, data, steps, lr = json.loads(sys.argv[1])
model = onnx.load(base)
model.ir_version = 10
inits = [t.name for t in model.graph.initializer]
artifacts.generate_artifacts(model, requires_grad=[n for n in inits if "running" not in n],
                             frozen_params=[n for n in inits if "running" in n],
                             loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.SGD,
                             artifact_directory=generate_into)
batches = np.load(data)
res = {}
for folder in run_dirs:
    state, m, o = open_artifacts(folder, lr)
    hist = []
    for i in range(steps):
        m(batches[f"x{i}"], batches[f"y{i}"]); o.step(); m.lazy_reset_grad()
        hist.append({k: state.parameters[k].data.tolist() for k in ("bn.running_mean", "bn.running_var")})
    res[folder] = {"history": hist, "final": {k: p.data.tolist() for k, p in state.parameters}}
print(json.dumps(res))
"""


@pytest.mark.slow
def test_running_stats_match_onnxruntime_training(bn_cnn_exported):
    """onnxruntime-training generates and trains the artifacts; onnxtrain trains the same files, and its own
    artifacts of the same model, to the same running statistics after every step and the same parameters
    (onnxruntime-training cannot run onnxtrain's standard-ONNX optimizer model)."""
    python = ensure_ortt()
    folder, _, model = bn_cnn_exported
    ours = _onnxtrain_artifacts(folder, model)
    theirs = str(folder / "ort")
    os.makedirs(theirs, exist_ok=True)
    data = str(folder / "batches.npz")
    np.savez(data, **{f"{k}{i}": v for i in range(STEPS) for k, v in zip("xy", batch(i))})
    base = str(folder / "cnn.onnx")
    ref = run_script(_ORT_SCRIPT, json.dumps([base, theirs, [theirs], data, STEPS, LR]), python=python)
    for run_dir in (theirs, ours):  # its own files, and onnxtrain's from the same model
        state, _, history = _train_onnxtrain(run_dir)
        for i, step in enumerate(ref[theirs]["history"]):
            for s in STATS:
                np.testing.assert_allclose(history[i][s], step[s], rtol=1e-5, atol=1e-6,
                                           err_msg=f"{run_dir} step {i} {s}")
        for k, p in state.parameters:
            np.testing.assert_allclose(p.data, np.array(ref[theirs]["final"][k], np.float32), rtol=1e-4,
                                       atol=1e-5, err_msg=f"{run_dir} {k}")
        assert not np.allclose(history[-1]["bn.running_mean"],
                               CheckpointState.load_checkpoint(os.path.join(run_dir, "checkpoint"))
                               .parameters["bn.running_mean"].data)
