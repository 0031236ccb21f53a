"""The numpy execution engine: compile an ONNX graph into a plan, run it many times.

The names below are imported on first use (PEP 562), so that importing a module of this package (the
onnxruntime backend's, say) does not load the numpy engine's plan and kernels.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "EngineError": "interface", "UnsupportedOpError": "interface", "load_model": "interface",
    "Plan": "plan", "compile_model": "plan",
    "Attrs": "registry", "available_ops": "registry", "find_kernel": "registry", "kernel": "registry",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
