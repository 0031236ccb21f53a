"""The numpy execution engine: compile an ONNX graph into a plan, run it many times.

The names below and the submodules are imported on first use (PEP 562), so that importing a module of this
package (the onnxruntime backend's, say) does not load the numpy engine's plan and kernels.
"""

from __future__ import annotations

from onnxtrain import _lazy_attributes

_HOMES = {
    **dict.fromkeys(("EngineError", "UnsupportedOpError", "load_model"), "onnxtrain.engine.interface"),
    **dict.fromkeys(("Plan", "compile_model"), "onnxtrain.engine.plan"),
    **dict.fromkeys(("Attrs", "available_ops", "find_kernel", "kernel"), "onnxtrain.engine.registry"),
}
__all__ = sorted(_HOMES)
__getattr__, __dir__ = _lazy_attributes(__name__, _HOMES, globals())
