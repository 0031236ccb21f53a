"""`onnxtrain artifacts` writes the on-device artifacts from the command line."""

from __future__ import annotations

import os
import subprocess
import sys

import onnx

from onnxtrain.zoo import mlp


def test_artifacts_command(tmp_path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(mlp([8, 16, 4], loss=False), str(path))
    out = tmp_path / "art"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "onnxtrain",
            "artifacts",
            str(path),
            "-o",
            str(out),
            "--loss",
            "CrossEntropyLoss",
            "--optimizer",
            "AdamW",
            "--frozen",
            "fc0.bias",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    names = set(os.listdir(out))
    assert {"training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint"} <= names
    for n in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        onnx.checker.check_model(onnx.load(str(out / n)), full_check=True)
    from onnxtrain.checkpoint import load_checkpoint

    ck = load_checkpoint(str(out / "checkpoint"))
    assert "fc0.bias" in ck.frozen and "fc0.weight" in ck.trainable
    r = subprocess.run(
        [sys.executable, "-m", "onnxtrain", "artifacts", "--help"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and "--optimizer" in r.stdout


def test_artifacts_command_with_transforms(tmp_path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(mlp([8, 16, 4], loss=False), str(path))
    out = tmp_path / "art"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "onnxtrain",
            "artifacts",
            str(path),
            "-o",
            str(out),
            "--loss",
            "CrossEntropyLoss",
            "--optimizer",
            "AdamW",
            "--mixed-precision",
            "float16",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    names = [i.name for i in onnx.load(str(out / "training_model.onnx")).graph.input]
    assert "loss_scale" in names
    r = subprocess.run(
        [sys.executable, "-m", "onnxtrain", "artifacts", str(path), "-o", str(out), "--recompute", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "nope" in r.stderr
