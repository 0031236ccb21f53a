"""The names onnxruntime exposed in ``onnxruntime.capi._pybind_state``."""

from onnxtrain.autodiff.legacy import GradientGraphBuilder
from onnxtrain.capi.options import (
    ExecutionMode,
    GraphOptimizationLevel,
    PropagateCastOpsStrategy,
    RunOptions,
    SessionOptions,
    get_all_providers,
    get_available_providers,
    get_device,
)
from onnxtrain.capi.ortvalue import IOBinding, OrtDevice, OrtValue
from onnxtrain.errors import ORT_EXCEPTIONS

globals().update(ORT_EXCEPTIONS)  # Fail, InvalidArgument, ..., as onnxruntime registers them

__all__ = [
    *ORT_EXCEPTIONS,
    "ExecutionMode",
    "GradientGraphBuilder",
    "GraphOptimizationLevel",
    "IOBinding",
    "OrtDevice",
    "OrtValue",
    "PropagateCastOpsStrategy",
    "RunOptions",
    "SessionOptions",
    "get_all_providers",
    "get_available_providers",
    "get_device",
]


def __getattr__(name: str):  # the training session lives above this layer; import it lazily
    if name in ("TrainingSession", "TrainingParameters"):
        import onnxtrain

        return getattr(onnxtrain, name)
    raise AttributeError(name)
