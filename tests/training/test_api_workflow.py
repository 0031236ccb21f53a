"""The on-device workflow end to end (issue 6 acceptance).

torch 2.13 MLP exported to ONNX → generate_artifacts → 100 AdamW steps → save with optimizer state →
100 more steps in a **new process** from the checkpoint equal 200 uninterrupted steps bit for bit →
export_model_for_inferencing → onnxruntime's InferenceSession matches Module's eval outputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from onnxtrain.training.api import CheckpointState, LinearLRScheduler, Module, Optimizer, TrainingSession
from tests.ortt import PREAMBLE, ensure_ortt, run_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, BATCH, LR, WARMUP = 100, 8, 0.01, 10


def batch(i: int) -> tuple[np.ndarray, np.ndarray]:
    """Batch ``i`` of an epoch of five random batches (labels: argmax of the first ten pixels)."""
    x = np.random.default_rng(1000 + i % 5).standard_normal((BATCH, 1, 28, 28), np.float32)
    return x, x.reshape(BATCH, -1)[:, :10].argmax(1).astype(np.int64)


def open_artifacts(folder: str, checkpoint: str) -> tuple[CheckpointState, Module, Optimizer,
                                                         LinearLRScheduler]:
    state = CheckpointState.load_checkpoint(checkpoint)
    module = Module(os.path.join(folder, "training_model.onnx"), state,
                    os.path.join(folder, "eval_model.onnx"))
    opt = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    sched = LinearLRScheduler(opt, WARMUP, 2 * STEPS, LR)
    return state, module, opt, sched


def train(module: Module, opt: Optimizer, sched: LinearLRScheduler, steps: range) -> list[float]:
    losses = []
    for i in steps:
        losses.append(float(module(*batch(i))[0]))
        opt.step()
        module.lazy_reset_grad()
        sched.step()
    return losses


def resume(folder: str, checkpoint: str, out: str) -> None:
    """Entry point of the second process: load, train steps 100..199, save the state and the losses."""
    state, module, opt, sched = open_artifacts(folder, checkpoint)
    assert opt.step_count == STEPS, opt.step_count
    losses = train(module, opt, sched, range(STEPS, 2 * STEPS))
    CheckpointState.save_checkpoint(state, out, include_optimizer_state=True)
    with open(out + ".json", "w") as f:
        json.dump({"losses": losses, "lr": opt.get_learning_rate()}, f)


@pytest.fixture(scope="module")
def artifacts_dir(tmp_path_factory) -> str:
    pytest.importorskip("torch")
    from onnxtrain.training import artifacts
    from tests.models import export

    model, _, _ = export("mlp", training=False)
    folder = str(tmp_path_factory.mktemp("mlp_artifacts"))
    params = [t.name for t in model.graph.initializer]
    artifacts.generate_artifacts(model, requires_grad=params, loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=folder,
                                 additional_output_names=["logits"])
    return folder


def test_resume_in_new_process_is_bit_identical_and_export_matches_onnxruntime(artifacts_dir, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    folder = artifacts_dir
    state, module, opt, sched = open_artifacts(folder, os.path.join(folder, "checkpoint"))
    first = train(module, opt, sched, range(STEPS))
    assert np.mean(first[-10:]) < 0.7 * np.mean(first[:10])  # it learns
    ckpt = str(tmp_path / "step100")
    CheckpointState.save_checkpoint(state, ckpt, include_optimizer_state=True)
    uninterrupted = train(module, opt, sched, range(STEPS, 2 * STEPS))

    out = str(tmp_path / "step200")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "from tests.training.test_api_workflow import resume; resume(*sys.argv[2:])")
    proc = subprocess.run([sys.executable, "-c", code, ROOT, folder, ckpt, out], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out + ".json") as f:
        resumed = json.load(f)
    assert resumed["losses"] == uninterrupted
    assert resumed["lr"] == opt.get_learning_rate()
    other = CheckpointState.load_checkpoint(out)
    for name, p in state.parameters:
        np.testing.assert_array_equal(other.parameters[name].data, p.data, err_msg=name)

    module.eval()
    x, labels = batch(500)
    loss, logits = module(x, labels)
    exported = str(tmp_path / "inference.onnx")
    module.export_model_for_inferencing(exported, ["logits"])
    sess = ort.InferenceSession(exported, providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["x"]
    np.testing.assert_allclose(sess.run(["logits"], {"x": x})[0], logits, atol=1e-5)


def test_training_session_on_generated_artifacts(artifacts_dir):
    folder = artifacts_dir
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    paths = [os.path.join(folder, f"{k}_model.onnx") for k in ("training", "eval", "optimizer")]
    sess = TrainingSession(state, *paths)
    ref_state, module, opt, sched = open_artifacts(folder, os.path.join(folder, "checkpoint"))
    sess.register_linear_lr_scheduler(WARMUP, 2 * STEPS, LR)
    sess.scheduler_step()  # the C API keeps the initial lr until the first scheduler step
    assert sess.input_names(True) == ["x", "labels"] and sess.output_names(False)[1:] == ["logits"]
    for i in range(5):
        loss = sess.train_step(list(batch(i)))[0]
        assert loss == module(*batch(i))[0]
        sess.optimizer_step()
        opt.step()
        sess.lazy_reset_grad()
        module.lazy_reset_grad()
        sess.scheduler_step()
        sched.step()
    np.testing.assert_array_equal(sess.to_buffer(False), module.get_contiguous_parameters())


def test_misuse_on_generated_artifacts(artifacts_dir, tmp_path):
    folder = artifacts_dir
    state, module, opt, _ = open_artifacts(folder, os.path.join(folder, "checkpoint"))
    x, labels = batch(0)
    with pytest.raises(TypeError, match="'labels'.*int32"):
        module(x, labels.astype(np.int32))
    with pytest.raises(ValueError, match="'x'"):
        module(x.reshape(BATCH, 28, 28), labels)
    with pytest.raises(ValueError, match="expects 2 input"):
        module(x)
    with pytest.raises(FileNotFoundError):
        Module(os.path.join(folder, "nope.onnx"), state)
    with pytest.raises(ValueError, match="not an optimizer model"):
        Optimizer(os.path.join(folder, "eval_model.onnx"), module)
    with pytest.raises(RuntimeError, match="Evaluation session not initialized"):
        Module(os.path.join(folder, "training_model.onnx"), state).eval()(x, labels)
    with pytest.raises(ValueError, match="could not be found"):
        module.export_model_for_inferencing(str(tmp_path / "m.onnx"), ["nope"])


def test_frozen_clipped_and_nominal_generated_artifacts(tmp_path):
    """Frozen first layer, SGD with ClipGradNorm (the clipped gradients are written back, as onnxruntime
    does in place), and a nominal checkpoint completed from a buffer."""
    pytest.importorskip("torch")
    from onnxtrain.training import artifacts, onnxblock
    from tests.models import export

    model, _, _ = export("mlp", training=False)
    params = [t.name for t in model.graph.initializer]
    folder = str(tmp_path)
    artifacts.generate_artifacts(model, requires_grad=params[2:], frozen_params=params[:2],
                                 loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=folder,
                                 optimizer=onnxblock.optim.SGD(clip_grad=onnxblock.optim.ClipGradNorm(0.01)),
                                 nominal_checkpoint=True)
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    training, evaluation = (os.path.join(folder, f"{k}_model.onnx") for k in ("training", "eval"))
    module = Module(training, state, evaluation)
    opt = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    assert module.get_parameters_size() == 64 * 32 + 32 + 32 * 10 + 10
    assert module.get_parameters_size(False) == module.get_parameters_size() + 784 * 64 + 64
    assert state.parameters[params[0]].grad is None and not state.parameters[params[0]].requires_grad
    frozen = state.parameters[params[0]].data.copy()
    module(*batch(0))
    before = {p: state.parameters[p].data.copy() for p in params[2:]}
    opt.step()
    grads = {p: state.parameters[p].grad for p in params[2:]}
    norm = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads.values()))
    assert norm == pytest.approx(0.01, rel=1e-4)  # max_norm / (norm + 1e-6)
    for p in params[2:]:
        want = before[p] - np.float32(0.001) * grads[p]
        np.testing.assert_allclose(state.parameters[p].data, want, atol=1e-8)
    np.testing.assert_array_equal(state.parameters[params[0]].data, frozen)

    nominal = CheckpointState.load_checkpoint(os.path.join(folder, "nominal_checkpoint"))
    other = Module(training, nominal, evaluation)
    with pytest.raises(ValueError, match="nominal"):
        other(*batch(1))
    other.copy_buffer_to_parameters(module.get_contiguous_parameters(), trainable_only=False)
    assert other.eval()(*batch(1)) == module.eval()(*batch(1))


# ---------------------------------------------------------------- against onnxruntime-training 1.19.2
# a virtualenv with onnxruntime-training 1.19.2, numpy<2, onnx (no torch); made by tests/ortt.py
ORT_VENV = os.path.join(os.environ.get("ONNXTRAIN_ORTT_DIR", "/tmp/ortt"), "bin", "python")
ORT_LR, ORT_STEPS = 0.01, 10

_ORT_SCRIPT = PREAMBLE + r'''
import numpy as np
from onnxruntime.training import artifacts
from onnxruntime.training.api import CheckpointState, LinearLRScheduler, Module, Optimizer

base, folder, data, ours10, out = sys.argv[1:6]
LR, N = float(sys.argv[6]), int(sys.argv[7])
model = onnx.load(base)
artifacts.generate_artifacts(model, requires_grad=[t.name for t in model.graph.initializer],
                             loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                             artifact_directory=folder)
batches = np.load(data)

def session(state):
    m = Module(folder + "/training_model.onnx", state, folder + "/eval_model.onnx")
    o = Optimizer(folder + "/optimizer_model.onnx", m)
    return m, o

def train(m, o, steps):
    losses = []
    for i in steps:
        losses.append(float(m(batches[f"x{i}"], batches[f"y{i}"]))); o.step(); m.lazy_reset_grad()
    return losses

res = {}
state = CheckpointState.load_checkpoint(folder + "/checkpoint")
m, o = session(state)
o.set_learning_rate(LR)
res["losses"] = train(m, o, range(N))
state.properties["epoch"] = 1
state.properties["tag"] = "ort"
state.properties["loss"] = 0.25
CheckpointState.save_checkpoint(state, out + "/ort10", True)
res["losses"] += train(m, o, range(N, 2 * N))

theirs = CheckpointState.load_checkpoint(ours10)
m2, o2 = session(theirs)
res["ours_props"] = {k: v for k, v in theirs.properties}
np.savez(out + "/ours10_in_ort.npz", **{k: p.data for k, p in theirs.parameters})
o2.set_learning_rate(LR)  # onnxruntime does not persist the learning rate
res["from_ours"] = train(m2, o2, range(N, 2 * N))

m3, o3 = session(CheckpointState.load_checkpoint(folder + "/checkpoint"))
sched = LinearLRScheduler(o3, 2, 10, 0.1)
res["lrs"] = [o3.get_learning_rate()]
for i in range(12):
    m3(batches[f"x{i}"], batches[f"y{i}"]); o3.step(); m3.lazy_reset_grad(); sched.step()
    res["lrs"].append(o3.get_learning_rate())
print(json.dumps(res))
'''


@pytest.mark.slow
def test_against_onnxruntime_training(artifacts_dir, tmp_path):
    """Same MLP, batches and AdamW settings: 20 losses agree within 1e-4; checkpoints with optimizer state
    written by either side continue training in the other; the swapped scheduler matches its Python API."""
    ensure_ortt()
    from onnxtrain.checkpoint import load_checkpoint
    from onnxtrain.training.api.checkpoint_state import LEARNING_RATE_PROPERTY
    from tests.models import export
    from tests.training.test_api import TABLE_SWAPPED

    model, _, _ = export("mlp", training=False)
    base = str(tmp_path / "base.onnx")
    with open(base, "wb") as f:
        f.write(model.SerializeToString())
    data = str(tmp_path / "batches.npz")
    np.savez(data, **{f"{k}{i}": v for i in range(20) for k, v in zip("xy", batch(i))})
    ort_dir = tmp_path / "ort_artifacts"
    ort_dir.mkdir()

    def ours(checkpoint: str) -> tuple[CheckpointState, Module, Optimizer]:
        state = CheckpointState.load_checkpoint(checkpoint)
        module = Module(os.path.join(artifacts_dir, "training_model.onnx"), state)
        opt = Optimizer(os.path.join(artifacts_dir, "optimizer_model.onnx"), module)
        opt.set_learning_rate(ORT_LR)
        return state, module, opt

    def run(module: Module, opt: Optimizer, steps: range) -> list[float]:
        losses = []
        for i in steps:
            losses.append(float(module(*batch(i))[0]))
            opt.step()
            module.lazy_reset_grad()
        return losses

    state, module, opt = ours(os.path.join(artifacts_dir, "checkpoint"))
    losses = run(module, opt, range(ORT_STEPS))
    props = {"epoch": 1, "tag": "ort", "loss": 0.25}
    for k, v in props.items():
        state.properties[k] = v
    ours10 = str(tmp_path / "ours10")
    CheckpointState.save_checkpoint(state, ours10, include_optimizer_state=True)
    losses += run(module, opt, range(ORT_STEPS, 2 * ORT_STEPS))

    args = (base, str(ort_dir), data, ours10, str(tmp_path), str(ORT_LR), str(ORT_STEPS))
    res = run_script(_ORT_SCRIPT, *args, python=ORT_VENV)

    np.testing.assert_allclose(res["losses"], losses, atol=1e-4)
    print("max |onnxruntime-training - onnxtrain| loss:", np.max(np.abs(np.subtract(res["losses"], losses))))
    # our checkpoint in onnxruntime-training: same tensors and properties (plus our learning rate), and
    # its Optimizer picks up our moments and step: the next 10 losses match ours
    ours_saved = load_checkpoint(ours10)
    seen = dict(np.load(str(tmp_path / "ours10_in_ort.npz")))
    assert sorted(seen) == sorted(ours_saved.trainable)
    for k, v in ours_saved.trainable.items():
        np.testing.assert_array_equal(seen[k], v, err_msg=k)
    saved_lr = f"{float(np.float32(ORT_LR))!r}@{ORT_STEPS}#"  # the rate, its step, the parameters' checksum
    assert res["ours_props"][LEARNING_RATE_PROPERTY].startswith(saved_lr)
    assert {k: v for k, v in res["ours_props"].items() if k != LEARNING_RATE_PROPERTY} == props
    np.testing.assert_allclose(res["from_ours"], losses[ORT_STEPS:], atol=1e-4)
    # onnxruntime-training's checkpoint in onnxtrain
    state2, module2, opt2 = ours(str(tmp_path / "ort10"))
    assert dict(state2.properties) == props and opt2.step_count == ORT_STEPS
    np.testing.assert_allclose(run(module2, opt2, range(ORT_STEPS, 2 * ORT_STEPS)), res["losses"][ORT_STEPS:],
                               atol=1e-4)
    # its Python LinearLRScheduler(opt, 2, 10, 0.1) is the swapped one
    np.testing.assert_allclose(res["lrs"], TABLE_SWAPPED, rtol=1e-6, atol=1e-9)
    state3, module3, opt3 = ours(os.path.join(artifacts_dir, "checkpoint"))
    sched = LinearLRScheduler(opt3, 2, 10, 0.1, swap_warmup_and_total=True)
    lrs = [opt3.get_learning_rate()]
    for i in range(12):
        module3(*batch(i))
        opt3.step()
        module3.lazy_reset_grad()
        sched.step()
        lrs.append(opt3.get_learning_rate())
    assert lrs == res["lrs"]
