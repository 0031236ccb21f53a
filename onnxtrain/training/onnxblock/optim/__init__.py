"""Optimizer blocks (``optim.optim`` holds them, where onnxruntime-training's scripts import them from)."""

from onnxtrain.training.onnxblock.optim.optim import (
    ALL_FINITE,
    SGD,
    AdamW,
    AdamWOptimizer,
    ClipGradNorm,
    Optimizer,
    SGDOptimizer,
)

__all__ = ["ALL_FINITE", "AdamW", "AdamWOptimizer", "ClipGradNorm", "Optimizer", "SGD", "SGDOptimizer"]
