"""onnxtrain: train ONNX models with numpy.

The legacy onnxruntime training API (``TrainingSession``, ``TrainingParameters``), the inference
API (``InferenceSession``, ``OrtValue``, ``IOBinding``), and autodiff to standard ONNX
(``GradientGraphBuilder``).
"""

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
from onnxtrain.inference import InferenceSession, ModelMetadata, NodeArg
from onnxtrain.parameters import TrainingParameters
from onnxtrain.session import TrainingSession

__version__ = "0.1.0"


def set_seed(seed: int) -> None:
    """Seed the random draws of nodes without a ``seed`` attribute (Dropout, RandomNormal(Like),
    RandomUniform(Like), Bernoulli, Multinomial), as ``onnxruntime.set_seed`` does: the same graphs run in
    the same order then draw the same values."""
    import numbers

    from onnxtrain.engine.kernels.random import set_random_seed

    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"set_seed: the seed must be an int, got {type(seed).__name__}")
    set_random_seed(int(seed) % 2**64)

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
    "PropagateCastOpsStrategy",
    "RunOptions",
    "SessionOptions",
    "TrainingParameters",
    "TrainingSession",
    "get_all_providers",
    "get_available_providers",
    "get_device",
    "set_seed",
]
