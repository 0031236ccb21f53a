"""onnxruntime-training's ``onnxruntime.training.amp``: the loss scalers of mixed-precision training
(:mod:`onnxtrain.graph_transforms.loss_scaler`), where a ported script imports them from."""

from onnxtrain.graph_transforms.loss_scaler import DynamicLossScaler, LossScaler

__all__ = ["DynamicLossScaler", "LossScaler"]
