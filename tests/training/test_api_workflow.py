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
