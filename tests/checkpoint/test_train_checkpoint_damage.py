"""``onnxtrain train --resume`` from a checkpoint whose run properties are damaged.

The FlatBuffers layer cannot tell a changed byte inside a string property (the config, the data-order
generator, the log windows, all JSON text) from a good one; the resume must still say which file is damaged
and which property, not print a bare JSON parser message or a KeyError. A checkpoint saved with its SHA-256
beside it (dcfb9cf) is refused by its sum before any property is read
(tests/train/test_checkpoint_checksums.py): these tests remove the sums, as a checkpoint written before them.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from onnxtrain.checkpoint import load_checkpoint, save_checkpoint
from onnxtrain.cli import main
from onnxtrain.train.outputs import list_checkpoints
from tests.train.conftest import config_path

SETS = ["--set", "training.steps=3", "--set", "model.args.sizes=[64,8,10]"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("trained"))
    assert main(["train", config_path("digits_mlp"), "-q", "--output-dir", out, *SETS]) == 0
    return out


def _resume(out: str, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["train", config_path("digits_mlp"), "-q", "--output-dir", out, "--resume", *SETS[:1],
                 "training.steps=4", *SETS[2:]])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def _cut_json(text: str) -> str:
    return text[: len(text) // 2]


# (property, damaged value): JSON cut short, JSON of another shape, a generator that does not exist
DAMAGE = [
    ("config", _cut_json),
    ("config", lambda t: "[1, 2]"),
    ("data_order_rng", _cut_json),
    ("data_order_rng", lambda t: t.replace('"state"', '"stat"', 1)),
    ("data_order_rng", lambda t: t.replace("PCG64", "PCG6", 1)),
    ("data_order_rng", lambda t: "[]"),
    ("log_windows", _cut_json),
    ("log_windows", lambda t: "[[]]"),
    ("log_windows", lambda t: '[["x", 1]]'),
]


@pytest.mark.parametrize("prop, damage", DAMAGE, ids=[f"{p}-{i}" for i, (p, _) in enumerate(DAMAGE)])
def test_resume_names_the_damaged_file_and_property(trained, tmp_path, capsys, prop, damage):
    out = str(tmp_path / "run")
    shutil.copytree(trained, out)
    path = list_checkpoints(out)[-1][1]
    ckpt = load_checkpoint(path)
    before = ckpt.properties[prop]
    assert isinstance(before, str)
    json.loads(before)  # the property as written is JSON
    ckpt.properties[prop] = damage(before)
    save_checkpoint(ckpt, path)
    os.remove(path + ".sha256")  # (a checkpoint from before the sums: its properties are what is checked)
    code, line = _resume(out, capsys)
    assert code == 1, line
    assert path in line and "damaged" in line and repr(prop) in line, line
    assert sorted(os.listdir(os.path.dirname(path))) == [os.path.basename(path)]  # nothing new written


def test_resume_from_the_undamaged_copy_still_works(trained, tmp_path, capsys):
    out = str(tmp_path / "run")
    shutil.copytree(trained, out)
    code, line = _resume(out, capsys)
    assert code == 0, line
    assert list_checkpoints(out)[-1][0] == 4


@pytest.mark.parametrize("damage", [_cut_json, lambda t: "[1, 2]"], ids=["cut", "list"])
@pytest.mark.parametrize("command", ["eval", "export"])
def test_eval_and_export_use_the_weights_despite_a_damaged_config(trained, tmp_path, capsys, damage, command):
    """The saved config only serves eval's warning that the data keys changed since the run (export reads
    it not): the weights are still used, eval warning that the file's config cannot be read."""
    out = str(tmp_path / "run")
    shutil.copytree(trained, out)
    path = list_checkpoints(out)[-1][1]
    ckpt = load_checkpoint(path)
    ckpt.properties["config"] = damage(ckpt.properties["config"])
    save_checkpoint(ckpt, path)
    os.remove(path + ".sha256")  # (with its sum the checkpoint is refused as damaged before it is read)
    capsys.readouterr()
    extra = ["-o", str(tmp_path / "m.onnx")] if command == "export" else []
    code = main([command, config_path("digits_mlp"), "--checkpoint", path, *SETS[2:], *extra])
    err = capsys.readouterr().err
    assert code == 0, err
    if command == "eval":
        assert path in err and "config" in err and "damaged" in err, err
