"""Checkpoint helpers of onnxblock (spec §1.9): write parameters as a checkpoint, load one into a model."""

from __future__ import annotations

import os
from collections.abc import Sequence

import onnx
from onnx import numpy_helper

from onnxtrain.checkpoint import Checkpoint, load_checkpoint
from onnxtrain.checkpoint import save_checkpoint as _save
from onnxtrain.errors import raises_as_onnxruntime
from onnxtrain.training.onnxblock.model_accessor import BlockError


@raises_as_onnxruntime
def save_checkpoint(
    parameters: tuple[Sequence[onnx.TensorProto], Sequence[onnx.TensorProto]],
    path_to_checkpoint: str | bytes | os.PathLike,
    nominal_checkpoint: bool = False,
) -> None:
    """Write ``(trainable, frozen)`` TensorProto lists as an onnxruntime-training checkpoint.

    The parameters keep the order of the lists, as onnxruntime-training's ``onnxblock.save_checkpoint``
    writes them (it sorts nothing; only ``CheckpointState.save_checkpoint`` writes names sorted)."""
    if not isinstance(parameters, (tuple, list)) or len(parameters) != 2:
        raise BlockError("parameters must be a pair (trainable TensorProtos, frozen TensorProtos)")
    for group in parameters:
        names = [t.name for t in group]
        if len(set(names)) < len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise BlockError(f"Duplicated tensor proto named {twice!r}: a checkpoint holds one value per "
                             "parameter name")
    trainable, frozen = ({t.name: numpy_helper.to_array(t) for t in group} for group in parameters)
    path = os.fsdecode(path_to_checkpoint)  # (bytes: the file's name, as onnxruntime-training reads them)
    _save(Checkpoint(trainable, frozen, [], {}, nominal=bool(nominal_checkpoint)), path,
          sort_parameters=False)


@raises_as_onnxruntime
def load_checkpoint_to_model(path_to_checkpoint: str | bytes | os.PathLike, model: onnx.ModelProto) -> None:
    """Copy the checkpoint's parameter values into ``model``'s initializers of the same names, in place.

    A checkpoint that cannot be read (missing, damaged, a folder) is a RuntimeError too, as it is in
    onnxruntime-training's binding."""
    path_to_checkpoint = os.fsdecode(path_to_checkpoint)  # (bytes: the file's name, as onnxruntime-training)
    ckpt = load_checkpoint(path_to_checkpoint)
    if ckpt.nominal:
        raise BlockError(f"Cannot load a nominal checkpoint to a model proto: {path_to_checkpoint}")
    values = {**ckpt.trainable, **ckpt.frozen}
    for t in model.graph.initializer:
        if t.name in values:
            t.CopyFrom(numpy_helper.from_array(values[t.name], t.name))
