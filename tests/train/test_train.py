"""End-to-end ``onnxtrain train``: accuracy, the output folder, the export on onnxruntime, eval and export."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import onnx
import pytest

from onnxtrain.cli import main
from onnxtrain.data import load_digits
from onnxtrain.train import Trainer, load_config
from tests.train.conftest import config_path

ort = pytest.importorskip("onnxruntime")


def _records(folder: str) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _ort_accuracy(model_path: str, x: np.ndarray, y: np.ndarray) -> float:
    sess = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])
    logits = sess.run(None, {sess.get_inputs()[0].name: x})[0]
    return float(np.mean(logits.argmax(axis=1) == y))


def test_digits_mlp_as_shipped(tmp_path, capsys):
    """The README's first command: ≥ 95 % test accuracy well inside 2 minutes, and every output file."""
    out = str(tmp_path / "run")
    t0 = time.perf_counter()
    assert main(["train", config_path("digits_mlp"), "--output-dir", out, "--quiet"]) == 0
    seconds = time.perf_counter() - t0
    assert seconds < 120
    records = _records(out)
    evals = [r for r in records if "eval_accuracy" in r]
    assert evals and evals[-1]["eval_accuracy"] >= 0.95, evals[-1:]
    first_95 = next(r["step"] for r in evals if r["eval_accuracy"] >= 0.95)
    print(f"digits_mlp: {evals[-1]['eval_accuracy']:.4f} in {seconds:.1f} s (95 % first at step {first_95})")
    steps = [r for r in records if "loss" in r]
    assert all({"step", "loss", "lr"} <= r.keys() for r in steps)
    assert [r["step"] for r in steps] == sorted(r["step"] for r in steps)
    with open(os.path.join(out, "metrics.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(os.path.join(out, "checkpoints"))
    _, test = load_digits()
    assert _ort_accuracy(os.path.join(out, "model.onnx"), test.x, test.y) == evals[-1]["eval_accuracy"]
    assert "eval_accuracy 0.9" in capsys.readouterr().out


def test_digits_cnn_shortened_and_export_matches_onnxruntime(tmp_path):
    cfg = load_config(config_path("digits_cnn"), ["training.epochs=3", "training.eval_every=null"])
    result = Trainer(cfg, str(tmp_path), progress=False).run()
    assert result.metrics["eval_accuracy"] > 0.85
    model = onnx.load(result.exported)
    assert [i.name for i in model.graph.input] == ["x"] and [o.name for o in model.graph.output] == ["logits"]
    bn = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    assert bn and all(len(n.output) == 1 for n in bn)
    _, test = load_digits(images=True)
    assert _ort_accuracy(result.exported, test.x, test.y) == pytest.approx(result.metrics["eval_accuracy"],
                                                                          abs=1.5 / len(test.y))


def test_digits_stn_shortened_and_export_matches_onnxruntime(tmp_path):
    """The spatial transformer config (GridSample on a learned affine grid) trains, and its exported
    inference model gives onnxruntime the same accuracy."""
    cfg = load_config(config_path("digits_stn"), ["training.epochs=3", "training.eval_every=null"])
    result = Trainer(cfg, str(tmp_path), progress=False).run()
    assert result.metrics["eval_accuracy"] > 0.85
    model = onnx.load(result.exported)
    assert "GridSample" in {n.op_type for n in model.graph.node}
    _, test = load_digits(images=True)
    assert _ort_accuracy(result.exported, test.x, test.y) == pytest.approx(result.metrics["eval_accuracy"],
                                                                          abs=1.5 / len(test.y))


def test_eval_and_export_commands(tmp_path, capsys):
    out = str(tmp_path / "run")
    sets = ["--set", "training.epochs=2", "--set", "training.checkpoint_every=30"]
    assert main(["train", config_path("digits_mlp"), "--output-dir", out, "-q", *sets]) == 0
    last = [r for r in _records(out) if "eval_accuracy" in r][-1]
    capsys.readouterr()
    assert main(["eval", config_path("digits_mlp"), "--checkpoint", out, "--json", *sets]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert scores["eval_accuracy"] == last["eval_accuracy"]
    assert scores["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-6)
    exported = str(tmp_path / "exported.onnx")
    ckpts = sorted(f for f in os.listdir(os.path.join(out, "checkpoints")) if f.endswith(".ckpt"))
    assert len(ckpts) == 3  # keep_checkpoints
    ckpt = os.path.join(out, "checkpoints", ckpts[-1])
    assert main(["export", config_path("digits_mlp"), "--checkpoint", ckpt, "-o", exported]) == 0
    _, test = load_digits()
    assert _ort_accuracy(exported, test.x, test.y) == last["eval_accuracy"]
    assert main(["eval", config_path("digits_mlp"), "--checkpoint", str(tmp_path / "none")]) == 2
    assert "checkpoint not found" in capsys.readouterr().err


def test_tiny_transformer_learns_to_reverse(tmp_path):
    """The sequence task: > 90 % token accuracy (the shipped config runs 400 steps; 200 suffice)."""
    cfg = load_config(config_path("tiny_transformer"), ["training.steps=200", "training.eval_every=100",
                                                        "data.train_size=5000"])
    t0 = time.perf_counter()
    result = Trainer(cfg, str(tmp_path), progress=False).run()
    acc = result.metrics["eval_accuracy"]
    print(f"tiny_transformer: token accuracy {acc:.4f} after 200 steps in {time.perf_counter() - t0:.1f} s")
    assert acc > 0.9
    sess = ort.InferenceSession(result.exported, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(123).integers(0, 10, (200, 8))
    logits = sess.run(None, {"x": x})[0]
    assert logits.shape == (200, 10, 8)
    assert np.mean(logits.argmax(1) == x[:, ::-1]) > 0.9


def test_refused_session_option_names_its_config_key(tmp_path, capsys):
    """Options the session refuses (here data parallelism outside mpirun) come back as the config key."""
    code = main(["train", config_path("digits_mlp"), "--output-dir", str(tmp_path), "-q", "--set",
                 "training.data_parallel_size=2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "training.data_parallel_size: " in err[0]


def test_own_data_example(tmp_path, capsys):
    import importlib.util

    from tests.train.conftest import REPO

    path = os.path.join(REPO, "examples", "train_your_own_data.py")
    spec = importlib.util.spec_from_file_location("own", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(str(tmp_path)) > 0.9
