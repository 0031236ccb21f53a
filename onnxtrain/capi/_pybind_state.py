"""The names onnxruntime exposed in ``onnxruntime.capi._pybind_state``."""

from typing import Any

from onnxtrain.autodiff.legacy import GradientGraphBuilder
from onnxtrain.autodiff.registry import register_custom_stop_gradient_edges
from onnxtrain.capi.allocators import (
    OrtAllocatorType,
    OrtArenaCfg,
    OrtMemoryInfo,
    OrtMemType,
    create_and_register_allocator,
)
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
    disable_telemetry_events,
    enable_telemetry_events,
    get_build_info,
    get_mpi_context_local_rank,
    get_mpi_context_local_size,
    get_mpi_context_world_rank,
    get_mpi_context_world_size,
    has_collective_ops,
    set_default_logger_callback,
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
    "OrtAllocatorType",
    "OrtArenaCfg",
    "OrtDevice",
    "OrtMemType",
    "OrtMemoryInfo",
    "OrtValue",
    "OrtValueVector",
    "PropagateCastOpsStrategy",
    "RunOptions",
    "SessionOptions",
    "create_and_register_allocator",
    "disable_telemetry_events",
    "enable_telemetry_events",
    "get_all_providers",
    "get_available_providers",
    "get_build_info",
    "get_default_session_options",
    "get_device",
    "get_mpi_context_local_rank",
    "get_mpi_context_local_size",
    "get_mpi_context_world_rank",
    "get_mpi_context_world_size",
    "get_version_string",
    "has_collective_ops",
    "is_dlpack_uint8_tensor",
    "register_custom_stop_gradient_edges",
    "set_default_logger_callback",
    "set_default_logger_severity",
    "set_default_logger_verbosity",
    "set_seed",
]


def is_dlpack_uint8_tensor(dlpack: Any) -> bool:
    """Whether the DLPack capsule ``dlpack`` (not yet consumed) holds uint8 values, read from its DLTensor
    without consuming it, as onnxruntime's function of that name (bool tensors travel as uint8)."""
    import ctypes

    # private prototypes: setting restype/argtypes on ctypes.pythonapi's functions would change them for
    # every other user in the process
    get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
        ("PyCapsule_GetPointer", ctypes.pythonapi))
    valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
        ("PyCapsule_IsValid", ctypes.pythonapi))
    if not valid(dlpack, b"dltensor"):
        raise TypeError("is_dlpack_uint8_tensor takes a DLPack capsule that has not been consumed")
    # DLTensor: data (a pointer), device (two int32), ndim (int32), then dtype: code (uint8), bits (uint8)
    code, bits = (ctypes.c_uint8 * 2).from_address(get_pointer(dlpack, b"dltensor") + 20)
    return code == 1 and bits == 8  # kDLUInt, 8 bits


def get_default_session_options() -> SessionOptions:
    """A SessionOptions with onnxruntime's defaults."""
    return SessionOptions()


def set_seed(seed: int) -> None:
    """:func:`onnxtrain.set_seed`."""
    import onnxtrain

    onnxtrain.set_seed(seed)


def __getattr__(name: str):  # the sessions live above this layer; import them lazily
    if name in ("TrainingSession", "TrainingParameters", "InferenceSession", "NodeArg", "ModelMetadata"):
        import onnxtrain

        return getattr(onnxtrain, name)
    raise AttributeError(name)
