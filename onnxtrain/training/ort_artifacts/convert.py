"""The translated artifacts written to a folder."""

from __future__ import annotations

import os
import shutil

import onnx

from onnxtrain.training.ort_artifacts.optimizer import translate_optimizer_model
from onnxtrain.training.ort_artifacts.training_model import translate_training_model


def convert_artifacts(
    artifact_directory: str | os.PathLike, output_directory: str | os.PathLike, prefix: str = ""
) -> list[str]:
    """Write the standard-ONNX translation of onnxruntime-training's artifacts in ``artifact_directory``
    (``<prefix>training_model.onnx``, and ``eval_model.onnx``, ``optimizer_model.onnx``, ``checkpoint``
    when present) to ``output_directory``; returns the paths written. The checkpoint is copied as is
    (onnxtrain reads onnxruntime-training's checkpoints)."""
    from onnxtrain.ir.io import save_model_atomic

    src, dst = os.fspath(artifact_directory), os.fspath(output_directory)
    train_path = os.path.join(src, f"{prefix}training_model.onnx")
    if not os.path.exists(train_path):
        raise FileNotFoundError(f"{train_path}: no training model in {src}")
    os.makedirs(dst, exist_ok=True)
    training = translate_training_model(onnx.load(train_path))
    written = []

    def save(model: onnx.ModelProto, name: str) -> None:
        path = os.path.join(dst, f"{prefix}{name}")
        save_model_atomic(model, path)
        written.append(path)

    save(training, "training_model.onnx")
    for name in ("eval_model.onnx", "optimizer_model.onnx"):
        path = os.path.join(src, f"{prefix}{name}")
        if os.path.exists(path):
            model = onnx.load(path)
            save(
                translate_optimizer_model(model, training)
                if name.startswith("optimizer")
                else translate_training_model(model),
                name,
            )
    for name in ("checkpoint", "nominal_checkpoint"):
        path = os.path.join(src, name)
        if os.path.isfile(path) and os.path.abspath(path) != os.path.abspath(os.path.join(dst, name)):
            tmp = os.path.join(dst, f".{name}.tmp")
            shutil.copyfile(path, tmp)
            os.replace(tmp, os.path.join(dst, name))
            written.append(os.path.join(dst, name))
    return written
