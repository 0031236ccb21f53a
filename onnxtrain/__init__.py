"""onnxtrain: train ONNX models with numpy.

The legacy onnxruntime training API (``TrainingSession``, ``TrainingParameters``), the inference
API (``InferenceSession``, ``OrtValue``, ``IOBinding``), and autodiff to standard ONNX
(``GradientGraphBuilder``).
"""

from onnxtrain.autodiff.legacy import GradientGraphBuilder
from onnxtrain.capi.options import (
    ExecutionMode,
    GraphOptimizationLevel,
    RunOptions,
    SessionOptions,
    get_all_providers,
    get_available_providers,
    get_device,
)
from onnxtrain.capi.ortvalue import IOBinding, OrtDevice, OrtValue
from onnxtrain.inference import InferenceSession, ModelMetadata, NodeArg
from onnxtrain.parameters import TrainingParameters
from onnxtrain.session import TrainingSession

__version__ = "0.1.0"

__all__ = [
    "ExecutionMode",
    "GradientGraphBuilder",
    "GraphOptimizationLevel",
    "IOBinding",
    "InferenceSession",
    "ModelMetadata",
    "NodeArg",
    "OrtDevice",
    "OrtValue",
    "RunOptions",
    "SessionOptions",
    "TrainingParameters",
    "TrainingSession",
    "get_all_providers",
    "get_available_providers",
    "get_device",
]
