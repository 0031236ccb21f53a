"""`onnxtrain artifacts` writes the on-device artifacts from the command line."""

from __future__ import annotations

import os
import subprocess
import sys

import onnx

from onnxtrain.zoo import mlp


def onnxtrain_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "onnxtrain", *args], capture_output=True, text=True, timeout=120
    )


def artifacts(tmp_path, *options: str) -> tuple[subprocess.CompletedProcess, object]:
    """``onnxtrain artifacts`` on a small MLP with ``options``; returns the result and the output folder."""
    path = tmp_path / "m.onnx"
    onnx.save(mlp([8, 16, 4], loss=False), str(path))
    out = tmp_path / "art"
    return onnxtrain_cli("artifacts", str(path), "-o", str(out), *options), out


def test_artifacts_command(tmp_path) -> None:
    r, out = artifacts(tmp_path, "--loss", "CrossEntropyLoss", "--optimizer", "AdamW", "--frozen", "fc0.bias")
    assert r.returncode == 0, r.stderr
    names = set(os.listdir(out))
    assert {"training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint"} <= names
    for n in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        onnx.checker.check_model(onnx.load(str(out / n)), full_check=True)
    from onnxtrain.checkpoint import load_checkpoint

    ck = load_checkpoint(str(out / "checkpoint"))
    assert "fc0.bias" in ck.frozen and "fc0.weight" in ck.trainable
    r = onnxtrain_cli("artifacts", "--help")
    assert r.returncode == 0 and "--optimizer" in r.stdout


def test_artifacts_command_with_transforms(tmp_path) -> None:
    r, out = artifacts(
        tmp_path, "--loss", "CrossEntropyLoss", "--optimizer", "AdamW", "--mixed-precision", "float16"
    )
    assert r.returncode == 0, r.stderr
    names = [i.name for i in onnx.load(str(out / "training_model.onnx")).graph.input]
    assert "loss_scale" in names
    r, _ = artifacts(tmp_path, "--recompute", "nope")
    assert r.returncode != 0 and "nope" in r.stderr
