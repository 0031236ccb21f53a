"""onnxruntime's compiled module's name, where scripts import its exception classes from
(``from onnxruntime.capi.onnxruntime_pybind11_state import Fail``): the names of ``_pybind_state``."""

from onnxtrain.capi._pybind_state import *  # noqa: F403
from onnxtrain.capi._pybind_state import __all__ as __all__
from onnxtrain.capi._pybind_state import __getattr__ as __getattr__
