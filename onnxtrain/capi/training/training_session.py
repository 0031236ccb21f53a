"""``onnxruntime.capi.training.training_session``'s name for the legacy session."""

from onnxtrain.session import TrainingSession

__all__ = ["TrainingSession"]
