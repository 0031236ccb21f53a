"""The translated artifacts written to a folder."""

from __future__ import annotations

import os
import shutil
from typing import IO

import onnx

from onnxtrain.ir.graphs import eval_batch_norms, inference_batch_norms
from onnxtrain.training.ort_artifacts.optimizer import translate_optimizer_model
from onnxtrain.training.ort_artifacts.training_model import translate_training_model


def convert_artifacts(
    artifact_directory: str | os.PathLike, output_directory: str | os.PathLike, prefix: str = ""
) -> list[str]:
    """Write the standard-ONNX translation of onnxruntime-training's artifacts in ``artifact_directory``
    (``<prefix>training_model.onnx``, and ``<prefix>eval_model.onnx``, ``<prefix>optimizer_model.onnx``,
    ``<prefix>checkpoint``, ``<prefix>nominal_checkpoint`` when present, the names its generator writes) to
    ``output_directory``; returns the paths written. Checkpoints are copied as they are, with their
    ``.data`` files (onnxtrain reads onnxruntime-training's checkpoints). Every file goes to a temporary
    first and all are renamed at the end, so an error leaves the output folder's earlier files whole."""
    from onnxtrain.ir.io import StagedFiles

    src, dst = os.fspath(artifact_directory), os.fspath(output_directory)
    train_path = os.path.join(src, f"{prefix}training_model.onnx")
    if not os.path.exists(train_path):
        raise FileNotFoundError(f"{train_path}: no training model in {src}")
    os.makedirs(dst, exist_ok=True)
    training = translate_training_model(onnx.load(train_path))
    with StagedFiles() as files:
        files.save_model(training, os.path.join(dst, f"{prefix}training_model.onnx"))
        for name in ("eval_model.onnx", "optimizer_model.onnx"):
            path = os.path.join(src, f"{prefix}{name}")
            if os.path.exists(path):
                model = onnx.load(path)
                # an eval model of a model exported in training mode keeps its BatchNorms' running-statistics
                # outputs: below opset 14 they make the node a training one (put in inference mode, as
                # Module's eval runs it), from 14 ONNX's checker and onnxruntime refuse them unread
                out = (translate_optimizer_model(model, training) if name.startswith("optimizer")
                       else inference_batch_norms(eval_batch_norms(translate_training_model(model))))
                files.save_model(out, os.path.join(dst, f"{prefix}{name}"))
        for name in ("checkpoint", "nominal_checkpoint"):
            for suffix in (".data", ""):  # the data file renamed before the main file that refers to it
                path = os.path.join(src, f"{prefix}{name}{suffix}")
                target = os.path.join(dst, f"{prefix}{name}{suffix}")
                if os.path.isfile(path) and os.path.abspath(path) != os.path.abspath(target):
                    files.write(target, lambda f, p=path: _copy_into(p, f))
        written = files.targets
    return written


def _copy_into(path: str, f: IO[bytes]) -> None:
    with open(path, "rb") as source:
        shutil.copyfileobj(source, f)
