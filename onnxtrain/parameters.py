"""``TrainingParameters``: the bag of options the legacy ``TrainingSession`` reads once (spec §6)."""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Iterator
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
    """A bool option's value as onnxruntime 1.16.3's binding took it (pybind11's bool): None is False, and
    a number (int, float, numpy scalar) is its truth value; a string ("False" would be true), a list or
    another object is refused."""
    if v is None:
        return False
    if isinstance(v, (str, bytes)) or not hasattr(type(v), "__bool__"):
        raise TypeError(f"must be a bool, got {type(v).__name__}")
    try:
        return bool(v)
    except ValueError:  # (an array of several values)
        raise TypeError(f"must be a bool, got {type(v).__name__} {v!r}") from None


def _int(v: Any, bits: int = 32) -> int:
    """An int option's value as the binding took it: an int, bool or numpy integer in a C int's range
    (int64 in the attribute maps); a Python float, even 4.0, is refused as pybind11 refused it (other
    numbers, numpy's float32 or a 0-d float array, which it truncated, are taken only when integral)."""
    if isinstance(v, (str, bytes, float)):
        raise TypeError(f"must be an int, got {type(v).__name__} {v!r}")
    try:
        i = operator.index(v)  # ints, bools, numpy and torch integers, 0-d integer arrays
    except TypeError:
        try:
            f = float(v)
        except (TypeError, ValueError, OverflowError):
            f = float("nan")
        if not f.is_integer():
            raise TypeError(f"must be an int, got {type(v).__name__} {v!r}") from None
        i = int(f)
    if not -(2 ** (bits - 1)) <= i < 2 ** (bits - 1):
        raise TypeError(f"must be an int of {bits} bits, got {i}")
    return i


def _float32(v: Any) -> float:
    """A float option's value as the binding held it: a C float, read back rounded to float32."""
    if isinstance(v, (str, bytes)) or v is None:
        raise TypeError(f"must be a float, got {type(v).__name__} {v!r}")
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError):
        raise TypeError(f"must be a float, got {type(v).__name__} {v!r}") from None
    with np.errstate(over="ignore"):
        return float(np.float32(f))


def _name(v: Any) -> str:
    """A name as the binding took it: a str (numpy's too) or UTF-8 bytes, read back as a plain str."""
    if isinstance(v, bytes):
        return v.decode("utf-8")
    if not isinstance(v, str):
        raise TypeError(f"must be a str, got {type(v).__name__} {v!r}")
    return str(v)


def _scalar(name: str, convert: Callable[[Any], Any], value: Any) -> Any:
    """``convert(value)`` for the option ``name``; its TypeError names the option."""
    try:
        return convert(value)
    except TypeError as e:
        raise TypeError(f"TrainingParameters.{name} {e}") from None


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


def _attribute_map(where: str, key: str, entry: Any, integer: bool) -> dict[str, Any]:
    """One weight's entry of ``optimizer_attributes_map`` ({name: float}, held as C floats) or
    ``optimizer_int_attributes_map`` ({name: int64}), as the binding converted it."""
    if not isinstance(entry, dict):
        raise TypeError(f"{where}[{key!r}] must be a dict of attribute values, got "
                        f"{type(entry).__name__} {entry!r}")
    out = {}
    for attr, v in entry.items():
        try:
            out[_name(attr)] = _int(v, 64) if integer else _float32(v)
        except TypeError:
            kind = "an int" if integer else "a float"
            raise TypeError(f"{where}[{key!r}][{attr!r}] must be {kind}, got {type(v).__name__} "
                            f"{v!r}") from None
    return out


def _immutable_entry(where: str, key: str, entry: Any) -> list[tuple[int, float]]:
    """One op type's entry of ``immutable_weights``: [(input index, value), ...], read back as tuples of
    an int and a C float."""
    pairs = entry if isinstance(entry, (list, tuple)) else [None]
    out = []
    for p in pairs:
        try:
            if not isinstance(p, (list, tuple)) or len(p) != 2 or _int(p[0], 64) < 0:
                raise TypeError
            out.append((_int(p[0], 64), _float32(p[1])))
        except TypeError:
            raise TypeError(f"{where}[{key!r}] must be a list of (input index, value) pairs, got "
                            f"{entry!r}") from None
    return out


def _sliced_schema_entry(where: str, key: str, entry: Any) -> list[int]:
    if isinstance(entry, (str, bytes)) or not isinstance(entry, (list, tuple)):
        raise TypeError(f"{where}[{key!r}] must be a list of ints, got {type(entry).__name__} {entry!r}")
    try:
        return [_int(d, 64) for d in entry]
    except TypeError as e:
        raise TypeError(f"{where}[{key!r}] {e}") from None


def _sliced_axes_entry(where: str, key: str, entry: Any) -> int:
    try:
        return _int(entry, 64)
    except TypeError as e:
        raise TypeError(f"{where}[{key!r}] {e}") from None


_MAP_ENTRIES: dict[str, Callable[[str, str, Any], Any]] = {
    "optimizer_attributes_map": lambda w, k, e: _attribute_map(w, k, e, integer=False),
    "optimizer_int_attributes_map": lambda w, k, e: _attribute_map(w, k, e, integer=True),
    "immutable_weights": _immutable_entry,
    "sliced_schema": _sliced_schema_entry,
    "sliced_axes": _sliced_axes_entry,
}


def _check_map(name: str, value: dict) -> dict[str, Any]:
    """A map property's value as the binding converted it (names as str, numbers as their C types); a
    TypeError naming the entry that is not of the binding's type."""
    where = f"TrainingParameters.{name}"
    convert = _MAP_ENTRIES.get(name)
    out = {}
    for key, entry in value.items():
        try:
            key = _name(key)
        except TypeError:
            raise TypeError(f"{where}: keys must be names, got {type(key).__name__} {key!r}") from None
        out[key] = convert(where, key, entry) if convert is not None else entry
    return out


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
            # onnxruntime 1.16.3's binding took a set or frozenset; onnxtrain also takes a list or tuple (a
            # YAML config's training.parameters has no sets), not a dict or a string
            # (a one-pass iterator is refused as the binding refused it: checking it would consume it)
            if isinstance(value, (str, bytes, dict, Iterator)) or not hasattr(value, "__iter__"):
                raise TypeError(
                    f"TrainingParameters.{name} must be a set of names, got {type(value).__name__}"
                )
            odd = sorted(repr(v) for v in value if not isinstance(v, (str, bytes)))
            if odd:  # (as the binding's set of strings refuses them)
                raise TypeError(f"TrainingParameters.{name} must be a set of names (str), got "
                                f"{', '.join(odd)}")
            value = {_name(v) for v in value}
        elif isinstance(default, bool):
            value = _scalar(name, _flag, value)
        elif isinstance(default, int):
            value = _scalar(name, _int, value)
        elif isinstance(default, float):
            value = _scalar(name, _float32, value)
        elif isinstance(default, str):
            value = _scalar(name, _name, value)
        elif isinstance(default, dict):
            if not isinstance(value, dict):
                raise TypeError(f"TrainingParameters.{name} must be a dict, got {type(value).__name__}")
            value = _check_map(name, value)
        elif isinstance(default, list):
            # a sequence (a list or tuple, read back as a list), not a set, as the binding's list
            if (isinstance(value, (str, bytes, set, frozenset, dict, Iterator))
                    or not hasattr(value, "__iter__")):
                raise TypeError(f"TrainingParameters.{name} must be a list, got {type(value).__name__}")
            if all(isinstance(v, (str, bytes)) for v in value):
                value = [_name(v) for v in value]
            else:
                value = list(value)
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
        fp16_allreduce = self.is_set("perform_fp16_allreduce") and v["perform_fp16_allreduce"]
        if fp16_allreduce and not v["use_mixed_precision"]:
            idle.append("perform_fp16_allreduce has no effect without use_mixed_precision (onnxruntime read "
                        "it for a mixed-precision graph only; onnxtrain sums float32 and float64 gradients "
                        "across ranks in their own type, float16 and bfloat16 ones in float32)")
        elif fp16_allreduce:
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
