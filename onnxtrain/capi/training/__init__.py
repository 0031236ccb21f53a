"""Where onnxruntime kept its Python wrapper of the legacy session (``onnxruntime.capi.training``): both of
its names import from here, as there."""

from onnxtrain.capi.training.training_session import TrainingSession
from onnxtrain.parameters import TrainingParameters

__all__ = ["TrainingParameters", "TrainingSession"]
