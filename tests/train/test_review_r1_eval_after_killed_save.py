"""Review R1 of 10c1ea08 (train --resume after a kill between a checkpoint's renames): the same fault on the
other commands that read a run folder's latest checkpoint, ``eval`` and ``export``. After such a kill the new
``step_<N>.ckpt`` is in place (its ``.sha256`` still a temporary, the commit's journal beside it); the
commands chose it as the latest, and its load put the folder back as it was before that save, deleting it:
'Checkpoint file not found' (exit 1), though the checkpoint before it was whole. They must use that one.

Oracles: the eval metrics computed with numpy from the weights of the checkpoint before the killed save (the
MLP 64-16-10: ReLU, softmax cross-entropy, on the config's eval data), and the exported model run by
onnxruntime 1.32 against the same numpy forward."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnxruntime as ort

from onnxtrain.checkpoint import load_checkpoint
from onnxtrain.cli import main
from onnxtrain.train import data as data_mod
from onnxtrain.train import load_config
from tests.train.conftest import REPO, config_path
from tests.train.test_review_h_kill_in_commit import _CHILD, KILLED_AT, SETS

SIZES = "model.args.sizes=[64,16,10]"  # (one of SETS: the checkpoint's model)


def _killed_run(tmp_path) -> tuple[str, dict[str, np.ndarray]]:
    """A run folder whose save of step KILLED_AT was killed between its renames, and the weights of the
    checkpoint before it (read before any command touches the folder)."""
    killed = str(tmp_path / "killed")
    proc = subprocess.run([sys.executable, "-c", _CHILD, killed, config_path("digits_mlp"), str(KILLED_AT),
                           *SETS], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    names = os.listdir(os.path.join(killed, "checkpoints"))
    assert f"step_{KILLED_AT:08d}.ckpt" in names and any(n.endswith(".journal.tmp") for n in names), names
    before = os.path.join(killed, "checkpoints", f"step_{KILLED_AT - 2:08d}.ckpt")
    return killed, dict(load_checkpoint(before).trainable)


def _logits(w: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    h = np.maximum(x @ w["fc0.weight"].T.astype(np.float64) + w["fc0.bias"], 0)
    return h @ w["fc1.weight"].T.astype(np.float64) + w["fc1.bias"]


def test_eval_of_a_run_folder_after_a_kill_between_a_checkpoints_renames(tmp_path, capsys) -> None:
    killed, weights = _killed_run(tmp_path)
    capsys.readouterr()
    code = main(["eval", config_path("digits_mlp"), "--set", SIZES, "--checkpoint", killed, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    got = json.loads(out.strip().splitlines()[-1])
    ev = data_mod.load_data(load_config(config_path("digits_mlp"), [SIZES])).eval
    logits = _logits(weights, ev["x"])
    z = logits - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    labels = ev["y"].astype(np.int64)
    np.testing.assert_allclose(got["eval_loss"], -logp[np.arange(len(labels)), labels].mean(), rtol=1e-5)
    assert got["eval_accuracy"] == float(np.mean(logits.argmax(axis=1) == labels))
    assert f"step_{KILLED_AT:08d}.ckpt" in err  # (the killed save is named, and passed over)


def test_export_of_a_run_folder_after_a_kill_between_a_checkpoints_renames(tmp_path, capsys) -> None:
    killed, weights = _killed_run(tmp_path)
    target = str(tmp_path / "model.onnx")
    code = main(["export", config_path("digits_mlp"), "--set", SIZES, "--checkpoint", killed, "-o", target])
    err = capsys.readouterr().err
    assert code == 0, err
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    sess = ort.InferenceSession(target, providers=["CPUExecutionProvider"])
    got, = sess.run(None, {sess.get_inputs()[0].name: x})
    np.testing.assert_allclose(got, _logits(weights, x), rtol=1e-5, atol=1e-5)
