"""ORT_LOAD_CONFIG_FROM_MODEL, onnxruntime's switch for taking session options from a model's metadata
entry ``ort_config``: its value checked, and the warnings of the sessions that do not apply it (kept apart
from :mod:`onnxtrain.inference` so that the on-device API reads it without loading the inference session)."""

from __future__ import annotations

import os

import onnx

from onnxtrain.errors import FailValueError
from onnxtrain.user_warning import warn


def model_config_asked() -> bool:
    """Whether the environment variable ORT_LOAD_CONFIG_FROM_MODEL asks sessions to take the options of a
    model's ``ort_config``: "1"; unset, empty or "0" do not, and another value is refused, as onnxruntime
    refuses to make any session then."""
    value = os.environ.get("ORT_LOAD_CONFIG_FROM_MODEL", "")
    if value not in ("", "0", "1"):
        raise FailValueError(f"environment variable ORT_LOAD_CONFIG_FROM_MODEL must be '0' or '1' (the only "
                             f"values onnxruntime takes), got {value!r}")
    return value == "1"


def warn_unread_model_config(model: onnx.ModelProto) -> None:
    """A warning when ORT_LOAD_CONFIG_FROM_MODEL is 1 and the model carries session options (its metadata
    entry ``ort_config``): a training session does not apply them. onnxruntime-training 1.16.3's legacy
    TrainingSession read no model's options either: with the variable 1 it could not be created at all
    ("ModelProto needs to be parsed to check for ORT config within it")."""
    if model_config_asked() and any(p.key == "ort_config" for p in model.metadata_props):
        warn("ORT_LOAD_CONFIG_FROM_MODEL=1: a TrainingSession does not apply the session options of the "
             "model's metadata entry ort_config (InferenceSession does; onnxruntime-training's legacy "
             "TrainingSession could not be created with the variable set); give them in sess_options")


def warn_on_device_model_config(owner: str) -> None:
    """For the on-device ``owner`` ("Module", "Optimizer") being made: refuse ORT_LOAD_CONFIG_FROM_MODEL set
    to a value onnxruntime refuses (:func:`model_config_asked`), and warn when it is 1, with which
    onnxruntime-training 1.19.2 makes no Module or Optimizer ("ModelProto needs to be parsed to check for ORT
    config"): onnxtrain's is made, and applies no model's ``ort_config``."""
    if model_config_asked():
        warn(f"ORT_LOAD_CONFIG_FROM_MODEL=1: onnxruntime-training cannot make a {owner} with the variable "
             f"set (\"ModelProto needs to be parsed to check for ORT config\"); onnxtrain's {owner} is made "
             "but applies no session options of a model's metadata entry ort_config (InferenceSession does); "
             "give them in the Module's session_options")
