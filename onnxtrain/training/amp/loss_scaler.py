"""``onnxruntime.training.amp.loss_scaler``: the same classes as :mod:`onnxtrain.training.amp`."""

from onnxtrain.graph_transforms.loss_scaler import DynamicLossScaler, LossScaler

__all__ = ["DynamicLossScaler", "LossScaler"]
