"""The names onnxruntime exposed in ``onnxruntime.capi._pybind_state``."""

from onnxtrain.autodiff.legacy import GradientGraphBuilder
from onnxtrain.capi.options import (
    ExecutionMode,
    ExecutionOrder,
    GraphOptimizationLevel,
    PropagateCastOpsStrategy,
    RunOptions,
    SessionOptions,
    get_all_providers,
    get_available_providers,
    get_device,
    get_version_string,
)
from onnxtrain.capi.ortvalue import IOBinding, OrtDevice, OrtValue, OrtValueVector
from onnxtrain.capi.runtime_info import (
    get_build_info,
    get_mpi_context_local_rank,
    get_mpi_context_local_size,
    get_mpi_context_world_rank,
    get_mpi_context_world_size,
    set_default_logger_severity,
    set_default_logger_verbosity,
)
from onnxtrain.errors import ORT_EXCEPTIONS

globals().update(ORT_EXCEPTIONS)  # Fail, InvalidArgument, ..., as onnxruntime registers them

__all__ = [
    *ORT_EXCEPTIONS,
    "ExecutionMode",
    "ExecutionOrder",
    "GradientGraphBuilder",
    "GraphOptimizationLevel",
    "IOBinding",
    "OrtDevice",
    "OrtValue",
    "OrtValueVector",
    "PropagateCastOpsStrategy",
    "RunOptions",
    "SessionOptions",
    "get_all_providers",
    "get_available_providers",
    "get_build_info",
    "get_device",
    "get_mpi_context_local_rank",
    "get_mpi_context_local_size",
    "get_mpi_context_world_rank",
    "get_mpi_context_world_size",
    "get_version_string",
    "set_default_logger_severity",
    "set_default_logger_verbosity",
]


def __getattr__(name: str):  # the training session lives above this layer; import it lazily
    if name in ("TrainingSession", "TrainingParameters"):
        import onnxtrain

        return getattr(onnxtrain, name)
    raise AttributeError(name)
