"""A config error about a key is printed after the config file and the line that writes the key (README), also
when the message itself shows the file, as the suggested command of a refused parallel setting does
('launch with: mpiexec -n 2 onnxtrain train run.yaml ...'), review H: the CLI left out 'run.yaml:N: ' whenever
the file's name was anywhere in the message. The oracle for the line: the line of the file's text that writes
the key."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from onnxtrain.cli import main
from tests.train.conftest import REPO

TEXT = """model:
  builder: mlp
  args: {sizes: [64, 8, 10]}
training:
  steps: 1
  {key}: {value}
output: {plot: false, export: false}
"""


@pytest.mark.parametrize("key,value", [("data_parallel_size", 2), ("parameters", "{world_size: 3}"),
                                       ("parameters", "{world_rank: 1}")])
def test_a_refused_parallel_setting_names_the_file_and_line(tmp_path, key, value):
    path = tmp_path / "run.yaml"
    path.write_text(TEXT.replace("{key}", key).replace("{value}", str(value)))
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if text.strip().startswith(key))
    # (a process of its own: the suggested command repeats its sys.argv, which names the file)
    argv = [sys.executable, "-m", "onnxtrain", "train", "run.yaml", "-q", "--output-dir", "out"]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": REPO})
    err = proc.stderr.strip()
    assert proc.returncode == 2, err
    assert err.startswith(f"onnxtrain train: run.yaml:{line}: training.{key}"), err
    assert "mpiexec -n" in err and "onnxtrain train run.yaml" in err  # (still says how to launch)


def test_a_message_about_the_file_itself_names_it_once(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("model: [\n")
    assert main(["train", str(path), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count(str(path)) == 1 and "not valid YAML" in err, err
