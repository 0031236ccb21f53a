"""generate_artifacts / ``onnxtrain artifacts``: the base model's description carried into the artifacts (as
onnxruntime-training 1.19.2 carries it), ``--loss-input-names`` (CLI and Python write the same files, which
train as onnxruntime-training's own artifacts train), and a recompute option that finds nothing warns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxtrain.cli import main
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module, Optimizer
from onnxtrain.zoo import mlp
from tests.ortt import PREAMBLE, run_script

DESCRIBED = ("doc_string", "model_version", "producer_name", "producer_version", "domain")


def _described_mlp() -> onnx.ModelProto:
    """zoo.mlp 8-16-4 with a doc string, version, producer, domain, graph doc and metadata_props."""
    m = mlp([8, 16, 4], loss=False)
    m.ir_version = 8
    m.doc_string, m.model_version, m.domain = "an mlp for the tests", 42, "org.example"
    m.producer_name, m.producer_version = "my-exporter", "9.9"
    m.graph.doc_string = "graph doc"
    helper.set_model_props(m, {"author": "me", "license": "MIT"})
    return m


def _description(m: onnx.ModelProto) -> dict:
    return {**{f: getattr(m, f) for f in DESCRIBED}, "graph": [m.graph.name, m.graph.doc_string],
            "metadata_props": [[p.key, p.value] for p in m.metadata_props]}


_ORT_DESCRIBE = PREAMBLE + r"""
from onnxruntime.training import artifacts
base, folder = sys.argv[1:3]
artifacts.generate_artifacts(onnx.load(base), requires_grad=["fc0.weight", "fc1.weight"],
                             frozen_params=["fc0.bias"], loss=artifacts.LossType.MSELoss,
                             optimizer=artifacts.OptimType.AdamW, artifact_directory=folder)
out = {}
for name in ("training_model.onnx", "eval_model.onnx"):
    m = onnx.load(folder + "/" + name)
    out[name] = {**{f: getattr(m, f) for f in ("doc_string", "model_version", "producer_name",
                                               "producer_version", "domain")},
                 "graph": [m.graph.name, m.graph.doc_string],
                 "metadata_props": [[p.key, p.value] for p in m.metadata_props]}
print(json.dumps(out))
"""


def test_model_description_carried_as_onnxruntime_training_does(tmp_path):
    """The training and eval models keep the base model's doc_string, model_version, producer name and
    version, domain, graph name and doc_string and metadata_props, exactly as onnxruntime-training 1.19.2's
    generator writes them; onnxtrain's own metadata keys (mixed precision, recompute) follow the base's."""
    base = _described_mlp()
    path = tmp_path / "base.onnx"
    onnx.save(base, str(path))
    ort_dir = tmp_path / "ort"
    ort_dir.mkdir()
    theirs = run_script(_ORT_DESCRIBE, str(path), str(ort_dir))
    ours_dir = tmp_path / "ours"
    ours_dir.mkdir()
    artifacts.generate_artifacts(base, requires_grad=["fc0.weight", "fc1.weight"], frozen_params=["fc0.bias"],
                                 loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=ours_dir)
    for name in ("training_model.onnx", "eval_model.onnx"):
        mine = _description(onnx.load(str(ours_dir / name)))
        # (the training model also lists the dims its gradient takes for one size, after the base's keys:
        # the MSE's target shares the output's 'N', which the Module checks the feeds of)
        own = [kv for kv in mine["metadata_props"] if kv[0].startswith("onnxtrain.")]
        assert own == ([["onnxtrain.same_size_dims", '{"N": [["target", 0], ["x", 0]]}']]
                       if name == "training_model.onnx" else [])
        assert mine["metadata_props"][-len(own) or len(mine["metadata_props"]):] == own
        mine["metadata_props"] = [kv for kv in mine["metadata_props"] if kv not in own]
        assert mine == theirs[name], name
        assert mine["producer_name"] == "my-exporter" and mine["metadata_props"][0] == ["author", "me"]
    # with the transforms: the base's keys first, then onnxtrain's
    mp_dir = tmp_path / "mp"
    mp_dir.mkdir()
    artifacts.generate_artifacts(base, requires_grad=["fc0.weight", "fc1.weight"],
                                 loss=artifacts.LossType.MSELoss, artifact_directory=mp_dir,
                                 mixed_precision="float16", recompute={"checkpoints": []})
    training = onnx.load(str(mp_dir / "training_model.onnx"))
    keys = [p.key for p in training.metadata_props]
    assert keys[:2] == ["author", "license"]
    assert {"onnxtrain.loss_scaling", "onnxtrain.recompute"} <= set(keys[2:])
    assert _description(training)["graph"] == ["mlp", "graph doc"]
    onnx.checker.check_model(training, full_check=True)
    # a base that carries an earlier generation's onnxtrain keys (as a model exported from float16
    # artifacts may): they are not carried, so the new float32 artifacts train without a loss scale
    stale = _described_mlp()
    helper.set_model_props(stale, {"author": "me", "license": "MIT",
                                   "onnxtrain.loss_scaling": next(p.value for p in training.metadata_props
                                                                  if p.key == "onnxtrain.loss_scaling")})
    again = tmp_path / "again"
    again.mkdir()
    artifacts.generate_artifacts(stale, requires_grad=["fc0.weight"], loss=artifacts.LossType.MSELoss,
                                 artifact_directory=again)
    for name in ("training_model.onnx", "eval_model.onnx"):
        keys = [p.key for p in onnx.load(str(again / name)).metadata_props]
        assert keys == ["author", "license"] + (["onnxtrain.same_size_dims"] if name == "training_model.onnx"
                                                else []), (name, keys)
    state = CheckpointState.load_checkpoint(str(again / "checkpoint"))
    module = Module(str(again / "training_model.onnx"), state)
    assert module.input_names() == ["x", "target"]
    loss = module(np.ones((2, 8), np.float32), np.zeros((2, 4), np.float32))
    assert np.isfinite(np.asarray(loss)).all()


# ---- --loss-input-names ------------------------------------------------------------------------------------

def _two_output_mlp(path) -> list[str]:
    """zoo.mlp 8-16-4 whose outputs are (probs, logits): the loss must read the second. Returns the trained
    initializers."""
    m = mlp([8, 16, 4], loss=False)
    m.ir_version = 8
    m.graph.node.append(helper.make_node("Softmax", ["logits"], ["probs"], axis=1))
    logits = m.graph.output.pop()
    m.graph.output.append(helper.make_tensor_value_info("probs", onnx.TensorProto.FLOAT, ["N", 4]))
    m.graph.output.append(logits)
    onnx.checker.check_model(m, full_check=True)
    onnx.save(m, str(path))
    return [t.name for t in m.graph.initializer]


STEPS, LR = 6, 0.01

_ORT_TRAIN = PREAMBLE + r"""
import numpy as np
from onnxruntime.training import artifacts
base, folder, data, steps, lr = sys.argv[1:6]
artifacts.generate_artifacts(onnx.load(base), requires_grad=json.loads(sys.argv[6]),
                             loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                             artifact_directory=folder, loss_input_names=["logits"])
state, m, o = open_artifacts(folder, float(lr))
batches = np.load(data)
losses = []
for i in range(int(steps)):
    losses.append(float(m(batches[f"x{i}"], batches[f"y{i}"]))); o.step(); m.lazy_reset_grad()
params = {k: np.asarray(p.data).ravel().tolist() for k, p in state.parameters}
print(json.dumps({"losses": losses, "params": params}))
"""


def _batch(i: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(300 + i)
    return rng.standard_normal((5, 8)).astype(np.float32), rng.integers(0, 4, 5).astype(np.int64)


def test_loss_input_names_option(tmp_path, capsys):
    """``--loss-input-names logits`` on a model whose outputs are (probs, logits): the CLI writes the files
    generate_artifacts(..., loss_input_names=["logits"]) writes, byte for byte, and they train to the losses
    and weights onnxruntime-training 1.19.2 reaches with its own artifacts of the same call."""
    model = tmp_path / "two.onnx"
    params = _two_output_mlp(model)
    cli_dir, py_dir, ort_dir = tmp_path / "cli", tmp_path / "py", tmp_path / "ort"
    assert main(["artifacts", str(model), "-o", str(cli_dir), "--loss", "CrossEntropyLoss",
                 "--loss-input-names", "logits", "--optimizer", "AdamW"]) == 0
    py_dir.mkdir()
    artifacts.generate_artifacts(onnx.load(str(model)), requires_grad=params,
                                 loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=py_dir,
                                 loss_input_names=["logits"])
    names = sorted(os.listdir(py_dir))
    assert sorted(os.listdir(cli_dir)) == names
    for n in names:
        assert (cli_dir / n).read_bytes() == (py_dir / n).read_bytes(), n
    training = onnx.load(str(cli_dir / "training_model.onnx"))
    assert "probs" not in {o.name for o in training.graph.output}

    data = tmp_path / "batches.npz"
    np.savez(data, **{f"{k}{i}": v for i in range(STEPS) for k, v in zip("xy", _batch(i))})
    ort_dir.mkdir()
    theirs = run_script(_ORT_TRAIN, str(model), str(ort_dir), str(data), str(STEPS), str(LR),
                        json.dumps(params))
    state = CheckpointState.load_checkpoint(str(cli_dir / "checkpoint"))
    module = Module(str(cli_dir / "training_model.onnx"), state)
    opt = Optimizer(str(cli_dir / "optimizer_model.onnx"), module)
    opt.set_learning_rate(LR)
    losses = []
    for i in range(STEPS):
        losses.append(float(np.asarray(module(*_batch(i)))))
        opt.step()
        module.lazy_reset_grad()
    np.testing.assert_allclose(losses, theirs["losses"], rtol=1e-5, atol=1e-6)
    for k, p in state.parameters:
        np.testing.assert_allclose(np.asarray(p.data).ravel(), theirs["params"][k], rtol=1e-4, atol=1e-6)

    # errors name the bad values (exit code 2, nothing written)
    capsys.readouterr()
    bad = str(tmp_path / "bad")
    assert main(["artifacts", str(model), "-o", bad, "--loss", "CrossEntropyLoss",
                 "--loss-input-names", "logits,nope,nada"]) == 2
    err = capsys.readouterr().err
    assert "--loss-input-names: 'nope', 'nada' are not values of" in err and "probs, logits" in err
    assert main(["artifacts", str(model), "-o", bad, "--loss", "CrossEntropyLoss"]) == 2
    assert "say which with --loss-input-names" in capsys.readouterr().err
    assert main(["artifacts", str(model), "-o", bad, "--loss-output", "logits",
                 "--loss-input-names", "logits"]) == 2
    assert "--loss-output and --loss-input-names exclude each other" in capsys.readouterr().err
    assert not os.path.exists(bad)
    r = subprocess.run([sys.executable, "-m", "onnxtrain", "artifacts", "--help"], capture_output=True,
                       text=True, timeout=120)
    assert "--loss-input-names" in r.stdout


def test_empty_loss_input_names_means_every_output(tmp_path):
    """loss_input_names=[] passes every model output to the loss, as None does (onnxruntime-training tests
    the list's truth)."""
    model = mlp([8, 16, 4], loss=False)
    for name, value in (("none", None), ("empty", [])):
        (tmp_path / name).mkdir()
        artifacts.generate_artifacts(model, requires_grad=["fc0.weight"], loss=artifacts.LossType.MSELoss,
                                     artifact_directory=tmp_path / name, loss_input_names=value)
    for n in os.listdir(tmp_path / "none"):
        assert (tmp_path / "none" / n).read_bytes() == (tmp_path / "empty" / n).read_bytes()


# ---- recompute that finds nothing --------------------------------------------------------------------------

NOTHING = "nothing in this model is recomputed"


@pytest.mark.parametrize("options", [{"gelu": True}, {"attn_dropout": True}, {"transformer_layer": True}])
def test_recompute_that_finds_nothing_warns_once(tmp_path, options):
    """An MLP has no GELU, attention dropout or transformer layer: one warning says that nothing is
    recomputed (with the pass's own reason, when it gives one), and the training model is the plain one."""
    model = mlp([8, 16, 4], loss=False)
    for name, rc in (("plain", None), ("rc", options)):
        (tmp_path / name).mkdir()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            artifacts.generate_artifacts(model, requires_grad=["fc0.weight"], loss=artifacts.LossType.MSELoss,
                                         artifact_directory=tmp_path / name, recompute=rc)
        said = [str(w.message) for w in caught]
        if rc is None:
            assert not any(NOTHING in s for s in said)
        else:
            assert len(said) == 1 and NOTHING in said[0] and str(options) in said[0], said
    plain = onnx.load(str(tmp_path / "plain" / "training_model.onnx"))
    rc_model = onnx.load(str(tmp_path / "rc" / "training_model.onnx"))
    assert rc_model.graph == plain.graph


def test_recompute_warning_only_when_nothing_is_recomputed(tmp_path):
    """``onnxtrain artifacts --recompute gelu`` on an MLP warns on stderr (exit 0); checkpoints=[] (every
    activation recomputed) does not warn."""
    path = tmp_path / "m.onnx"
    onnx.save(mlp([8, 16, 4], loss=False), str(path))
    r = subprocess.run([sys.executable, "-m", "onnxtrain", "artifacts", str(path), "-o", str(tmp_path / "a"),
                        "--loss", "CrossEntropyLoss", "--recompute", "gelu"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert NOTHING in r.stderr and "gelu" in r.stderr
    (tmp_path / "b").mkdir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        artifacts.generate_artifacts(onnx.load(str(path)), requires_grad=["fc0.weight", "fc1.weight"],
                                     loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path / "b",
                                     recompute={"checkpoints": []})
    assert not any(NOTHING in str(w.message) for w in caught)
    trained = onnx.load(str(tmp_path / "b" / "training_model.onnx"))
    assert any(o.endswith("_recompute") for n in trained.graph.node for o in n.output)
