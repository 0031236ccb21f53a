"""Reverse-mode autodiff on ONNX graphs, emitting standard ONNX."""

from onnxtrain.autodiff.builder import GradientError, build_gradient_model
from onnxtrain.autodiff.context import GradCtx
from onnxtrain.autodiff.registry import gradient, no_gradient, ops_with_rules

__all__ = ["GradCtx", "GradientError", "build_gradient_model", "gradient", "no_gradient", "ops_with_rules"]
