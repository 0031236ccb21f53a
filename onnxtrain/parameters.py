"""``TrainingParameters``: the bag of options the legacy ``TrainingSession`` reads once (spec §6)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np

# options onnxtrain does not implement: set to anything but their default, they make the session raise
# NotImplementedError
NOT_YET: dict[str, Any] = {}
# the pipeline's options (onnxtrain/session_pipeline.py); the others mean nothing without stages
PIPELINE: dict[str, Any] = {
    "pipeline_parallel_size": 1,
    "num_pipeline_micro_batches": 1,
    "pipeline_cut_info_string": "",
    "sliced_schema": {},
    "sliced_axes": {},
    "sliced_tensor_names": [],
}

_DEFAULTS: dict[str, Any] = {
    "loss_output_name": "",
    "weights_to_train": set(),
    "weights_not_to_train": set(),
    "immutable_weights": {},
    "training_optimizer_name": "",
    "lr_params_feed_name": "Learning_Rate",
    # onnxruntime 1.2-1.3: under mixed precision the client computed loss · loss_scale in the model and
    # named the product and the scale input here (its frontend set both on every session, '' without mixed
    # precision); the session then differentiated that product and unscaled by that input
    "scaled_loss_output_name": "",
    "loss_scale_input_name": "",
    "optimizer_attributes_map": {},
    "optimizer_int_attributes_map": {},
    "loss_scale": 0.0,
    "allreduce_post_accumulation": False,
    "world_rank": 0,
    "world_size": 1,
    "data_parallel_size": 1,
    "enable_adasum": False,
    "deepspeed_zero_stage": 0,
    "gradient_accumulation_steps": 1,
    "enable_grad_norm_clip": True,
    "use_fp16_moments": False,
    "use_memory_efficient_gradient": False,
    "set_gradients_as_graph_outputs": False,
    "propagate_cast_ops_level": 1,
    "propagate_cast_ops_allow": [],
    "model_after_graph_transforms_path": "",
    "model_with_gradient_graph_path": "",
    "model_with_training_graph_path": "",
    # onnxtrain's own switches (not in the legacy class)
    "legacy_cpu_adam": False,  # True: Adam ignores clipping, as onnxruntime's CPU kernel did
    "gradient_accumulation_mode": "legacy",  # or "auto": the session counts micro-steps itself
    "use_mixed_precision": False,
    # onnxruntime 1.8-1.11: True let LayerNormalization stash its statistics in the half type; onnxtrain
    # keeps them float32 (stash_type=1) and warns when it is set
    "allow_layer_norm_mod_precision": False,
    "mixed_precision_dtype": "float16",  # ours: or "bfloat16" (the legacy reached bf16 only from C++)
    "attn_dropout_recompute": False,
    "gelu_recompute": False,
    "transformer_layer_recompute": False,
    "number_recompute_layers": 0,
    "recompute_checkpoints": [],  # ours: recompute every activation between these kept tensors
    "horizontal_parallel_size": 1,
    # onnxruntime 1.5-1.7: True summed half-precision gradients across ranks in float16; onnxtrain sums
    # the float32 master gradients (the results of False), and warns when True is set under mixed precision
    "perform_fp16_allreduce": True,
    **NOT_YET,
    **PIPELINE,
}


def _flag(v: Any) -> bool:
    """A bool option's value as the binding took it: a bool or an integer, not a string."""
    if not isinstance(v, (bool, int, np.bool_, np.integer)):
        raise TypeError(f"must be a bool, got {type(v).__name__}")
    return bool(v)


# older bindings' names of options that onnxruntime renamed: {old name: (new name, old value -> new value,
# new value -> old value)}. Scripts of those releases set them on every session (their frontends'
# session factories), so they are read and written through the new option.
RENAMED: dict[str, tuple[str, Callable[[Any], Any], Callable[[Any], Any]]] = {
    # onnxruntime 1.3-1.4: partitioning the optimizer state was ZeRO stage 1
    "partition_optimizer": ("deepspeed_zero_stage", lambda on: int(_flag(on)), lambda stage: stage >= 1),
    # onnxruntime 1.5-1.7
    "use_invertible_layernorm_grad": ("use_memory_efficient_gradient", _flag, lambda on: on),
    "use_adasum": ("enable_adasum", _flag, lambda on: on),
}


def _number(v: Any, integer: bool) -> bool:
    """Whether ``v`` is a number the legacy binding took for a float (anything ``float()`` reads but text:
    numpy and torch scalars and 0-d arrays too) or, with ``integer``, for an int (bools, int enums and
    integral floats too)."""
    if isinstance(v, (str, bytes)):
        return False
    try:
        f = float(v)
    except (TypeError, ValueError):
        return False
    return not integer or f.is_integer()


def _check_attribute_map(where: str, key: str, entry: Any, integer: bool) -> None:
    """One weight's entry of ``optimizer_attributes_map`` ({name: float}) or
    ``optimizer_int_attributes_map`` ({name: int})."""
    if not isinstance(entry, dict):
        raise TypeError(f"{where}[{key!r}] must be a dict of attribute values, got "
                        f"{type(entry).__name__} {entry!r}")
    for attr, v in entry.items():
        if not isinstance(attr, str) or not _number(v, integer):
            kind = "an int" if integer else "a float"
            raise TypeError(f"{where}[{key!r}][{attr!r}] must be {kind}, got {type(v).__name__} {v!r}")


def _check_immutable_entry(where: str, key: str, entry: Any) -> None:
    """One op type's entry of ``immutable_weights``: [(input index, value), ...]."""
    pairs = entry if isinstance(entry, (list, tuple)) else [None]
    if not all(isinstance(p, (list, tuple)) and len(p) == 2 and _number(p[0], True)
               and _number(p[1], False) for p in pairs):
        raise TypeError(f"{where}[{key!r}] must be a list of (input index, value) pairs, got {entry!r}")


_MAP_ENTRY_CHECKS: dict[str, Callable[[str, str, Any], None]] = {
    "optimizer_attributes_map": lambda w, k, e: _check_attribute_map(w, k, e, integer=False),
    "optimizer_int_attributes_map": lambda w, k, e: _check_attribute_map(w, k, e, integer=True),
    "immutable_weights": _check_immutable_entry,
}


def _check_map(name: str, value: dict) -> None:
    """A TypeError naming the entry of a map property that is not of the binding's type."""
    where = f"TrainingParameters.{name}"
    check = _MAP_ENTRY_CHECKS.get(name)
    for key, entry in value.items():
        if not isinstance(key, str):
            raise TypeError(f"{where}: keys must be names, got {type(key).__name__} {key!r}")
        if check is not None:
            check(where, key, entry)


class TrainingParameters:
    """Options of the legacy ``TrainingSession``; every property of onnxruntime's class is here.

    As in onnxruntime, properties return copies: assign a whole set or dict, do not mutate in place.
    Example::

        p = TrainingParameters()
        p.loss_output_name = "loss"
        p.training_optimizer_name = "SGDOptimizer"
    """

    def __init__(self) -> None:
        object.__setattr__(self, "_values", copy.deepcopy(_DEFAULTS))
        object.__setattr__(self, "_initial_state", {})
        object.__setattr__(self, "_assigned", set())  # the properties the user set (even to their default)

    def __dir__(self) -> list[str]:
        """The properties with the methods, as the binding's object lists them."""
        return sorted({*object.__dir__(self), *self._values})

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return copy.deepcopy(values[name])
        if name in RENAMED:
            new, _, back = RENAMED[name]
            return back(values[new])
        raise AttributeError(f"TrainingParameters has no property {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in RENAMED:
            new, forth, _ = RENAMED[name]
            try:
                value = forth(value)
            except TypeError as e:
                raise TypeError(f"TrainingParameters.{name} {e}") from None
            setattr(self, new, value)
            return
        if name not in self._values:
            raise AttributeError(
                f"TrainingParameters has no property {name!r}; properties: {sorted(self._values)}"
            )
        default = _DEFAULTS[name]
        if isinstance(default, set):
            if isinstance(value, str) or not hasattr(value, "__iter__"):
                raise TypeError(
                    f"TrainingParameters.{name} must be a set of names, got {type(value).__name__}"
                )
            value = set(value)
            odd = sorted(repr(v) for v in value if not isinstance(v, str))
            if odd:  # (as the binding's set of strings refuses them)
                raise TypeError(f"TrainingParameters.{name} must be a set of names (str), got "
                                f"{', '.join(odd)}")
        elif isinstance(default, bool):
            # as the legacy binding: a bool or an integer, not a string ("False" would be true)
            try:
                value = _flag(value)
            except TypeError as e:
                raise TypeError(f"TrainingParameters.{name} {e}") from None
        elif isinstance(default, int):
            if isinstance(value, (str, bytes)) or not isinstance(value, (int, float, np.number)):
                raise TypeError(f"TrainingParameters.{name} must be an int, got {type(value).__name__}")
            if isinstance(value, (float, np.floating)) and not float(value).is_integer():
                raise TypeError(f"TrainingParameters.{name} must be an int, got {value!r}")
            value = int(value)
        elif isinstance(default, float):
            if isinstance(value, (str, bytes)) or not isinstance(value, (int, float, np.number)):
                raise TypeError(f"TrainingParameters.{name} must be a float, got {type(value).__name__}")
            value = float(value)
        elif isinstance(default, str) and not isinstance(value, str):
            raise TypeError(f"TrainingParameters.{name} must be a str, got {type(value).__name__}")
        elif isinstance(default, dict):
            if not isinstance(value, dict):
                raise TypeError(f"TrainingParameters.{name} must be a dict, got {type(value).__name__}")
            _check_map(name, value)
        elif isinstance(default, list) and (isinstance(value, str) or not hasattr(value, "__iter__")):
            raise TypeError(f"TrainingParameters.{name} must be a list, got {type(value).__name__}")
        self._values[name] = copy.deepcopy(value)
        self.__dict__.setdefault("_assigned", set()).add(name)

    def is_set(self, name: str) -> bool:
        """Whether property ``name`` was assigned (an explicit ``world_rank = 0`` is not the default's 0)."""
        return name in self.__dict__.get("_assigned", ())

    def set_optimizer_initial_state(self, state: dict[str, dict[str, Any]]) -> None:
        """Initial optimizer state, in the layout of ``get_optimizer_state()``."""
        if not isinstance(state, dict) or not all(isinstance(d, dict) for d in state.values()):
            raise TypeError("set_optimizer_initial_state takes {weight name: {state name: array}}")
        initial = {w: {k: np.array(v) for k, v in d.items()} for w, d in state.items()}
        object.__setattr__(self, "_initial_state", initial)

    def optimizer_initial_state(self) -> dict[str, dict[str, np.ndarray]]:
        return self._initial_state

    def snapshot(self) -> TrainingParameters:
        """A copy a session keeps: later changes to this object reach neither (the legacy constructor read
        its parameters once). The optimizer's initial state, read by the constructor alone, is shared."""
        copied = TrainingParameters.__new__(TrainingParameters)
        object.__setattr__(copied, "_values", copy.deepcopy(self._values))
        object.__setattr__(copied, "_initial_state", self._initial_state)
        object.__setattr__(copied, "_assigned", set(self.__dict__.get("_assigned", ())))
        return copied

    def pipeline_only_options(self) -> list[str]:
        """Pipeline options set away from their defaults (they act only with more than one stage)."""
        return [k for k, d in PIPELINE.items() if k != "pipeline_parallel_size" and self._values[k] != d]

    def idle_options(self) -> list[str]:
        """One message per option set to a value that does nothing under the other settings."""
        v, opt = self._values, self._values["training_optimizer_name"]
        idle = []
        if self.is_set("mixed_precision_dtype") and not v["use_mixed_precision"]:
            idle.append("mixed_precision_dtype has no effect without use_mixed_precision")
        for name in ("scaled_loss_output_name", "loss_scale_input_name"):
            if v[name] and not v["use_mixed_precision"]:
                idle.append(f"{name} has no effect without use_mixed_precision")
        if v["loss_scale_input_name"] and v["use_mixed_precision"] and not v["scaled_loss_output_name"]:
            idle.append("loss_scale_input_name has no effect without scaled_loss_output_name (the session "
                        "adds its own loss_scale input)")
        if v["number_recompute_layers"] and not v["transformer_layer_recompute"]:
            idle.append("number_recompute_layers has no effect without transformer_layer_recompute")
        if v["legacy_cpu_adam"] and opt != "AdamOptimizer":
            idle.append(f"legacy_cpu_adam has no effect with {opt or 'no optimizer'} (AdamOptimizer only)")
        if v["use_fp16_moments"] and opt not in ("AdamOptimizer", "LambOptimizer"):
            idle.append(f"use_fp16_moments has no effect with {opt or 'no optimizer'} (no moments)")
        if v["loss_scale"] != _DEFAULTS["loss_scale"]:
            idle.append("loss_scale has no effect, as in onnxruntime's legacy session: under mixed precision "
                        "the loss scale is the loss_scale input fed to each run (in `onnxtrain train`, the "
                        "value its dynamic loss scaler feeds)")
        if self.is_set("perform_fp16_allreduce") and v["perform_fp16_allreduce"] and v["use_mixed_precision"]:
            idle.append("perform_fp16_allreduce has no effect: onnxtrain sums the float32 master gradients "
                        "across ranks (as onnxruntime did with False)")
        if (v["propagate_cast_ops_level"] != _DEFAULTS["propagate_cast_ops_level"]
                or v["propagate_cast_ops_allow"]):
            idle.append("propagate_cast_ops_level / propagate_cast_ops_allow have no effect in onnxtrain "
                        "(its mixed-precision pass places the casts itself)")
        return idle

    def unsupported_options(self) -> list[str]:
        """Options set away from their defaults that onnxtrain does not implement yet."""
        return [k for k, d in NOT_YET.items() if self._values[k] != d]

    def __repr__(self) -> str:
        changed = {k: v for k, v in self._values.items() if v != _DEFAULTS[k]}
        return f"TrainingParameters({changed})"
