"""Training-state checkpoints in onnxruntime-training's on-device format (``ODTC`` FlatBuffers).

Files move between onnxtrain and onnxruntime-training in both directions.
"""

from __future__ import annotations

from onnxtrain.checkpoint.format import (
    Checkpoint,
    OptimizerGroup,
    checkpoint_from_bytes,
    checkpoint_to_bytes,
    load_checkpoint,
    save_checkpoint,
    stage_checkpoint,
)

__all__ = [
    "Checkpoint", "OptimizerGroup", "checkpoint_from_bytes", "checkpoint_to_bytes", "load_checkpoint",
    "save_checkpoint", "stage_checkpoint",
]
