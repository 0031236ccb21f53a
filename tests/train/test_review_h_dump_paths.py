"""The graph dumps a config asks for through ``training.parameters`` (``model_with_gradient_graph_path``,
``model_with_training_graph_path``, ``model_after_graph_transforms_path``), review H: a path the session
cannot write (a missing folder, a folder itself, a file on the way) is a config error, named by its key path
after the config file and its line, exit 2 as for the config's other files. It was a run failure (exit 1)
naming only the TrainingParameters property ('[Errno 2] TrainingParameters.model_with_training_graph_path: No
such file or directory'). The oracle that the path cannot be written: Python's own open() refuses it."""

from __future__ import annotations

import os

import onnx
import pytest

from onnxtrain.cli import main

KEYS = ["model_with_gradient_graph_path", "model_with_training_graph_path",
        "model_after_graph_transforms_path"]


def _config(tmp_path, key: str, path: str) -> str:
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  builder: mlp\n  args: {sizes: [64, 8, 10]}\n"
                   f"training:\n  steps: 1\n  parameters:\n    {key}: {path}\n"
                   "output: {plot: false, export: false}\n")
    return str(cfg)


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("where", ["missing folder", "a folder", "a file on the way"])
def test_an_unwritable_dump_path_names_its_key_and_exits_2(tmp_path, capsys, key, where):
    (tmp_path / "plain").write_text("x")
    path = {"missing folder": tmp_path / "nope" / "g.onnx", "a folder": tmp_path,
            "a file on the way": tmp_path / "plain" / "g.onnx"}[where]
    with pytest.raises(OSError):  # the oracle: the path cannot be written
        open(path, "wb").close()
    config = _config(tmp_path, key, str(path))
    code = main(["train", config, "-q", "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith(f"onnxtrain train: {config}:7: training.parameters.{key}: "), err
    assert str(path) in err and "Errno" not in err and "ONNXTRAIN_DEBUG" not in err, err


@pytest.mark.parametrize("key", KEYS)
def test_a_writable_dump_path_gets_the_graph(tmp_path, capsys, key):
    path = tmp_path / "g.onnx"
    config = _config(tmp_path, key, str(path))
    assert main(["train", config, "-q", "--output-dir", str(tmp_path / "out")]) == 0
    onnx.checker.check_model(onnx.load(str(path)))
    assert os.path.getsize(path) > 0
