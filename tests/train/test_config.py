"""Config loading: key-path errors for unknown keys, wrong types and missing files; --set overrides."""

from __future__ import annotations

import subprocess
import sys

import pytest

from onnxtrain.cli import main
from onnxtrain.train.config import ConfigError, load_config
from tests.train.conftest import REPO, config_path

MLP = {"model": {"builder": "mlp", "args": {"sizes": [64, 16, 10]}}, "training": {"epochs": 1}}


def _error_line(capsys, argv) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return code, err[0]


@pytest.mark.parametrize("name", ["digits_mlp", "digits_cnn", "digits_stn", "tiny_transformer"])
def test_shipped_configs_load(name):
    cfg = load_config(config_path(name))
    assert cfg.name == name


@pytest.mark.parametrize("raw, key, words", [
    ({**MLP, "trainig": {"epochs": 1}}, "trainig", "did you mean 'training'"),
    ({**MLP, "training": {"epochs": 1, "batchsize": 8}}, "training.batchsize", "did you mean 'batch_size'"),
    ({**MLP, "data": {"source": "digits", "path": "x.npz"}}, "data.path", "unknown key"),
    ({**MLP, "model": {"builder": "mlp", "args": {"sizes": [64, 10], "hidden": 3}}}, "model.args.hidden",
     "unknown key"),
])
def test_unknown_key_names_its_path(write_config, capsys, raw, key, words):
    code, line = _error_line(capsys, ["train", write_config(raw)])
    assert code == 2
    assert f"{key}: " in line and words in line


@pytest.mark.parametrize("raw, key, expected", [
    ({**MLP, "training": {"epochs": "ten"}}, "training.epochs", "expected an int or null, got 'ten'"),
    ({**MLP, "training": {"epochs": 1, "batch_size": 3.5}}, "training.batch_size", "expected an int"),
    ({**MLP, "optimizer": {"lr": "fast"}}, "optimizer.lr", "expected a number"),
    ({**MLP, "optimizer": {"name": "adagrad"}}, "optimizer.name", "expected one of 'sgd', 'adam', 'lamb'"),
    ({**MLP, "model": {"builder": "mlp", "args": {"sizes": [64, "x", 10]}}}, "model.args.sizes[1]",
     "expected an int"),
    ({**MLP, "schedule": "cosine"}, "schedule", "expected a mapping"),
    ({**MLP, "data": {"source": "digits", "images": "yes"}}, "data.images", "expected true or false"),
])
def test_wrong_type_names_its_path(write_config, capsys, raw, key, expected):
    code, line = _error_line(capsys, ["train", write_config(raw)])
    assert code == 2
    assert f"{key}: {expected}" in line


def test_missing_model_file_names_its_path(write_config, capsys):
    code, line = _error_line(capsys, ["train", write_config({"model": {"path": "nope.onnx"}, "training": {
        "epochs": 1}})])
    assert code == 2
    assert "model.path: file not found" in line and "nope.onnx" in line


def test_missing_data_file_names_its_path(write_config, capsys):
    raw = {**MLP, "data": {"source": "files", "path": "missing.npz", "feeds": {"x": "a", "y": "b"}}}
    code, line = _error_line(capsys, ["eval", write_config(raw), "--checkpoint", "x"])
    assert code == 2 and "data.path: file not found" in line


def test_missing_config_file(capsys):
    code, line = _error_line(capsys, ["train", "no/such/config.yaml"])
    assert code == 2 and "config file not found" in line and "repository" not in line


def test_missing_example_config_says_where_the_examples_are(capsys, tmp_path, monkeypatch):
    """The README's configs/<name>.yaml run outside the repository (an install from a wheel, which holds
    no configs): the message says where it looked and where the example configs are."""
    monkeypatch.chdir(tmp_path)
    code, line = _error_line(capsys, ["train", "configs/digits_mlp.yaml"])
    assert code == 2 and "config file not found: configs/digits_mlp.yaml" in line
    assert str(tmp_path) in line and "repository's configs/ folder" in line


def test_cross_key_checks(write_config):
    with pytest.raises(ConfigError, match=r"^model: give exactly one of builder"):
        load_config(write_config({"model": {}, "training": {"epochs": 1}}))
    with pytest.raises(ConfigError, match=r"^training.epochs: give training.epochs or training.steps"):
        load_config(write_config({"model": MLP["model"]}))
    with pytest.raises(ConfigError, match=r"^model.args.sizes: required by the mlp builder"):
        load_config(write_config({"model": {"builder": "mlp"}, "training": {"epochs": 1}}))
    with pytest.raises(ConfigError, match=r"^optimizer.betas: not supported by sgd"):
        load_config(write_config({**MLP, "optimizer": {"name": "sgd", "betas": [0.9, 0.99]}}))
    with pytest.raises(ConfigError, match=r"^training.parameters.use_fancy_mode: unknown key"):
        load_config(write_config({**MLP, "training": {"epochs": 1, "parameters": {"use_fancy_mode": True}}}))
    stages = {"pipeline_parallel_size": 2, "pipeline_cut_info_string": "h"}
    with pytest.raises(ConfigError, match=r"^training.parameters.pipeline_parallel_size: the main job"):
        load_config(write_config({**MLP, "training": {"epochs": 1, "parameters": stages}}))
    grads = {"set_gradients_as_graph_outputs": True}
    said = r"^training.parameters.set_gradients_as_graph_outputs: the main job"
    with pytest.raises(ConfigError, match=said):
        load_config(write_config({**MLP, "training": {"epochs": 1, "parameters": grads}}))


def test_set_overrides_with_type_checking(write_config):
    path = write_config(MLP)
    cfg = load_config(path, ["training.epochs=3", "optimizer.lr=3e-3", "schedule.kind=cosine",
                             "model.args.sizes=[64, 32, 10]", "output.dir=/tmp/x"])
    assert cfg.training.epochs == 3 and cfg.optimizer.lr == 3e-3 and cfg.schedule.kind == "cosine"
    assert cfg.model.args["sizes"] == [64, 32, 10] and cfg.output.dir == "/tmp/x"
    with pytest.raises(ConfigError, match=r"^training.batch_size: expected an int, got 'many'"):
        load_config(path, ["training.batch_size=many"])
    with pytest.raises(ConfigError, match=r"^training.bach_size: unknown key \(did you mean 'batch_size'"):
        load_config(path, ["training.bach_size=8"])
    with pytest.raises(ConfigError, match="expected key.path=value"):
        load_config(path, ["training.epochs"])


def test_yaml_reads_exponent_floats(write_config):
    """PyYAML reads ``1e-3`` as a string; our loader reads it as the number it looks like."""
    path = write_config(MLP)
    with open(path, "a") as f:
        f.write("optimizer:\n  lr: 1e-3\n")
    assert load_config(path).optimizer.lr == 1e-3


def test_command_line_exit_code_and_one_line():
    """The installed entry point: a bad --set exits 2 with one stderr line naming the key."""
    r = subprocess.run([sys.executable, "-m", "onnxtrain", "train", config_path("digits_mlp"), "--set",
                        "training.epochs=lots"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "training.epochs: expected an int or null, got 'lots'" in lines[0], r.stderr


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["eval", "--help"], ["export", "--help"],
                                  ["info", "--help"], ["gradient-graph", "--help"]])
def test_help_everywhere(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    assert "usage: onnxtrain" in capsys.readouterr().out


def test_info_counts_the_nodes_of_bodies(capsys, tmp_path):
    """`onnxtrain info` walks control-flow bodies: their ops are counted and checked for kernels and rules."""
    import onnx
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    then_g = helper.make_graph([helper.make_node("Frobnicate", ["x"], ["t"], domain="com.example")], "t", [],
                               [helper.make_tensor_value_info("t", f, [2])])
    else_g = helper.make_graph([helper.make_node("Tanh", ["x"], ["e"])], "e", [],
                               [helper.make_tensor_value_info("e", f, [2])])
    g = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)], "g",
                          [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                           helper.make_tensor_value_info("x", f, [2])],
                          [helper.make_tensor_value_info("y", f, [2])])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]
    m = helper.make_model(g, opset_imports=opsets)
    path = tmp_path / "branchy.onnx"
    onnx.save(m, path)
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ops (with the 2 nodes inside control-flow bodies): If×1, Tanh×1, com.example:Frobnicate×1" in out
    assert "ops without a kernel: com.example:Frobnicate" in out
    assert "ops without a gradient rule: com.example:Frobnicate" in out


def test_info_names_ops_run_as_their_function_body(tmp_path, capsys) -> None:
    """An opset-23 RMSNormalization has no kernel or rule of its own: info says it runs as its ONNX body."""
    import onnx
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    g = helper.make_graph([helper.make_node("RMSNormalization", ["x", "s"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", f, [2, 4]),
                           helper.make_tensor_value_info("s", f, [4])],
                          [helper.make_tensor_value_info("y", f, [2, 4])])
    path = tmp_path / "rms.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)]), path)
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ops without a kernel: none" in out and "ops without a gradient rule: none" in out
    assert "ops run and differentiated as their ONNX function body: RMSNormalization" in out


def test_a_path_found_only_in_the_working_folder_says_where_paths_start(tmp_path, monkeypatch, capsys):
    """model.path is relative to the config's folder, --set's too: a file named as the user sees it in the
    working folder was 'not found' under the config's folder with no word on why."""
    import onnx

    from onnxtrain import zoo

    (tmp_path / "cfg").mkdir()
    cfg = tmp_path / "cfg" / "c.yaml"
    cfg.write_text("model: {path: m.onnx}\ntraining: {steps: 1}\n")
    monkeypatch.chdir(tmp_path)
    onnx.save(zoo.mlp([64, 10]), str(tmp_path / "here.onnx"))
    code = main(["train", str(cfg), "--set", "model.path=here.onnx", "-q"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "model.path: file not found: " + str(tmp_path / "cfg" / "here.onnx") in err
    assert "relative to the config's folder" in err and str(tmp_path / "here.onnx") in err, err
