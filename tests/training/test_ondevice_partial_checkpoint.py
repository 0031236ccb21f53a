"""A checkpoint that lacks some of the training model's parameters (spec §3.1).

onnxruntime-training builds the Module anyway: the parameters the checkpoint does not hold become user
inputs. onnxtrain does the same and warns, naming them and the checkpoint. Oracles: onnxruntime-training
1.19.2 (tests/ortt.py) on the same files for the user inputs and the losses, torch for the gradients
(onnxruntime-training fails to train when trainable parameters are missing, and returns zero gradients when
a frozen one is).
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest

from onnxtrain.checkpoint import load_checkpoint, save_checkpoint
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module
from tests.ortt import PREAMBLE, ensure_ortt, run_script

torch = pytest.importorskip("torch")

from tests.training.torch_mlp import export_mlp  # noqa: E402


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Folders of onnxtrain's artifacts with a partial checkpoint: one lacking trainable parameters, one
    lacking a frozen parameter."""
    root = tmp_path_factory.mktemp("partial")
    _, model, net = export_mlp(root)
    out = {}
    for name, trainable, frozen, keep in (
        ("trainable", ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"], [], {"fc2.weight"}),
        ("frozen", ["fc2.weight", "fc2.bias"], ["fc1.weight", "fc1.bias"], {"fc2.weight", "fc2.bias",
                                                                             "fc1.weight"}),
    ):
        folder = root / name
        folder.mkdir()
        artifacts.generate_artifacts(model, requires_grad=trainable, frozen_params=frozen,
                                     loss=artifacts.LossType.MSELoss, artifact_directory=str(folder))
        full = load_checkpoint(str(folder / "checkpoint"))
        ck = load_checkpoint(str(folder / "checkpoint"))
        ck.trainable = {k: v for k, v in ck.trainable.items() if k in keep}
        ck.frozen = {k: v for k, v in ck.frozen.items() if k in keep}
        save_checkpoint(ck, str(folder / "partial"))
        for f in ("training_model.onnx", "eval_model.onnx"):  # onnxruntime 1.19 reads IR <= 10
            m = onnx.load(str(folder / f))
            m.ir_version = min(m.ir_version, 10)
            onnx.save(m, str(folder / f))
        missing = {**full.trainable, **full.frozen}
        np.savez(str(folder / "missing.npz"), **{k: v for k, v in missing.items() if k not in keep})
        out[name] = str(folder)
    return out, net


def _batch(i: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(i)
    return rng.standard_normal((5, 4)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32)


def _scenario(Module, CheckpointState, folder):
    """Both implementations: the user inputs, two (accumulating) training calls and an eval call."""
    state = CheckpointState.load_checkpoint(folder + "/partial")
    m = Module(folder + "/training_model.onnx", state, folder + "/eval_model.onnx")
    missing = np.load(folder + "/missing.npz")
    out = {"inputs": m.input_names()}
    extra = [missing[n] for n in m.input_names()[2:]]
    try:
        out["losses"] = [float(m(*_batch(0), *extra)), float(m(*_batch(1), *extra))]
        out["grads"] = {n: p.grad.tolist() for n, p in state.parameters if p.grad is not None}
    except RuntimeError as e:  # onnxruntime-training when trainable parameters are missing
        out["train_error"] = str(e)
    m.eval()
    out["eval_inputs"] = m.input_names()
    out["eval"] = float(m(*_batch(2), *[missing[n] for n in m.input_names()[2:]]))
    return out


_ORT_SCRIPT = PREAMBLE + r"""
import numpy as np
from onnxruntime.training.api import CheckpointState, Module
folders, helper = json.loads(sys.argv[1])
sys.path.insert(0, helper)
import scenario
print(json.dumps({k: scenario._scenario(Module, CheckpointState, f) for k, f in folders.items()}))
"""


@pytest.fixture(scope="module")
def ort_reference(cases, tmp_path_factory):
    folders, _ = cases
    python = ensure_ortt()
    helper = tmp_path_factory.mktemp("helper")
    with open(__file__) as f:
        src = f.read()
    (helper / "scenario.py").write_text("import numpy as np\n" + src[src.index("def _batch"):
                                                                      src.index("_ORT_SCRIPT = ")])
    return run_script(_ORT_SCRIPT, json.dumps([folders, str(helper)]), python=python)


@pytest.mark.parametrize("case", ["trainable", "frozen"])
def test_partial_checkpoint_runs_as_onnxruntime_training(cases, ort_reference, case):
    """The missing parameters are user inputs; losses, eval and the held parameters' gradients match."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = _scenario(Module, CheckpointState, cases[0][case])
    theirs = ort_reference[case]
    assert ours["inputs"] == theirs["inputs"]
    assert ours["eval_inputs"] == theirs["eval_inputs"]
    np.testing.assert_allclose(ours["eval"], theirs["eval"], rtol=1e-6)
    if case == "trainable":
        # onnxruntime-training builds this Module but its training call fails (the gradient buffers of the
        # parameters it lacks are never allocated: "Unexpected input data type. Actual: (((null)))")
        assert "Unexpected input data type" in theirs["train_error"]
        held = ["fc2.weight"]
    else:
        # it trains this one to the same losses, but its gradients come back all zeros (it binds the
        # buffers wrongly when an input is missing): torch is the oracle for them
        np.testing.assert_allclose(ours["losses"], theirs["losses"], rtol=1e-6)
        assert not np.any(theirs["grads"]["fc2.weight"])
        held = ["fc2.weight", "fc2.bias"]
    assert sorted(ours["grads"]) == sorted(held)
    net = cases[1]
    net.zero_grad()
    for i in range(2):
        x, y = _batch(i)
        torch.nn.functional.mse_loss(net(torch.tensor(x)), torch.tensor(y)).backward()
    torch_grads = dict(net.named_parameters())
    for n in held:
        np.testing.assert_allclose(ours["grads"][n], torch_grads[n].grad.numpy(), rtol=1e-5, atol=1e-7,
                                   err_msg=n)
    messages = [str(w.message) for w in caught]
    missing = ["fc1.weight", "fc1.bias", "fc2.bias"] if case == "trainable" else ["fc1.bias"]
    kind = "trains" if case == "trainable" else "reads"
    mine = [w for w in caught if f"{kind} parameter(s) {missing}" in str(w.message)
            and "partial" in str(w.message)]
    assert mine, messages
    assert {w.filename for w in mine} == {__file__}  # the line that built the Module, not onnxtrain's


def test_checkpoint_freezing_what_the_model_trains(tmp_path):
    """A checkpoint whose fc1 is frozen, over a training model generated with fc1 trainable: the Module
    warns, keeps fc1 as it is and trains fc2 exactly as the artifacts generated with fc1 frozen do
    (onnxruntime-training fails at its first training step here; onnxtrain's Module used to fail an internal
    graph check)."""
    from onnxtrain.training.api import Optimizer

    _, model, _ = export_mlp(tmp_path)
    folders = {}
    for name, trainable, frozen in (("sub", ["fc2.weight", "fc2.bias"], ["fc1.weight", "fc1.bias"]),
                                    ("full", ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"], [])):
        folders[name] = tmp_path / name
        folders[name].mkdir()
        artifacts.generate_artifacts(model, requires_grad=trainable, frozen_params=frozen,
                                     loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.SGD,
                                     artifact_directory=str(folders[name]))
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((5, 4)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32))
            for _ in range(3)]
    runs = {}
    for graph in ("sub", "full"):
        state = CheckpointState.load_checkpoint(str(folders["sub"] / "checkpoint"))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            module = Module(str(folders[graph] / "training_model.onnx"), state)
        said = [str(w.message) for w in seen if "holds as frozen" in str(w.message)]
        assert bool(said) == (graph == "full"), said
        opt = Optimizer(str(folders["sub"] / "optimizer_model.onnx"), module)
        opt.set_learning_rate(0.1)
        losses = []
        for i, (x, y) in enumerate(data):
            if i == 1:
                module(x, y)  # an accumulating call too: the frozen one's buffer is fed zeros
            losses.append(float(module(x, y)))
            opt.step()
            module.lazy_reset_grad()
        runs[graph] = losses, {k: np.array(p.data) for k, p in state.parameters}
    np.testing.assert_array_equal(runs["full"][0], runs["sub"][0])
    for k, v in runs["sub"][1].items():
        np.testing.assert_array_equal(runs["full"][1][k], v, err_msg=k)
    w0 = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    np.testing.assert_array_equal(runs["full"][1]["fc1.weight"], w0["fc1.weight"])
