"""The numpy execution engine: compile an ONNX graph into a plan, run it many times.

The names below are imported on first use (PEP 562), so that importing a module of this package (the
onnxruntime backend's, say) does not load the numpy engine's plan and kernels.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

_HOMES = {
    "EngineError": "interface", "UnsupportedOpError": "interface", "load_model": "interface",
    "Plan": "plan", "compile_model": "plan",
    "Attrs": "registry", "available_ops": "registry", "find_kernel": "registry", "kernel": "registry",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is not None:
        value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a submodule: onnxtrain.engine.plan
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
