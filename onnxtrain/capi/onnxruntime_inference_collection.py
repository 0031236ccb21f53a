"""onnxruntime's Python-side session module, where scripts import the session and value classes from
(``from onnxruntime.capi.onnxruntime_inference_collection import OrtValue``)."""

from onnxtrain.capi.ortvalue import IOBinding, OrtDevice, OrtValue
from onnxtrain.inference import InferenceSession

Session = InferenceSession  # onnxruntime's base class of its sessions: isinstance checks hold

__all__ = ["IOBinding", "InferenceSession", "OrtDevice", "OrtValue", "Session"]
