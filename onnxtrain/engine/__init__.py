"""The numpy execution engine: compile an ONNX graph into a plan, run it many times."""

from onnxtrain.engine.plan import EngineError, Plan, UnsupportedOpError, compile_model, load_model
from onnxtrain.engine.registry import Attrs, available_ops, find_kernel, kernel

__all__ = ["Attrs", "EngineError", "Plan", "UnsupportedOpError", "available_ops", "compile_model",
           "find_kernel", "kernel", "load_model"]
