"""Loss blocks (``loss.loss`` holds them, where onnxruntime-training's scripts import them from)."""

from onnxtrain.training.onnxblock.loss.loss import BCEWithLogitsLoss, CrossEntropyLoss, L1Loss, MSELoss

__all__ = ["BCEWithLogitsLoss", "CrossEntropyLoss", "L1Loss", "MSELoss"]
