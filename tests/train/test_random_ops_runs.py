"""Random ops without a ``seed`` attribute under ``onnxtrain train``: two runs of one config draw the same
values on either backend, and a --resume that cannot redraw them (onnxruntime's generators, nodes with a
``seed`` attribute) says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxtrain import zoo
from onnxtrain.checkpoint import load_checkpoint
from onnxtrain.train import Trainer, load_config
from onnxtrain.train.outputs import list_checkpoints
from tests.train.conftest import REPO
from tests.train.test_resume import _interrupt_after_first_save


def _noisy_mlp(path: str, seed: int | None = None) -> str:
    """zoo.mlp with Gaussian noise (RandomNormalLike, scale 0.5) added after the first ReLU."""
    model = zoo.mlp([64, 32, 10])
    g = model.graph
    at = next(i for i, n in enumerate(g.node) if n.output[0] == "h0_relu") + 1
    extra = {} if seed is None else {"seed": float(seed)}
    g.node.insert(at, helper.make_node("RandomNormalLike", ["h0_relu"], ["noise"], name="noise", scale=0.5,
                                       **extra))
    g.node.insert(at + 1, helper.make_node("Add", ["h0_relu", "noise"], ["h0_noisy"], name="noisy"))
    for n in g.node[at + 2:]:
        n.input[:] = ["h0_noisy" if i == "h0_relu" else i for i in n.input]
    onnx.save(model, path)
    return path


def _weights(folder: str) -> dict[str, np.ndarray]:
    return load_checkpoint(list_checkpoints(folder)[-1][1]).trainable


def _config(write_config, backend: str) -> str:
    return write_config({"model": {"path": "noisy.onnx"}, "training": {
        "steps": 12, "checkpoint_every": 6, "eval_every": 1000, "keep_checkpoints": 0, "backend": backend},
        "output": {"plot": False, "export": False}})


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_two_runs_of_a_config_draw_the_same_noise(tmp_path, write_config, backend):
    """onnxruntime seeds its random nodes when their session is built, which the trainer did before it
    seeded anything: two runs of one config (each in a fresh process) trained on different noise (weights
    1e-2 apart in 12 steps)."""
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    _noisy_mlp(str(tmp_path / "noisy.onnx"))
    cfg = _config(write_config, backend)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for out in (a, b):
        done = subprocess.run([sys.executable, "-m", "onnxtrain", "train", cfg, "--output-dir", out, "-q"],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    wa, wb = _weights(a), _weights(b)
    for k in wa:
        np.testing.assert_array_equal(wa[k], wb[k], err_msg=k)


@pytest.mark.parametrize("backend, seed, warned", [
    ("numpy", None, False), ("onnxruntime", None, True), ("numpy", 3, True)])
def test_resume_says_when_random_nodes_cannot_draw_as_before(tmp_path, write_config, monkeypatch, capsys,
                                                             backend, seed, warned):
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    _noisy_mlp(str(tmp_path / "noisy.onnx"), seed)
    cfg = _config(write_config, backend)
    whole, halves = str(tmp_path / "whole"), str(tmp_path / "halves")
    Trainer(load_config(cfg), whole, progress=False).run()
    _interrupt_after_first_save(monkeypatch)
    assert Trainer(load_config(cfg), halves, progress=False).run().global_step == 6
    monkeypatch.undo()
    capsys.readouterr()
    Trainer(load_config(cfg), halves, progress=False).run(resume=True)
    err = capsys.readouterr().err
    same = all(np.array_equal(v, _weights(halves)[k]) for k, v in _weights(whole).items())
    if warned:
        assert "warning: the random node 'noise' (RandomNormalLike)" in err, err
        assert not same  # the warning is true: the resumed run drew other noise
    else:
        assert "warning" not in err, err
        assert same


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_eval_of_a_model_that_draws_at_inference_repeats(tmp_path, write_config, backend):
    """Random ops that eval mode keeps (here Gaussian noise; torch exports Dropout2d so) drew from fresh
    entropy in `onnxtrain eval`: two evals of one checkpoint differed (eval loss 2.40 and 2.37), and neither
    was the run's own final eval. Evals now draw from training.seed: `onnxtrain eval` repeats, and on the
    numpy engine it equals the run's last eval."""
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    _noisy_mlp(str(tmp_path / "noisy.onnx"))
    cfg = _config(write_config, backend)
    out = str(tmp_path / "run")
    Trainer(load_config(cfg), out, progress=False).run()
    with open(os.path.join(out, "metrics.jsonl")) as f:
        last = [r for r in map(json.loads, f) if "eval_loss" in r][-1]
    scores = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "onnxtrain", "eval", cfg, "--checkpoint", out, "--json"],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        scores.append(json.loads(done.stdout))
    assert scores[0] == scores[1]
    if backend == "numpy":
        assert scores[0] == {k: v for k, v in last.items() if k.startswith("eval_")}
