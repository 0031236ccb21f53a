"""onnxtrain: train ONNX models with numpy.

The legacy onnxruntime training API (``TrainingSession``, ``TrainingParameters``), the inference
API (``InferenceSession``, ``OrtValue``, ``IOBinding``), and autodiff to standard ONNX
(``GradientGraphBuilder``).
"""

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from onnxtrain.autodiff.legacy import GradientGraphBuilder
    from onnxtrain.capi.allocators import (
        OrtAllocatorType,
        OrtArenaCfg,
        OrtDeviceMemoryType,
        OrtMemoryInfo,
        OrtMemoryInfoDeviceType,
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
    from onnxtrain.capi.ortvalue import IOBinding, OrtDevice, OrtValue
    from onnxtrain.capi.runtime_info import (
        disable_telemetry_events,
        enable_telemetry_events,
        get_build_info,
        has_collective_ops,
        set_default_logger_callback,
        set_default_logger_severity,
        set_default_logger_verbosity,
    )
    from onnxtrain.capi.sparse_tensor import OrtSparseFormat, SparseTensor
    from onnxtrain.inference import InferenceSession, ModelMetadata, NodeArg
    from onnxtrain.parameters import TrainingParameters
    from onnxtrain.session import TrainingSession

# public name -> its module, imported on first use (PEP 562): ``import onnxtrain`` stays cheap, and the
# on-device API does not load the legacy session, its transforms and its optimizers (1.1 MiB of peak RSS
# in the bench's LeNet run on the onnxruntime backend)
_LAZY = {
    "GradientGraphBuilder": "onnxtrain.autodiff.legacy",
    **dict.fromkeys(("ExecutionMode", "ExecutionOrder", "GraphOptimizationLevel", "PropagateCastOpsStrategy",
                     "RunOptions", "SessionOptions", "get_all_providers", "get_available_providers",
                     "get_device", "get_version_string"),
                    "onnxtrain.capi.options"),
    **dict.fromkeys(("IOBinding", "OrtDevice", "OrtValue"), "onnxtrain.capi.ortvalue"),
    **dict.fromkeys(("OrtSparseFormat", "SparseTensor"), "onnxtrain.capi.sparse_tensor"),
    **dict.fromkeys(("OrtAllocatorType", "OrtArenaCfg", "OrtDeviceMemoryType", "OrtMemType",
                     "OrtMemoryInfo", "OrtMemoryInfoDeviceType", "create_and_register_allocator"),
                    "onnxtrain.capi.allocators"),
    **dict.fromkeys(("disable_telemetry_events", "enable_telemetry_events", "get_build_info",
                     "has_collective_ops", "set_default_logger_callback", "set_default_logger_severity",
                     "set_default_logger_verbosity"),
                    "onnxtrain.capi.runtime_info"),
    **dict.fromkeys(("InferenceSession", "ModelMetadata", "NodeArg"), "onnxtrain.inference"),
    "TrainingParameters": "onnxtrain.parameters",
    "TrainingSession": "onnxtrain.session",
}

__version__ = "0.1.0"


def set_seed(seed: int) -> None:
    """Seed the random draws of nodes without a ``seed`` attribute (Dropout, RandomNormal(Like),
    RandomUniform(Like), Bernoulli, Multinomial), as ``onnxruntime.set_seed`` does: the same graphs run in
    the same order then draw the same values."""
    import numbers

    from onnxtrain.engine.seeds import set_random_seed

    if not isinstance(seed, numbers.Integral):  # (a bool is one, as onnxruntime takes it)
        raise TypeError(f"set_seed: the seed must be an int, got {type(seed).__name__}")
    if not -(2**63) <= int(seed) < 2**63:  # onnxruntime's int64
        raise TypeError(f"set_seed: the seed must fit in an int64, got {int(seed)}")
    set_random_seed(int(seed) % 2**64)

__all__ = [
    "ExecutionMode",
    "ExecutionOrder",
    "GradientGraphBuilder",
    "GraphOptimizationLevel",
    "IOBinding",
    "InferenceSession",
    "ModelMetadata",
    "NodeArg",
    "OrtAllocatorType",
    "OrtArenaCfg",
    "OrtDevice",
    "OrtDeviceMemoryType",
    "OrtMemType",
    "OrtMemoryInfo",
    "OrtMemoryInfoDeviceType",
    "OrtSparseFormat",
    "OrtValue",
    "PropagateCastOpsStrategy",
    "RunOptions",
    "SessionOptions",
    "SparseTensor",
    "TrainingParameters",
    "TrainingSession",
    "create_and_register_allocator",
    "disable_telemetry_events",
    "enable_telemetry_events",
    "get_all_providers",
    "get_available_providers",
    "get_build_info",
    "get_device",
    "get_version_string",
    "has_collective_ops",
    "set_default_logger_callback",
    "set_default_logger_severity",
    "set_default_logger_verbosity",
    "set_seed",
]


def _lazy_attributes(package: str, homes: Mapping[str, str], namespace: dict[str, Any]
                    ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` (PEP 562): a name of ``homes`` (name → its module) or a
    submodule (``onnxtrain.training``) is imported on first use and kept in ``namespace``, the package's
    globals. (Here, not in a module of its own, so that ``import onnxtrain`` loads one module.)"""

    def __getattr__(name: str) -> Any:
        module = homes.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
        elif not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(homes))

    return __getattr__, __dir__


__getattr__, __dir__ = _lazy_attributes(__name__, _LAZY, globals())
