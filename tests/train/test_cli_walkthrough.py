"""Defects a user walkthrough of the command line found: outputs written over inputs, float labels, logits
that are the loss, exit codes of user errors, contradicting mixed-precision keys, warnings printed as raw
Python warnings, and data that does not fit the model found only at the first step."""

from __future__ import annotations

import os
import shutil
import warnings

import numpy as np
import onnx
import pytest

from onnxtrain import zoo
from onnxtrain.cli import main
from onnxtrain.data import load_digits
from onnxtrain.train.config import ConfigError, load_config
from tests.train.conftest import config_path


def _error_line(capsys, argv) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return code, err[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    """A run folder of digits_mlp after 2 steps (a checkpoint and model.onnx)."""
    out = str(tmp_path_factory.mktemp("run") / "run")
    assert main(["train", config_path("digits_mlp"), "-q", "--output-dir", out, "--set",
                 "training.steps=2"]) == 0
    return out


def _bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# ---- 1. an output path that is one of the command's inputs ----------------------------------------

def test_export_refuses_to_write_over_the_checkpoint_it_reads(trained, tmp_path, capsys, monkeypatch):
    ckpt = os.path.join(trained, "checkpoints", "step_00000002.ckpt")
    before = _bytes(ckpt)
    monkeypatch.chdir(trained)
    relative = os.path.join("checkpoints", "..", "checkpoints", "step_00000002.ckpt")
    for checkpoint, target in ((trained, ckpt), (ckpt, relative)):
        code, line = _error_line(capsys, ["export", config_path("digits_mlp"), "--checkpoint", checkpoint,
                                          "-o", target])
        assert code == 2 and f"-o/--output: {target} is the checkpoint" in line, line
    assert _bytes(ckpt) == before


def test_export_refuses_to_write_over_its_config(trained, tmp_path, capsys):
    cfg = tmp_path / "digits_mlp.yaml"
    shutil.copy(config_path("digits_mlp"), cfg)
    link = tmp_path / "link.yaml"
    link.symlink_to(cfg)
    before = cfg.read_bytes()
    for target in (str(cfg), str(link)):
        code, line = _error_line(capsys, ["export", str(cfg), "--checkpoint", trained, "-o", target])
        assert code == 2 and f"-o/--output: {target} is the config file" in line, line
    assert cfg.read_bytes() == before
    assert main(["export", str(cfg), "--checkpoint", trained, "-o", str(tmp_path / "m.onnx")]) == 0


def test_gradient_graph_and_artifacts_refuse_to_write_over_their_model(trained, tmp_path, capsys):
    model = tmp_path / "m.onnx"
    shutil.copy(os.path.join(trained, "model.onnx"), model)
    before = model.read_bytes()
    code, line = _error_line(capsys, ["gradient-graph", str(model), "--loss", "logits", "--all-initializers",
                                      "-o", str(model)])
    assert code == 2 and f"-o/--output: {model} is the model" in line, line
    art = tmp_path / "art"
    art.mkdir()
    inside = art / "training_model.onnx"
    shutil.copy(model, inside)
    code, line = _error_line(capsys, ["artifacts", str(inside), "-o", str(art), "--loss", "CrossEntropyLoss"])
    assert code == 2 and f"{inside} is the model" in line, line
    assert model.read_bytes() == before and inside.read_bytes() == before


# ---- 2. class labels must be integers of the labels input's shape ------------------------------------

@pytest.fixture
def files_config(tmp_path, write_config):
    tr, _ = load_digits()
    np.save(tmp_path / "x.npy", tr.x)

    def make(labels: np.ndarray) -> str:
        np.save(tmp_path / "y.npy", labels)
        return write_config({"model": {"builder": "mlp", "args": {"sizes": [64, 16, 10]}},
                             "data": {"source": "files", "feeds": {"x": "x.npy", "y": "y.npy"}},
                             "training": {"steps": 1}})

    return make, tr.y


def test_fractional_float_labels_are_refused(files_config, tmp_path, capsys):
    make, y = files_config
    cfg = make(y.astype(np.float32) + 0.5)
    code, line = _error_line(capsys, ["train", cfg, "-q", "--output-dir", str(tmp_path / "out")])
    assert code == 2 and f"data.feeds.y: {tmp_path / 'y.npy'}: " in line and "not whole numbers" in line, line
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")


def test_labels_of_the_wrong_shape_are_refused_at_load(files_config, tmp_path, capsys):
    make, y = files_config
    cfg = make(np.stack([y, y], 1).astype(np.float32))
    code, line = _error_line(capsys, ["train", cfg, "-q", "--output-dir", str(tmp_path / "out")])
    assert code == 2 and "data.feeds.y: " in line and "of shape ['N', 2]" in line, line
    assert "model input 'y' takes shape ['N'] (model.labels)" in line, line


def test_whole_number_float_labels_train(files_config, tmp_path, capsys):
    make, y = files_config
    cfg = make(y.astype(np.float32))
    assert main(["train", cfg, "-q", "--output-dir", str(tmp_path / "out")]) == 0


# ---- 3. the logits must not be the loss ------------------------------------------------------------

def test_logits_that_are_the_loss_are_refused(tmp_path, capsys):
    code, line = _error_line(capsys, ["train", config_path("digits_mlp"), "-q", "--output-dir", str(tmp_path),
                                      "--set", "model.logits=loss"])
    assert code == 2 and "model.logits: 'loss' is the loss (model.loss)" in line, line
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_scalar_logits_are_refused(tmp_path, write_config):
    model = zoo.mlp([64, 16, 10])
    g = model.graph
    g.node.append(onnx.helper.make_node("ReduceSum", ["logits"], ["total"], keepdims=0))
    g.output.append(onnx.helper.make_tensor_value_info("total", onnx.TensorProto.FLOAT, None))
    onnx.save(model, str(tmp_path / "m.onnx"))
    from onnxtrain.train.model import build_model

    raw = {"model": {"path": "m.onnx", "logits": "total"}, "training": {"steps": 1}}
    cfg = load_config(write_config(raw))
    with pytest.raises(ConfigError, match=r"^model.logits: 'total' is a scalar"):
        build_model(cfg)


# ---- 4. user errors exit 2 with one line -----------------------------------------------------------

def test_user_errors_exit_2(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ONNXTRAIN_DEBUG", raising=False)
    empty = str(tmp_path / "empty")
    cases = [
        (["train", config_path("digits_mlp"), "-q", "--output-dir", empty, "--resume"],
         f"onnxtrain train: --resume: no checkpoint in {os.path.join(empty, 'checkpoints')}"),
        (["eval", config_path("digits_mlp"), "--checkpoint", str(tmp_path / "nonexist")],
         f"onnxtrain eval: --checkpoint: checkpoint not found: {tmp_path / 'nonexist'}"),
        (["info", str(tmp_path / "nonexist.onnx")],
         f"onnxtrain info: model file not found: {tmp_path / 'nonexist.onnx'}"),
        (["train", config_path("digits_mlp"), "-q", "--output-dir", str(tmp_path / "r"), "--set",
          "training.parameters.recompute_checkpoints=[nope]"], "training.parameters.recompute_checkpoints: "),
        (["train", config_path("digits_mlp"), "-q", "--output-dir", trained, "--resume", "--set",
          "model.args.sizes=[64,32,10]", "--set", "training.steps=2"],
         "onnxtrain train: --resume: the checkpoint "),
    ]
    for argv, want in cases:
        code, line = _error_line(capsys, argv)
        assert code == 2 and want in line, line
        assert "ONNXTRAIN_DEBUG" not in line and "Errno" not in line, line


# ---- 5. the two mixed-precision keys must agree -----------------------------------------------------

@pytest.mark.parametrize("ours,theirs", [("true", "false"), ("false", "true")])
def test_contradicting_mixed_precision_keys_are_refused(ours, theirs):
    sets = [f"training.parameters.use_mixed_precision={ours}", f"training.mixed_precision={theirs}"]
    with pytest.raises(ConfigError) as e:
        load_config(config_path("digits_mlp"), sets)
    msg = str(e.value)
    assert msg.startswith(f"training.parameters.use_mixed_precision: {ours} contradicts "
                          f"training.mixed_precision: {theirs}"), msg


@pytest.mark.parametrize("value", [True, False])
def test_agreeing_mixed_precision_keys_are_fine(value):
    v = str(value).lower()
    cfg = load_config(config_path("digits_mlp"), [f"training.parameters.use_mixed_precision={v}",
                                                  f"training.mixed_precision={v}"])
    assert cfg.training.mixed_precision is value and "use_mixed_precision" not in cfg.training.parameters
    assert load_config(config_path("digits_mlp")).training.mixed_precision is False


# ---- 6. warnings in the onnxtrain: warning: form ----------------------------------------------------

def test_every_subcommand_prints_warnings_as_one_onnxtrain_line(trained, tmp_path, capsys, monkeypatch):
    import onnxtrain.cli as cli

    def warns(a):
        warnings.warn("first line\n  and its second", UserWarning, stacklevel=1)
        return 0

    monkeypatch.setattr(cli, "_info", warns)
    assert main(["info", "whatever.onnx"]) == 0
    err = capsys.readouterr().err
    assert err == "onnxtrain: warning: first line and its second\n", err
    assert main(["artifacts", os.path.join(trained, "model.onnx"), "-o", str(tmp_path / "art"), "--loss",
                 "CrossEntropyLoss", "--frozen", "nope", "--recompute", "gelu"]) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all(s.startswith("onnxtrain: warning: ") for s in lines), lines
    assert "'nope'" in lines[0] and "nothing in this model is recomputed" in lines[1], lines


# ---- 7. data that does not fit the model is refused at load, naming the keys -------------------------

@pytest.mark.parametrize("config,settings,words", [
    ("digits_mlp", ["model.args.sizes=[32,10]"],
     ["data 'digits' (data.images: false)", "['N', 64]", "['N', 32] (model.args.sizes[0] = 32)"]),
    ("tiny_transformer", ["data.vocab=20"],
     ["data 'sequence' (data.vocab: 20)", "values up to 19", "10 rows (model.args.vocab = 10)"]),
    ("tiny_transformer", ["data.length=16"],
     ["data 'sequence' (data.length: 16)", "['N', 16]", "['N', 8] (model.args.length = 8)"]),
    ("digits_mlp", ["model.labels=x"], ["model.labels: 'x' is not the input the loss 'loss' reads", "'y'"]),
    ("digits_cnn", ["data.images=false"],
     ["data 'digits' (data.images: false)", "['N', 64]", "['N', 1, 8, 8] (model.args.image = [1, 8, 8])"]),
])
def test_data_that_does_not_fit_the_model(config, settings, words, tmp_path, capsys):
    argv = ["train", config_path(config), "-q", "--output-dir", str(tmp_path)]
    for s in settings:
        argv += ["--set", s]
    code, line = _error_line(capsys, argv)
    assert code == 2 and all(w in line for w in words), line
    assert "ONNXTRAIN_DEBUG" not in line
    assert not os.path.exists(tmp_path / "metrics.jsonl")
