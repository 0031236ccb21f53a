"""onnxruntime-style import locations (``onnxtrain.capi._pybind_state``)."""
