"""Optimizer update graphs (standard ONNX) for the legacy session, selected by name."""

from __future__ import annotations

import numpy as np

from onnxtrain.optim.adam import Adam
from onnxtrain.optim.base import Optimizer, StateSpec, WeightSlot
from onnxtrain.optim.lamb import Lamb
from onnxtrain.optim.sgd import SGD

OPTIMIZERS: dict[str, type[Optimizer]] = {"SGDOptimizer": SGD, "AdamOptimizer": Adam, "LambOptimizer": Lamb}


def get_optimizer(name: str, fp16_moments: bool = False) -> Optimizer:
    """The optimizer registered as ``name`` (SGDOptimizer, AdamOptimizer, LambOptimizer); with
    ``fp16_moments`` its moments (Adam's and Lamb's) are kept in float16."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown training_optimizer_name {name!r}; valid names: {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name](np.float16 if fp16_moments else np.float32)


__all__ = ["OPTIMIZERS", "Optimizer", "StateSpec", "WeightSlot", "get_optimizer"]
