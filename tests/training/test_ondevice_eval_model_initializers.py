"""An eval model that holds checkpoint parameters as initializers of its own (the base model passed as
``eval_model_uri``, or an eval model of another generation) cannot evaluate the trained state; such a
training model cannot train it.

onnxruntime-training 1.19.2 builds such a Module, but its evaluation fails (it feeds the state's parameters
to an eval model that does not take them: "feed names has 1 elements, but feed has 5 elements"), and its
export writes the eval model's own values. onnxtrain evaluated with the eval model's initializers: after
training, eval mode kept giving the untrained model's outputs, without a word. Now the Module warns when
it is made, naming the parameters, and an evaluation is refused naming them, as onnxruntime-training
refuses it; the export stays onnxruntime-training's (its file gives the values onnxruntime-training's does).
The same for the base model passed as the training model: onnxruntime-training refuses its training call
("Invalid input name: lazy_reset_grad"); onnxtrain ran it with the model's own values and computed no
gradient, so nothing trained; now it warns and refuses the call.

Oracle: onnxruntime-training 1.19.2 (tests/ortt.py) on its artifacts, for the refusal and the exported
values; onnxruntime running the base model for the values an evaluation of its initializers gives.
"""

from __future__ import annotations

import os
import shutil
import warnings

import numpy as np
import onnx
import pytest

from tests.ortt import PREAMBLE, ensure_ortt, run_script, small_mlp

_PEER = PREAMBLE + r"""
import numpy as np, onnx
import onnxruntime as ort
from onnxruntime.training import artifacts
from onnxruntime.training.api import CheckpointState, Module, Optimizer
base, folder, copy = sys.argv[1:4]
artifacts.generate_artifacts(onnx.load(base), requires_grad=["fc1.weight", "fc2.weight", "fc2.bias"],
                             frozen_params=["fc1.bias"], loss=artifacts.LossType.MSELoss,
                             optimizer=artifacts.OptimType.SGD, artifact_directory=folder)
import shutil
shutil.copytree(folder, copy)
x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
y = np.zeros((2, 3), np.float32)
state = CheckpointState.load_checkpoint(folder + "/checkpoint")
module = Module(folder + "/training_model.onnx", state, base)
optimizer = Optimizer(folder + "/optimizer_model.onnx", module)
optimizer.set_learning_rate(0.5)
module(x, y)
optimizer.step()
module.eval()
out = {"names": [module.input_names(), module.output_names()]}
try:
    module(x)
    out["eval"] = "ran"
except RuntimeError as e:
    out["eval"] = str(e)
module.export_model_for_inferencing(folder + "/exported.onnx", ["output"])
out["exported"] = ort.InferenceSession(folder + "/exported.onnx", providers=["CPUExecutionProvider"]).run(
    None, {"input": x})[0].tolist()
out["trained"] = {n: p.data.tolist() for n, p in state.parameters}
# the base model as the training model
other = CheckpointState.load_checkpoint(folder + "/checkpoint")
module = Module(base, other)
out["training names"] = [module.input_names(), module.output_names()]
try:
    module(x)
    out["train"] = "ran"
except RuntimeError as e:
    out["train"] = str(e)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    python = ensure_ortt()
    root = tmp_path_factory.mktemp("eval_initializers")
    base = str(root / "mlp.onnx")
    onnx.save(small_mlp(), base)
    theirs, ours = str(root / "ortt"), str(root / "onnxtrain")
    os.makedirs(theirs)
    reference = run_script(_PEER, base, theirs, ours, python=python)
    return reference, base, ours


def _train_one_step(folder: str, eval_model: str):
    from onnxtrain.training.api import CheckpointState, Module, Optimizer

    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = Module(os.path.join(folder, "training_model.onnx"), state, eval_model)
    optimizer = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(0.5)
    module(x, np.zeros((2, 3), np.float32))
    optimizer.step()
    module.eval()
    return module, state, x, [str(w.message) for w in caught]


def test_the_base_model_as_eval_model_is_refused_as_onnxruntime_training(peer, tmp_path):
    import onnxruntime as ort

    reference, base, ours = peer
    assert "feed names has 1 elements" in reference["eval"]  # (how onnxruntime-training refuses it)
    folder = str(tmp_path / "copy")
    shutil.copytree(ours, folder)
    module, state, x, caught = _train_one_step(folder, base)
    shadowed = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert [module.input_names(), module.output_names()] == reference["names"]
    assert any(all(n in w for n in shadowed) and "initializers" in w for w in caught), caught
    with pytest.raises(RuntimeError, match="initializers") as refused:
        module(x)
    assert isinstance(refused.value, ValueError)
    assert all(n in str(refused.value) for n in shadowed)
    # the trained state is onnxruntime-training's, and so is the export (the eval model's own values)
    for name, want in reference["trained"].items():
        np.testing.assert_allclose(state.parameters[name].data, want, rtol=1e-5, atol=1e-6, err_msg=name)
    module.export_model_for_inferencing(os.path.join(folder, "exported.onnx"), ["output"])
    run = ort.InferenceSession(os.path.join(folder, "exported.onnx"), providers=["CPUExecutionProvider"]).run
    np.testing.assert_allclose(run(None, {"input": x})[0], reference["exported"], rtol=1e-6, atol=1e-6)
    base_out = ort.InferenceSession(base, providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    np.testing.assert_allclose(reference["exported"], base_out, rtol=1e-6, atol=1e-6)


def test_the_generated_eval_model_evaluates_the_trained_state(peer, tmp_path):
    """The control: the eval model generate_artifacts wrote takes the parameters as inputs; no warning, and
    eval mode gives the trained weights' output (numpy's forward pass of them)."""
    _, _, ours = peer
    folder = str(tmp_path / "copy")
    shutil.copytree(ours, folder)
    module, state, x, caught = _train_one_step(folder, os.path.join(folder, "eval_model.onnx"))
    assert not [w for w in caught if "initializers" in w]
    p = {n: prm.data.astype(np.float64) for n, prm in state.parameters}
    want = np.maximum(x @ p["fc1.weight"] + p["fc1.bias"], 0) @ p["fc2.weight"] + p["fc2.bias"]
    loss = module(x, np.zeros((2, 3), np.float32))
    np.testing.assert_allclose(loss, np.mean(want ** 2), rtol=1e-5)


def test_the_base_model_as_training_model_is_refused_as_onnxruntime_training(peer, tmp_path):
    from onnxtrain.training.api import CheckpointState, Module

    reference, base, ours = peer
    assert "Invalid input name: lazy_reset_grad" in reference["train"]  # (how onnxruntime-training refuses)
    state = CheckpointState.load_checkpoint(os.path.join(ours, "checkpoint"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = Module(base, state)
    shadowed = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert any(all(n in str(w.message) for n in shadowed) and "training model" in str(w.message)
               for w in caught), [str(w.message) for w in caught]
    assert [module.input_names(), module.output_names()] == reference["training names"]
    with pytest.raises(RuntimeError, match="initializers") as refused:
        module(np.ones((2, 4), np.float32))
    assert isinstance(refused.value, ValueError)
    assert all(n in str(refused.value) for n in shadowed)
    assert all(p.grad is None or not p.grad.any() for _, p in state.parameters)
