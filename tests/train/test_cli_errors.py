"""Command-line failures: one line on stderr (the traceback only with ONNXTRAIN_DEBUG=1), exit code 2 for a
bad command line or config, 1 for a failure while running; and the wording of a few messages."""

from __future__ import annotations

import json
import os
import re
import typing

import numpy as np
import onnx
import pytest
import yaml

from onnxtrain import zoo
from onnxtrain.cli import main
from onnxtrain.engine.plan import EngineError
from onnxtrain.train.config import ConfigError, ModelConfig, coerce, load_config
from tests.train.conftest import config_path


def _error_line(capsys, argv) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return code, err[0]


@pytest.fixture
def mlp_with_loss(tmp_path) -> str:
    path = str(tmp_path / "mlp.onnx")
    onnx.save(zoo.mlp([4, 3, 2]), path)
    return path


def test_labels_beyond_the_classes_are_refused_at_load(tmp_path, capsys, monkeypatch):
    """Three classes for ten digit labels: refused before training, naming the loss and the class count
    (the loss node failed at the first step before)."""
    monkeypatch.delenv("ONNXTRAIN_DEBUG", raising=False)
    argv = ["train", config_path("digits_mlp"), "-q", "--output-dir", str(tmp_path), "--set",
            "model.args.sizes=[64,10,3]", "--set", "training.steps=2"]
    code, line = _error_line(capsys, argv)
    assert code == 2
    assert re.search(r"class label \d+, but the loss 'loss' scores 3 classes", line), line
    assert "[0, 3)" in line
    np.save(tmp_path / "x.npy", np.zeros((40, 64), np.float32))
    np.save(tmp_path / "y.npy", np.r_[np.arange(10), -np.ones(30, np.int64)])
    argv = ["train", config_path("digits_mlp"), "-q", "--output-dir", str(tmp_path / "f"), "--set",
            f"data={{source: files, feeds: {{x: {tmp_path / 'x.npy'}, y: {tmp_path / 'y.npy'}}}, "
            "eval_fraction: 0.25}", "--set", "training.steps=2"]
    code, line = _error_line(capsys, argv)
    assert code == 2 and "data.feeds.y" in line and "class label -1" in line, line


def test_engine_error_from_a_config_mistake_is_one_line(tmp_path, capsys, monkeypatch):
    """A model whose weight does not fit the data's features (its input's sizes symbolic, so no check
    before the run sees it): the MatMul fails; the message names the node."""
    from onnx import helper

    model = zoo.mlp([63, 10])
    x = next(v for v in model.graph.input if v.name == "x")
    x.CopyFrom(helper.make_tensor_value_info("x", x.type.tensor_type.elem_type, ["N", "F"]))
    path = str(tmp_path / "m.onnx")
    onnx.save(model, path)
    monkeypatch.delenv("ONNXTRAIN_DEBUG", raising=False)
    argv = ["train", config_path("digits_mlp"), "-q", "--output-dir", str(tmp_path / "r"), "--set",
            f"model={{path: {path}}}", "--set", "training.steps=2"]
    code, line = _error_line(capsys, argv)
    assert code == 1
    assert re.search(r"node '[^']+' \((MatMul|Gemm)\) failed", line) and "ONNXTRAIN_DEBUG=1" in line, line
    monkeypatch.setenv("ONNXTRAIN_DEBUG", "1")
    with pytest.raises(EngineError):
        main([*argv, "--overwrite"])


def test_info_on_a_file_that_is_not_onnx(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ONNXTRAIN_DEBUG", raising=False)
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model\xff\xff")
    code, line = _error_line(capsys, ["info", str(bad)])
    assert code == 1 and f"{bad} is not an ONNX model" in line, line
    code, line = _error_line(capsys, ["info", os.devnull])  # a device: read, not "not found" as before
    assert code == 1 and f"{os.devnull} is not an ONNX model (no graph" in line, line


def test_info_reads_a_model_from_a_pipe(tmp_path, capsys, mlp_with_loss):
    """`onnxtrain info <(cat m.onnx)`: the shell passes a pipe's path, which was "not found" before."""
    import threading

    fifo = str(tmp_path / "pipe")
    os.mkfifo(fifo)

    def feed() -> None:
        with open(mlp_with_loss, "rb") as src, open(fifo, "wb") as dst:
            dst.write(src.read())

    writer = threading.Thread(target=feed, daemon=True)  # (blocks in open() if the pipe is never read)
    writer.start()
    try:
        assert main(["info", fifo]) == 0
    finally:
        writer.join(timeout=30)
    assert "loss" in capsys.readouterr().out


def test_gradient_graph_wrt_errors(mlp_with_loss, tmp_path, capsys):
    out = str(tmp_path / "g.onnx")
    code, line = _error_line(capsys, ["gradient-graph", mlp_with_loss, "--loss", "loss", "--wrt", "nope",
                                      "-o", out])
    assert code == 2
    # what one can differentiate with respect to, not the graph outputs
    assert "--wrt: 'nope' is not a value of" in line and "fc0.weight" in line and "x" in line, line
    assert "graph outputs" not in line and "'logits'" not in line
    with pytest.raises(SystemExit) as e:  # neither --wrt nor --all-initializers: argparse's usage error
        main(["gradient-graph", mlp_with_loss, "--loss", "loss", "-o", out])
    assert e.value.code == 2
    assert "--wrt" in capsys.readouterr().err
    assert main(["gradient-graph", mlp_with_loss, "--loss", "loss", "--wrt", "fc0.weight", "-o", out]) == 0
    assert os.path.isfile(out)


def test_artifacts_unknown_recompute_choice_exits_2(mlp_with_loss, tmp_path, capsys):
    code, line = _error_line(capsys, ["artifacts", mlp_with_loss, "-o", str(tmp_path / "art"), "--recompute",
                                      "gelu,bogus"])
    assert code == 2 and "--recompute: unknown choice(s) bogus; choose among" in line, line


def test_list_type_wording():
    with pytest.raises(ConfigError) as e:
        coerce("x", list[int], "model.args.sizes")
    assert str(e.value) == "model.args.sizes: expected a list of ints, got 'x'"
    with pytest.raises(ConfigError) as e:
        coerce(3, list[float], "optimizer.betas")
    assert str(e.value) == "optimizer.betas: expected a list of numbers, got 3"


def test_builder_lists_name_every_builder(write_config):
    from onnxtrain.train.config import BUILDERS

    literal = typing.get_args(typing.get_type_hints(ModelConfig)["builder"])[0]
    assert typing.get_args(literal) == BUILDERS
    assert all(callable(getattr(zoo, b)) for b in BUILDERS)
    with pytest.raises(ConfigError) as e:
        load_config(write_config({"model": {}, "training": {"epochs": 1}}))
    assert f"builder ({', '.join(BUILDERS)})" in str(e.value)
    with open(config_path("digits_mlp"), encoding="utf-8") as f:
        comment = next(line for line in f if re.match(r"\s*builder:", line))
    assert all(b in comment for b in BUILDERS), comment


@pytest.mark.parametrize("where", ["file", "under_file", "empty"])
def test_output_folder_that_cannot_be_made(where, tmp_path, capsys, monkeypatch):
    """A file in the way, or an empty --output-dir: exit 2 before anything is built, naming the folder."""
    monkeypatch.delenv("ONNXTRAIN_DEBUG", raising=False)
    afile = tmp_path / "afile"
    afile.write_text("")
    out = {"file": str(afile), "under_file": str(afile / "run"), "empty": ""}[where]
    code, line = _error_line(capsys, ["train", config_path("digits_mlp"), "-q", "--output-dir", out])
    assert code == 2, line
    assert ("--output-dir: an empty path" in line if where == "empty"
            else f"output.dir: output folder {out}" in line), line


def test_output_folder_that_makedirs_refuses(tmp_path, capsys, monkeypatch):
    """A folder the permission check passes but that cannot be made (as root under /proc, where access()
    says yes): exit 2 naming output.dir, not a failure while running."""
    monkeypatch.delenv("ONNXTRAIN_DEBUG", raising=False)
    out = str(tmp_path / "run")
    real = os.makedirs

    def refuse(path, *a, **k):
        if os.path.abspath(path) == out:
            raise FileNotFoundError(2, "No such file or directory", path)
        return real(path, *a, **k)

    monkeypatch.setattr(os, "makedirs", refuse)
    code, line = _error_line(capsys, ["train", config_path("digits_mlp"), "-q", "--output-dir", out])
    assert code == 2 and f"output.dir: cannot make the output folder {out}" in line, line


@pytest.mark.parametrize("setting,key", [
    ("optimizer.lr=.nan", "optimizer.lr"), ("optimizer.lr=.inf", "optimizer.lr"),
    ("optimizer.clip_grad_norm=-1", "optimizer.clip_grad_norm"), ("optimizer.eps=-1e-8", "optimizer.eps"),
    ("optimizer.weight_decay=-5", "optimizer.weight_decay"), ("training.seed=-1", "training.seed"),
])
def test_values_that_would_wreck_training_are_refused(setting, key, tmp_path, capsys):
    code, line = _error_line(capsys, ["train", config_path("digits_mlp"), "-q", "--output-dir",
                                      str(tmp_path), "--set", setting])
    assert code == 2 and f"{key}: expected" in line, line


def test_duplicate_yaml_key_is_refused(tmp_path, capsys):
    cfg = tmp_path / "dup.yaml"
    cfg.write_text("model:\n  builder: mlp\n  builder: cnn\ntraining:\n  epochs: 1\n")
    code, line = _error_line(capsys, ["train", str(cfg), "-q", "--output-dir", str(tmp_path / "o")])
    assert code == 2 and line.count(str(cfg)) == 1 and "line 3: key 'builder' given twice" in line, line


def test_debug_variable_set_to_zero_keeps_one_line(tmp_path, capsys, monkeypatch):
    """A failure while running (a checkpoint file that is no checkpoint) stays one line."""
    monkeypatch.setenv("ONNXTRAIN_DEBUG", "0")
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"not a checkpoint at all")
    code, line = _error_line(capsys, ["export", config_path("digits_mlp"), "--checkpoint", str(bad), "-o",
                                      str(tmp_path / "m.onnx")])
    assert code == 1 and "ONNXTRAIN_DEBUG=1" in line, line


def test_epochs_set_where_steps_decide(tmp_path, capsys):
    """tiny_transformer.yaml sets training.steps, which overrides epochs: an epochs --set would be ignored."""
    code, line = _error_line(capsys, ["train", config_path("tiny_transformer"), "-q", "--output-dir",
                                      str(tmp_path), "--set", "training.epochs=1"])
    assert code == 2 and "training.epochs: set with --set, but training.steps (400)" in line, line


def test_data_parallel_without_mpiexec_says_how_to_launch_this_command(tmp_path, capsys, monkeypatch):
    argv = ["train", config_path("digits_mlp"), "-q", "--output-dir", str(tmp_path), "--set",
            "training.data_parallel_size=2"]
    monkeypatch.setattr("sys.argv", ["/usr/bin/onnxtrain", *argv])
    code, line = _error_line(capsys, argv)
    want = f"launch with: mpiexec -n 2 onnxtrain train {config_path('digits_mlp')}"
    assert code == 2 and want in line, line


@pytest.mark.parametrize("config,setting,key", [
    ("digits_mlp", "model.args.sizes=[64,0,10]", "model.args.sizes"),
    ("digits_cnn", "model.args.channels=[0,16]", "model.args.channels"),
    ("digits_cnn", "model.args.classes=0", "model.args.classes"),
    ("tiny_transformer", "model.args.dim=0", "model.args.dim"),
    ("tiny_transformer", "model.args.heads=0", "model.args.heads"),
    ("tiny_transformer", "model.args.vocab=0", "model.args.vocab"),
    ("tiny_transformer", "model.args.length=0", "model.args.length"),
    ("tiny_transformer", "model.args.layers=-1", "model.args.layers"),
    ("digits_mlp", "model.args.seed=-4", "model.args.seed"),
])
def test_zero_sizes_in_builder_args_name_their_key(config, setting, key, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ONNXTRAIN_DEBUG", raising=False)
    code, line = _error_line(capsys, ["train", config_path(config), "-q", "--output-dir", str(tmp_path),
                                      "--set", setting])
    assert code == 2 and f"{config}.yaml: {key}: expected " in line and "builder)" in line, line
    assert not os.path.exists(tmp_path / "metrics.jsonl")


@pytest.mark.parametrize("loss", ["logits", "h0_relu"])
def test_a_loss_that_is_not_a_scalar_is_a_config_error(loss, tmp_path, capsys):
    code, line = _error_line(capsys, ["train", config_path("digits_mlp"), "-q", "--output-dir", str(tmp_path),
                                      "--set", f"model.loss={loss}"])
    assert code == 2 and f"model.loss: '{loss}' is not a scalar (shape ['N', " in line, line
    assert not os.path.exists(tmp_path / "metrics.jsonl")  # refused before training starts


@pytest.mark.filterwarnings("ignore:the model declares value")
def test_a_loss_whose_shape_is_declared_wrong_fails_cleanly_at_the_first_step(tmp_path, capsys, write_config):
    """reduction='none' behind a graph output declared as a scalar: shape inference cannot tell, so the first
    step's loss is checked; one line naming model.loss, no traceback."""
    model = zoo.mlp([64, 16, 10])
    next(n for n in model.graph.node if n.op_type == "SoftmaxCrossEntropyLoss").attribute.append(
        onnx.helper.make_attribute("reduction", "none"))
    onnx.save(model, str(tmp_path / "m.onnx"))
    cfg = write_config({"model": {"path": "m.onnx"}, "training": {"steps": 2}})
    code, line = _error_line(capsys, ["train", cfg, "-q", "--output-dir", str(tmp_path / "out")])
    assert code == 2 and "model.loss: 'loss' is not a scalar" in line, line


def test_eval_and_export_refuse_a_checkpoint_that_does_not_fit(tmp_path, capsys):
    """A layer the checkpoint lacks or a shape that differs is an error naming the tensors, not a model with
    freshly initialised weights."""
    out = str(tmp_path / "run")
    assert main(["train", config_path("digits_mlp"), "-q", "--output-dir", out, "--set", "training.steps=2",
                 "--set", "model.args.sizes=[64,32,10]"]) == 0
    capsys.readouterr()
    deeper = ["--set", "model.args.sizes=[64,32,32,10]"]
    code, line = _error_line(capsys, ["eval", config_path("digits_mlp"), "--checkpoint", out, *deeper])
    assert code == 2 and "does not fit this config's model" in line and "'fc2.weight'" in line, line
    assert "fc1.weight (checkpoint [10, 32], model [32, 32])" in line, line
    exported = tmp_path / "m.onnx"
    code, line = _error_line(capsys, ["export", config_path("digits_mlp"), "--checkpoint", out, "-o",
                                      str(exported)])  # the config's default sizes [64, 128, 10]
    assert code == 2 and "fc0.weight (checkpoint [32, 64], model [128, 64])" in line, line
    assert not exported.exists()
    assert main(["export", config_path("digits_mlp"), "--checkpoint", out, "-o", str(exported), "--set",
                 "model.args.sizes=[64,32,10]"]) == 0


@pytest.mark.parametrize("where", ["folder", "empty", "no_parent", "trailing_separator"])
def test_export_to_an_unusable_path_is_a_usage_error(where, tmp_path, capsys):
    """-o naming a folder, nothing, a file in a missing folder or a folder that does not exist (a trailing
    separator: it failed with exit 1 and 'Not a directory'): exit 2 naming -o, before any work and without a
    temporary left behind."""
    target = {"folder": str(tmp_path), "empty": "", "no_parent": str(tmp_path / "nope" / "m.onnx"),
              "trailing_separator": str(tmp_path / "new") + os.sep}[where]
    code, line = _error_line(capsys, ["export", config_path("digits_mlp"), "--checkpoint", str(tmp_path),
                                      "-o", target])
    assert code == 2 and "-o/--output: " in line, line
    assert {"folder": "is a folder", "empty": "an empty path", "no_parent": "does not exist",
            "trailing_separator": "names a folder"}[where] in line
    assert os.listdir(tmp_path) == []


def test_final_lr_ratio_with_a_constant_schedule_warns(tmp_path, capsys):
    from onnxtrain.train import Trainer

    Trainer(load_config(config_path("digits_mlp"), ["schedule.kind=constant", "training.steps=1"]),
            str(tmp_path), progress=False)
    err = capsys.readouterr().err
    assert "warning: schedule.final_lr_ratio (0.05) has no effect with schedule.kind constant" in err, err
    Trainer(load_config(config_path("digits_mlp"), ["training.steps=1"]), str(tmp_path), progress=False)
    assert "warning" not in capsys.readouterr().err


def test_quiet_help_says_what_it_hides(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "no progress bar and no per-eval lines" in " ".join(capsys.readouterr().out.split())


def test_unreadable_data_files_name_the_key_and_the_file(tmp_path, capsys, mlp_with_loss, write_config):
    """A file that is not numpy's (a pickle), a damaged .npz (cut short, or a byte changed), an array of
    Python objects or a scalar: one line naming the config key and the file, exit 2 (a pickle message naming
    neither, or a traceback, before)."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "good.npz", x=rng.standard_normal((8, 4)).astype(np.float32), y=np.zeros(8, np.int64))
    (tmp_path / "bad.npz").write_bytes(b"\x80\x04not numpy")
    np.save(tmp_path / "scalar.npy", np.float32(1.0))
    np.save(tmp_path / "objects.npy", np.array([1, "a"], dtype=object), allow_pickle=True)
    whole = (tmp_path / "good.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(whole[: len(whole) // 2])  # a copy cut short
    flipped = bytearray(whole)
    flipped[len(whole) // 3] ^= 0xFF  # a byte of the first array's data: its CRC fails when it is read
    (tmp_path / "flipped.npz").write_bytes(bytes(flipped))
    base = {"model": {"path": mlp_with_loss}, "training": {"steps": 1}}
    cases = [({"source": "files", "path": "bad.npz", "feeds": {"x": "x", "y": "y"}}, "data.path",
              "bad.npz could not be read as numpy arrays (it is neither a .npy nor an .npz file"),
             ({"source": "files", "path": "cut.npz", "feeds": {"x": "x", "y": "y"}}, "data.path",
              "cut.npz could not be read as numpy arrays (a damaged .npz archive"),
             ({"source": "files", "path": "flipped.npz", "feeds": {"x": "x", "y": "y"}}, "data.path",
              "flipped.npz could not be read as numpy arrays (a damaged .npz archive"),
             ({"source": "files", "path": "good.npz", "feeds": {"x": "scalar.npy", "y": "y"}}, "data.feeds.x",
              "scalar.npy is a scalar"),
             ({"source": "files", "path": "good.npz", "feeds": {"x": "objects.npy", "y": "y"}},
              "data.feeds.x", "objects.npy could not be read")]
    for data, key, piece in cases:
        cfg = write_config({**base, "data": data})
        code, line = _error_line(capsys, ["train", cfg, "-q", "--output-dir", str(tmp_path / "out")])
        assert code == 2 and f"{key}: " in line and piece in line, line


def test_eval_fraction_with_an_eval_file_is_refused(tmp_path, capsys, mlp_with_loss, write_config):
    np.savez(tmp_path / "d.npz", x=np.zeros((8, 4), np.float32), y=np.zeros(8, np.int64))
    cfg = write_config({"model": {"path": mlp_with_loss}, "training": {"steps": 1},
                        "data": {"source": "files", "path": "d.npz", "feeds": {"x": "x", "y": "y"},
                                 "eval_path": "d.npz", "eval_fraction": 0.3}})
    code, line = _error_line(capsys, ["train", cfg, "-q", "--output-dir", str(tmp_path / "out")])
    assert code == 2 and "data.eval_fraction: has no effect with data.eval_path" in line, line


def test_a_run_with_an_eval_file_resumes_and_evaluates_from_its_saved_config(tmp_path, capsys, mlp_with_loss,
                                                                             write_config):
    """The saved config.yaml of a run with ``eval_path`` leaves the unused eval_fraction out, and a config
    saved with the default's value (older runs) still loads: resume and eval from it work."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((8, 4)).astype(np.float32),
             y=rng.integers(0, 2, 8).astype(np.int64))
    cfg = write_config({"model": {"path": mlp_with_loss}, "training": {"steps": 2, "batch_size": 4},
                        "data": {"source": "files", "path": "d.npz", "feeds": {"x": "x", "y": "y"},
                                 "eval_path": "d.npz"}})
    out = tmp_path / "out"
    assert main(["train", cfg, "-q", "--output-dir", str(out)]) == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert "eval_fraction" not in saved["data"] and saved["data"]["eval_path"]
    saved["data"]["eval_fraction"] = 0.1  # as runs before this change saved it
    (tmp_path / "copy.yaml").write_text(yaml.safe_dump(saved))
    capsys.readouterr()
    assert main(["train", str(tmp_path / "copy.yaml"), "-q", "--resume", "--set", "training.steps=3"]) == 0
    assert (out / "checkpoints" / "step_00000003.ckpt").exists()
    assert main(["eval", str(tmp_path / "copy.yaml"), "--checkpoint",
                 str(out / "checkpoints" / "step_00000003.ckpt")]) == 0


def test_flags_in_the_int_attributes_map_may_be_true_or_false(tmp_path, capsys):
    """``do_bias_correction: false`` in optimizer_int_attributes_map is 0, as onnxruntime's binding stored a
    bool given for an int attribute (it was refused as not an integer)."""
    setting = ("training.parameters.optimizer_int_attributes_map={fc0.weight: {do_bias_correction: false}, "
               "fc0.bias: {}, fc1.weight: {}, fc1.bias: {}, fc2.weight: {}, fc2.bias: {}}")
    cfg = load_config(config_path("digits_mlp"), [setting])
    flag = cfg.training.parameters["optimizer_int_attributes_map"]["fc0.weight"]["do_bias_correction"]
    assert flag == 0 and type(flag) is int
    floats = "training.parameters.optimizer_attributes_map={fc0.weight: {ratio_max: true}}"
    value = load_config(config_path("digits_mlp"), [floats]).training.parameters[
        "optimizer_attributes_map"]["fc0.weight"]["ratio_max"]
    assert value == 1.0 and type(value) is float
    assert main(["train", config_path("digits_mlp"), "-q", "--output-dir", str(tmp_path / "out"),
                 "--set", setting, "--set", "training.steps=2"]) == 0


def test_a_model_too_large_for_memory_is_one_line(tmp_path, capsys):
    huge = "model.args.sizes=[64, 100000000000, 10]"
    code, line = _error_line(capsys, ["train", config_path("digits_mlp"), "-q", "--output-dir",
                                      str(tmp_path / "out"), "--set", huge])
    assert code == 1 and "out of memory" in line, line


def test_the_saved_config_resumes_from_another_folder(tmp_path, capsys, monkeypatch):
    """config.yaml names the run's folder as an absolute path, as it names the model and data: resuming from
    it in another working directory finds the run (it looked for the relative folder there)."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", config_path("digits_mlp"), "-q", "--output-dir", "runs/a", "--set",
                 "training.steps=2"]) == 0
    saved = tmp_path / "runs" / "a" / "config.yaml"
    assert os.path.isabs(yaml.safe_load(saved.read_text())["output"]["dir"])
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "copy.yaml").write_text(saved.read_text())  # (the run's own config.yaml is its output)
    monkeypatch.chdir(other)
    capsys.readouterr()
    assert main(["train", "copy.yaml", "-q", "--resume", "--set", "training.steps=3"]) == 0
    assert not (other / "runs").exists()
    assert (tmp_path / "runs" / "a" / "checkpoints" / "step_00000003.ckpt").exists()


def test_labels_of_the_wrong_shape_for_an_appended_loss_are_refused_at_load(tmp_path, capsys, write_config):
    """With ``add_loss: cross_entropy`` the labels input is declared as the logits without the class axis,
    so labels of shape [N, 1] are refused when the data loads, naming the key (they failed at the first
    step as a node error)."""
    onnx.save(zoo.mlp([4, 3, 2], loss=False), str(tmp_path / "m.onnx"))
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((8, 4)).astype(np.float32),
             y=np.zeros((8, 1), np.int64))
    cfg = write_config({"model": {"path": "m.onnx", "add_loss": "cross_entropy", "labels": "labels"},
                        "data": {"source": "files", "path": "d.npz", "feeds": {"x": "x", "labels": "y"}},
                        "training": {"steps": 1}})
    code, line = _error_line(capsys, ["train", cfg, "-q", "--output-dir", str(tmp_path / "out")])
    assert code == 2 and "data.feeds.labels:" in line and "takes shape" in line, line


def test_per_weight_optimizer_attributes_of_the_wrong_type_name_their_key(tmp_path, capsys):
    """A string where an optimizer attribute takes a number: one line naming the map, weight and attribute,
    exit 2 (a bare "invalid literal for int()" exit 1 before)."""
    for setting, key in (
            ("training.parameters.optimizer_int_attributes_map={fc0.weight: {do_bias_correction: x}}",
             "optimizer_int_attributes_map.fc0.weight.do_bias_correction: expected an integer"),
            ("training.parameters.optimizer_attributes_map={fc0.weight: {max_norm_clip: big}}",
             "optimizer_attributes_map.fc0.weight.max_norm_clip: expected a number")):
        code, line = _error_line(capsys, ["train", config_path("digits_mlp"), "-q", "--output-dir",
                                          str(tmp_path / "out"), "--set", setting])
        assert code == 2 and key in line, line


def test_eval_warns_when_the_held_out_split_is_not_the_runs(tmp_path, capsys, mlp_with_loss, write_config):
    """``eval`` with another seed (or eval fraction) than the run's scored a held-out split drawn differently,
    partly of samples the run trained on, without a word; it now warns, naming the keys."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((40, 4)).astype(np.float32),
             y=rng.integers(0, 2, 40).astype(np.int64))
    training = {"steps": 2, "batch_size": 4, "seed": 0}
    cfg = write_config({"model": {"path": mlp_with_loss}, "training": training,
                        "data": {"source": "files", "path": "d.npz", "feeds": {"x": "x", "y": "y"},
                                 "eval_fraction": 0.25}})
    out = tmp_path / "out"
    assert main(["train", cfg, "-q", "--output-dir", str(out)]) == 0
    capsys.readouterr()
    assert main(["eval", cfg, "--checkpoint", str(out)]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(["eval", cfg, "--checkpoint", str(out), "--set", "training.seed=5",
                 "--set", "data.eval_fraction=0.5"]) == 0
    err = capsys.readouterr().err
    assert "data.eval_fraction, training.seed differ from the run that wrote" in err, err


@pytest.mark.parametrize("name, make", [("checkpoints", "file"), ("metrics.jsonl", "folder")])
def test_an_output_folder_whose_run_paths_are_taken_is_refused_before_training(tmp_path, capsys, name, make):
    """A file named ``checkpoints`` failed only at the first checkpoint, after the training (all of it lost);
    a folder named ``metrics.jsonl`` gave a message saying there was no metrics.jsonl."""
    out = tmp_path / "out"
    out.mkdir()
    if make == "file":
        (out / name).write_text("")
    else:
        (out / name).mkdir()
    code = main(["train", config_path("digits_mlp"), "-q", "--set", "training.steps=2",
                 "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert code != 0 and f"{name} is a {make}" in err, err
    assert not (out / "metrics.jsonl").is_file()


def test_non_finite_data_values_are_refused_at_load_naming_key_and_index(tmp_path, capsys, monkeypatch):
    # a NaN in the features ran and was blamed on the learning rate ("training diverges")
    monkeypatch.delenv("ONNXTRAIN_DEBUG", raising=False)
    x = np.zeros((40, 64), np.float32)
    x[17, 3] = np.nan
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", np.arange(40) % 10)
    argv = ["train", config_path("digits_mlp"), "-q", "--output-dir", str(tmp_path / "f"), "--set",
            f"data={{source: files, feeds: {{x: {tmp_path / 'x.npy'}, y: {tmp_path / 'y.npy'}}}}}",
            "--set", "training.steps=2"]
    code, line = _error_line(capsys, argv)
    assert code == 2 and "data.feeds.x" in line and "1 NaN or infinite value(s)" in line, line
    assert "(17, 3)" in line and "x.npy" in line, line


def test_resume_without_a_checkpoint_makes_no_output_folder(tmp_path, capsys, monkeypatch):
    """A refused --resume (a mistyped --output-dir) leaves no empty folders behind."""
    monkeypatch.delenv("ONNXTRAIN_DEBUG", raising=False)
    out = tmp_path / "typo" / "run"
    code, line = _error_line(capsys, ["train", config_path("digits_mlp"), "-q", "--output-dir", str(out),
                                      "--resume"])
    assert code == 2 and "--resume: no checkpoint in" in line, line
    assert not (tmp_path / "typo").exists()


def test_ctrl_c_while_the_modules_load_is_one_line(capsys, monkeypatch):
    """Ctrl-C before the subcommand's own handler (while numpy, onnx and the engine load): exit 130 and one
    line, not a traceback."""
    import onnxtrain.cli as cli

    def interrupted(a):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_run", interrupted)
    code, line = _error_line(capsys, ["info", "model.onnx"])
    assert (code, line) == (130, "onnxtrain info: interrupted")


def test_a_folder_another_run_trains_in_is_refused(tmp_path, capsys, monkeypatch):
    """A second run in a folder whose run is still training (its lock held; here by this test) is refused
    before it reads or deletes anything, even with --overwrite; once the lock is released, it trains."""
    from onnxtrain.train.outputs import lock_folder

    monkeypatch.delenv("ONNXTRAIN_DEBUG", raising=False)
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")  # a run's folder
    fd = lock_folder(str(out))
    if fd is None:
        pytest.skip("no advisory folder locks here")
    argv = ["train", config_path("digits_mlp"), "-q", "--output-dir", str(out), "--overwrite",
            "--set", "training.steps=2"]
    try:
        code, line = _error_line(capsys, argv)
        assert code == 2 and "another onnxtrain run is training in" in line and str(out) in line, line
        assert os.listdir(out) == ["metrics.jsonl"]
    finally:
        os.close(fd)
    assert main(argv) == 0
    capsys.readouterr()
    fd = lock_folder(str(out))  # the finished run released its lock
    try:
        with pytest.raises(BlockingIOError):  # and a held lock refuses a second holder
            lock_folder(str(out))
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks")
def test_a_forked_child_does_not_keep_the_folder_locked(tmp_path):
    """A process forked during a run (the engine's half-batch child, a user's worker) that outlives the run
    does not keep its folder locked: it closes its copy of the lock at the fork."""
    from onnxtrain.train.outputs import lock_folder, unlock_folder

    fd = lock_folder(str(tmp_path))
    if fd is None:
        pytest.skip("no advisory folder locks here")
    r, w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child outlives the parent's lock: it waits until the parent has tried to relock
        os.close(w)
        os.write(ready_w, b"x")  # (the fork's handlers have run)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    os.close(ready_w)
    os.read(ready_r, 1)
    os.close(ready_r)
    try:
        unlock_folder(fd)
        again = lock_folder(str(tmp_path))  # BlockingIOError if the child's copy still held it
        unlock_folder(again)
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)


@pytest.mark.parametrize("content", [b"", b"\x08\x07"])
def test_an_empty_model_file_is_named_as_such(tmp_path, capsys, content):
    """An empty .onnx (a failed download, a torch export that died) parses as an empty ModelProto: the run
    said "model.logits: 'logits' is not a value of the model; outputs: []", blaming the key. It now says
    that model.path is not an ONNX model, as `onnxtrain info` does (exit 2, before any folder is made)."""
    bad = tmp_path / "empty.onnx"
    bad.write_bytes(content)
    out = tmp_path / "run"
    code, line = _error_line(capsys, ["train", config_path("digits_mlp"), "-q", "--output-dir", str(out),
                                      "--set", f"model={{path: {bad}}}", "--set", "training.steps=2"])
    assert code == 2 and "model.path: " in line and f"{bad} is not an ONNX model (no graph" in line, line
    assert onnx.load(str(bad)).graph.ByteSize() == 0  # the oracle: onnx reads the file as an empty model
    assert not out.exists()


def test_eval_of_a_run_trained_with_set_values_points_at_its_config_yaml(tmp_path, capsys):
    """A run trained with --set model.args.sizes=... and then evaluated (or exported) with the config file
    alone was refused with the shapes that differ and nothing on what to do; the error now names the run's
    own config.yaml, which holds the values it trained with, and that one scores the checkpoint as numpy
    does on onnxruntime's logits of the exported model."""
    import onnxruntime

    from onnxtrain.data import load_digits

    out = tmp_path / "run"
    assert main(["train", config_path("digits_mlp"), "-q", "--output-dir", str(out), "--set",
                 "model.args.sizes=[64,24,10]", "--set", "training.steps=30"]) == 0
    own = out / "config.yaml"
    for command in (["eval"], ["export", "-o", str(tmp_path / "m.onnx")]):
        capsys.readouterr()
        code, line = _error_line(capsys, [*command, config_path("digits_mlp"), "--checkpoint", str(out)])
        assert code == 2 and "shapes differ" in line and f"the run's own config, {own}" in line, line
    capsys.readouterr()
    assert main(["eval", str(own), "--checkpoint", str(out), "--json"]) == 0
    scored = json.loads(capsys.readouterr().out)
    _, test = load_digits()
    sess = onnxruntime.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    logits = sess.run(None, {"x": test.x})[0]
    assert scored["eval_accuracy"] == (logits.argmax(axis=1) == test.y).mean()


@pytest.mark.parametrize("key", ["data.path", "model.path"])
def test_a_folder_given_for_a_file_is_called_a_folder(tmp_path, capsys, key):
    """model.path or data.path naming a folder (`--set data.path=.`, a run folder for its model) said
    "file not found: <the folder>", which is there; it now says it is a folder."""
    (tmp_path / "stuff").mkdir()
    np.savez(tmp_path / "d.npz", x=np.zeros((8, 64), np.float32), y=np.zeros(8, np.int64))
    model = {"path": "stuff"} if key == "model.path" else {"builder": "mlp", "args": {"sizes": [64, 10]}}
    data = {"source": "files", "path": "stuff" if key == "data.path" else "d.npz",
            "feeds": {"x": "x", "y": "y"}}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": model, "data": data, "training": {"steps": 1}}))
    code, line = _error_line(capsys, ["train", str(config), "-q", "--output-dir", str(tmp_path / "out")])
    assert code == 2 and f"{key}: {tmp_path / 'stuff'} is a folder, not a file" in line, line


def test_a_checkpoint_outside_a_run_folder_names_no_config_yaml_as_the_runs(tmp_path, capsys):
    """A .ckpt file copied out of its run, into a folder whose parent holds a config.yaml of some other
    model (a project's own), refused for shapes that differ: the error names no config.yaml as the run's,
    since that folder holds no run (no metrics.jsonl, no checkpoints folder)."""
    import shutil

    from onnxtrain.train.outputs import is_run_folder, list_checkpoints

    run = tmp_path / "run"
    assert main(["train", config_path("digits_mlp"), "-q", "--output-dir", str(run), "--set",
                 "model.args.sizes=[64,24,10]", "--set", "training.steps=5"]) == 0
    (kept := tmp_path / "project" / "saved").mkdir(parents=True)
    _, ckpt = list_checkpoints(str(run))[-1]
    for f in os.listdir(os.path.dirname(ckpt)):
        if f.startswith(os.path.basename(ckpt)):
            shutil.copy(os.path.join(os.path.dirname(ckpt), f), kept / f)
    other = tmp_path / "project" / "config.yaml"
    other.write_text("model:\n  builder: cnn\n", encoding="utf-8")
    assert not is_run_folder(str(other.parent))
    capsys.readouterr()
    code, line = _error_line(capsys, ["eval", config_path("digits_mlp"), "--checkpoint",
                                      str(kept / os.path.basename(ckpt))])
    assert code == 2 and "shapes differ" in line and "config.yaml" not in line, line


def test_resume_with_another_optimizer_names_the_optimizer(tmp_path, capsys):
    """A run of SGD resumed with Adam: the checkpoint lacks Adam's moments, which is the optimizer's misfit,
    not the model's; the changed key is named."""
    out = str(tmp_path / "run")
    base = ["--output-dir", out, "--set", "training.steps=2"]
    assert main(["train", config_path("digits_mlp"), "-q", *base, "--set", "optimizer.name=sgd"]) == 0
    capsys.readouterr()
    code, line = _error_line(capsys, ["train", config_path("digits_mlp"), "-q", *base, "--set",
                                      "training.steps=4", "--set", "optimizer.name=adam", "--resume"])
    assert code == 2 and "does not fit this config's optimizer" in line and "optimizer.name" in line, line
    assert "model" not in line.split("(")[0], line
