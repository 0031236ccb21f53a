"""Where onnxruntime kept its Python wrapper of the legacy session (``onnxruntime.capi.training``)."""
