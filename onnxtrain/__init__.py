"""onnxtrain: train ONNX models with numpy."""

__version__ = "0.1.0"
