"""Command-line edges: ``~`` in output.dir, a checkpoints folder given to --checkpoint, data arrays that are
not numbers, a config that is not UTF-8 text or is a folder, MSE labels of the wrong shape, resuming past the
config's length, and a run's own saved config.yaml."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest

from onnxtrain import zoo
from onnxtrain.cli import main
from tests.train.conftest import config_path

SHORT = ["--set", "training.steps=2", "--set", "training.eval_every=1000", "-q"]


def _err(capsys) -> str:
    return capsys.readouterr().err.strip()


def test_tilde_in_output_dir_is_the_home_folder(tmp_path, monkeypatch, capsys):
    """A folder literally named ``~`` was made in the working folder."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert main(["train", config_path("digits_mlp"), *SHORT, "--set", "output.dir=~/run"]) == 0
    assert os.path.isfile(tmp_path / "home" / "run" / "metrics.jsonl")
    assert not os.path.exists(tmp_path / "~")


def test_checkpoint_argument_may_be_the_checkpoints_folder(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(["train", config_path("digits_mlp"), *SHORT, "--output-dir", out]) == 0
    capsys.readouterr()
    assert main(["eval", config_path("digits_mlp"), "--checkpoint", out, "--json"]) == 0
    whole = capsys.readouterr().out
    assert main(["eval", config_path("digits_mlp"), "--checkpoint", os.path.join(out, "checkpoints"),
                 "--json"]) == 0
    assert capsys.readouterr().out == whole
    empty = tmp_path / "other" / "checkpoints"
    empty.mkdir(parents=True)
    assert main(["eval", config_path("digits_mlp"), "--checkpoint", str(empty)]) != 0
    assert f"no checkpoint in {empty} (give a run folder, its checkpoints folder" in _err(capsys)


def _files_argv(tmp_path, x: np.ndarray, y: np.ndarray) -> list[str]:
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    data = (f"data={{source: files, feeds: {{x: {tmp_path / 'x.npy'}, y: {tmp_path / 'y.npy'}}}, "
            "eval_fraction: 0.25}")
    return ["train", config_path("digits_mlp"), *SHORT, "--output-dir", str(tmp_path / "r"), "--set", data]


def test_arrays_that_are_not_numbers_are_refused_by_key(tmp_path, capsys):
    """Strings failed in numpy's cast without naming the key; dates and complex numbers trained on garbage."""
    y = np.arange(40) % 10
    for bad in (np.full((40, 64), "a"), np.zeros((40, 64), "datetime64[s]"), np.ones((40, 64), np.complex64)):
        assert main(_files_argv(tmp_path, bad, y)) == 2
        err = _err(capsys)
        assert "data.feeds.x" in err and "takes float32 numbers, got" in err and str(bad.dtype) in err, err
    spelled = np.random.default_rng(0).random((80, 64)).astype(str)  # numbers as text: read as numbers
    labels = (np.arange(80) % 10).astype(float).astype(str)  # "3.0": whole numbers for the int64 labels
    assert main(_files_argv(tmp_path, spelled, labels)) == 0, _err(capsys)


def test_mse_labels_take_the_logits_shape(tmp_path, capsys):
    """model.add_loss: mse with [N] labels against [N, 3] logits failed in the Sub node's broadcast."""
    path = str(tmp_path / "m.onnx")
    onnx.save(zoo.mlp([64, 3], loss=False), path)
    argv = _files_argv(tmp_path, np.zeros((40, 64), np.float32), np.zeros(40, np.float32))
    argv += ["--set", f"model={{path: {path}, logits: logits, add_loss: mse}}"]
    assert main(argv) == 2
    err = _err(capsys)
    assert "data.feeds.y" in err and "of shape ['N']" in err and "takes shape ['N', 3]" in err, err
    argv = _files_argv(tmp_path, np.zeros((80, 64), np.float32), np.zeros((80, 3), np.float32))
    argv += ["--set", f"model={{path: {path}, logits: logits, add_loss: mse}}"]
    assert main(argv) == 0, _err(capsys)


def test_config_that_is_not_text_or_is_a_folder(tmp_path, capsys):
    bad = tmp_path / "bin.yaml"
    bad.write_bytes(b"\xff\xfe bad")
    assert main(["train", str(bad)]) == 2
    assert f"{bad}: not a UTF-8 text file" in _err(capsys)
    assert main(["train", str(tmp_path)]) == 2
    assert f"{tmp_path} is a folder; give the config's .yaml file" in _err(capsys)


def test_resume_past_the_configs_length_says_so(tmp_path, capsys):
    out = str(tmp_path / "run")
    argv = ["train", config_path("digits_mlp"), "-q", "--output-dir", out, "--set",
            "training.eval_every=1000"]
    assert main([*argv, "--set", "training.steps=4"]) == 0
    capsys.readouterr()
    assert main([*argv, "--set", "training.steps=2", "--resume"]) == 0
    assert "the checkpoint is at step 4, past the 2 steps this config trains" in _err(capsys)


def test_a_runs_saved_config_keeps_the_runs_name(tmp_path, capsys):
    """Training from runs/<name>/config.yaml named the run "config" (progress bar, plot, summary)."""
    from onnxtrain.train.config import load_config

    out = tmp_path / "digits_run"
    assert main(["train", config_path("digits_mlp"), *SHORT, "--output-dir", str(out)]) == 0
    assert load_config(str(out / "config.yaml")).name == "digits_run"
    other = tmp_path / "config.yaml"
    other.write_text((out / "config.yaml").read_text())
    assert load_config(str(other)).name == "config"  # not a run's folder: the file's name


def test_text_is_not_read_as_truth_values(tmp_path, capsys):
    """"False" as text for a bool input was read as True (any non-empty string is): refused by key."""
    from onnx import TensorProto, helper

    model = zoo.mlp([64, 10])
    g = model.graph
    x = next(i for i, n in enumerate(g.node) if "x" in n.input)
    g.node[x].input[list(g.node[x].input).index("x")] = "xk"
    g.node.insert(0, helper.make_node("Cast", ["keep"], ["kf"], to=TensorProto.FLOAT))
    g.node.insert(1, helper.make_node("Mul", ["x", "kf"], ["xk"]))
    g.input.append(helper.make_tensor_value_info("keep", TensorProto.BOOL, ["N", 64]))
    path = str(tmp_path / "m.onnx")
    onnx.save(model, path)
    np.save(tmp_path / "keep.npy", np.full((80, 64), "False"))
    argv = _files_argv(tmp_path, np.zeros((80, 64), np.float32), np.arange(80) % 10)
    data = (f"data={{source: files, feeds: {{x: {tmp_path / 'x.npy'}, y: {tmp_path / 'y.npy'}, "
            f"keep: {tmp_path / 'keep.npy'}}}, eval_fraction: 0.25}}")
    argv = [*argv[:-1], data, "--set", f"model={{path: {path}}}"]
    assert main(argv) == 2
    err = _err(capsys)
    assert "data.feeds.keep" in err and "takes bool numbers, got <U5 values" in err, err


def test_integer_inputs_take_numbers_that_fit(tmp_path, capsys):
    """Labels of 300 for int64 are fine, but token ids of 300 for a uint8 input wrapped to 44, and text was
    read through float64 (9007199254740993 became ...992): now exact, and out of range refused by key."""
    from onnxtrain.train.session import _text_numbers

    for text, dt, want in (("9007199254740993", np.int64, 9007199254740993),
                           ("9007199254740993.0", np.int64, 9007199254740993),
                           ("18446744073709551615", np.uint64, 18446744073709551615)):
        got = _text_numbers(np.array([text]), np.dtype(dt))
        assert got.dtype.kind in "iu" and int(got[0]) == want, (text, got)
    argv = _files_argv(tmp_path, np.zeros((80, 64), np.float32), np.full(80, "300"))
    assert main(argv) == 2
    err = _err(capsys)
    assert "class label 300" in err, err  # int64 labels: in range, then the class check
    argv = _files_argv(tmp_path, np.zeros((80, 64), np.float32), np.full(80, "1e30"))
    assert main(argv) == 2
    err = _err(capsys)
    assert "data.feeds.y" in err and "takes int64 numbers" in err and "holds 1e+30" in err, err


def test_the_summary_names_files_inside_the_output_folder(tmp_path, monkeypatch, capsys):
    """`outputs in DIR: ...` listed metrics.jsonl by name but the checkpoint and model with DIR in front
    again (a relative DIR read as DIR/DIR/checkpoints/...); every name is now relative to DIR."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", config_path("digits_mlp"), *SHORT, "--output-dir", "run"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("outputs in "))
    folder, names = line[len("outputs in "):].split(": ", 1)
    assert folder == "run"
    names = names.split(", ")
    assert {"metrics.jsonl", "config.yaml", "model.onnx", "checkpoints/step_00000002.ckpt"} <= set(names)
    for name in names:
        assert os.path.isfile(os.path.join(folder, name)), (name, line)


def test_a_run_folder_or_a_model_given_as_the_config_says_what_to_give(tmp_path, capsys):
    """The run folder, or the checkpoint or model given where the YAML config goes (eval's arguments in the
    other order): the error said only 'a folder' or 'not a UTF-8 text file'."""
    out = tmp_path / "run"
    assert main(["train", config_path("digits_mlp"), *SHORT, "--output-dir", str(out)]) == 0
    capsys.readouterr()
    assert main(["eval", str(out), "--checkpoint", str(out)]) == 2
    assert f"its own config is {out / 'config.yaml'}" in _err(capsys)
    assert main(["eval", str(out / "config.yaml"), "--checkpoint", str(out)]) == 0
    capsys.readouterr()
    ckpt = out / "checkpoints" / "step_00000002.ckpt"
    for wrong in (ckpt, out / "model.onnx"):
        assert main(["eval", str(wrong), "--checkpoint", str(out)]) == 2
        err = _err(capsys)
        assert f"{wrong}: not a UTF-8 text file" in err and "the YAML config" in err, err


def test_the_summary_of_a_one_step_run_says_step(tmp_path, capsys):
    argv = ["train", config_path("digits_mlp"), "-q", "--output-dir", str(tmp_path / "run"),
            "--set", "training.steps=1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "trained digits_mlp for 1 step: eval_loss " in out, out


def test_train_help_names_every_file_a_run_writes(tmp_path, capsys):
    """train --help listed the run's files without config.yaml, which every run writes."""
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert main(["train", config_path("digits_mlp"), *SHORT, "--output-dir", str(tmp_path / "run")]) == 0
    written = sorted(os.listdir(tmp_path / "run"))
    assert written == ["checkpoints", "config.yaml", "metrics.jsonl", "metrics.png", "model.onnx"]
    for name in written:
        assert name in text, name


def _help(*command: str, capsys) -> str:
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_eval_and_export_help_say_what_the_readme_says(tmp_path, capsys):
    """eval/export --help said --checkpoint takes "a checkpoint file, or a run folder" (the README and the
    code: its checkpoints folder too, and a damaged latest is passed over), and their --set example was
    training.epochs, which neither reads. Each form the help names now scores the same checkpoint."""
    out = tmp_path / "run"
    assert main(["train", config_path("digits_mlp"), *SHORT, "--output-dir", str(out)]) == 0
    (ckpt,) = [f for f in os.listdir(out / "checkpoints") if f.endswith(".ckpt")]
    for command in ("eval", "export"):
        text = _help(command, capsys=capsys)
        assert "run folder, its checkpoints folder or a .ckpt file" in text, text
        assert "training.epochs" not in text and "damaged" in text, text
    scores = []
    for form in (out, out / "checkpoints", out / "checkpoints" / ckpt):
        assert main(["eval", config_path("digits_mlp"), "--checkpoint", str(form), "--json"]) == 0
        scores.append(json.loads(capsys.readouterr().out))
    assert scores[0] == scores[1] == scores[2]


def test_train_help_says_what_the_readme_says(tmp_path, capsys):
    """train --help left out the exit codes of a bad config (2) and of a failure or divergence (1), that
    --overwrite deletes the old metrics.png and model.onnx too, and that --resume warns about changed keys."""
    text = _help("train", capsys=capsys)
    for words in ("2 a bad config", "1 a failure while running", "not finite", "metrics.png and model.onnx",
                  "warned about"):
        assert words in text, (words, text)
    assert main(["train", config_path("digits_mlp"), "--set", "training.batchsize=8"]) == 2
