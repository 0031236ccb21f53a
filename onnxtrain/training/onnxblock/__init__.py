"""Blocks that build ONNX graphs: losses, optimizers and the pieces to write a custom loss (spec §1.9).

Same surface as ``onnxruntime.training.onnxblock``: ``Block`` (subclass it, implement
``build(*input_names)``), ``blocks`` (elementwise, reductions, constants, inputs), ``loss``
(MSELoss, CrossEntropyLoss, BCEWithLogitsLoss, L1Loss), ``optim`` (AdamW, SGD, ClipGradNorm),
``TrainingBlock`` and ``ForwardBlock`` (whole models from the base: ``to_model_proto()``,
``parameters()``), the context managers ``base(model)`` / ``empty_base()`` / ``custom_op_library(path)``,
and ``save_checkpoint`` / ``load_checkpoint_to_model``. Every node is standard ONNX.
"""

from __future__ import annotations

# (_graph_utils and onnxblock: submodules a ported custom loss reaches as attributes, as onnxruntime's)
from onnxtrain.training.onnxblock import _graph_utils as _graph_utils
from onnxtrain.training.onnxblock import blocks, loss, optim
from onnxtrain.training.onnxblock import onnxblock as onnxblock
from onnxtrain.training.onnxblock.blocks import Block
from onnxtrain.training.onnxblock.checkpoint_utils import load_checkpoint_to_model, save_checkpoint
from onnxtrain.training.onnxblock.model_accessor import BlockError, base, custom_op_library, empty_base
from onnxtrain.training.onnxblock.model_blocks import ForwardBlock, TrainingBlock

__all__ = [
    "Block",
    "BlockError",
    "ForwardBlock",
    "TrainingBlock",
    "base",
    "blocks",
    "custom_op_library",
    "empty_base",
    "load_checkpoint_to_model",
    "loss",
    "optim",
    "save_checkpoint",
]
