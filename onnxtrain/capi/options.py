"""SessionOptions, RunOptions and execution providers, with onnxruntime's names."""

from __future__ import annotations

import copy
import enum
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from onnxtrain.errors import Fail, FailKeyError, FailValueError
from onnxtrain.user_warning import warn

AVAILABLE_PROVIDERS = ["CPUExecutionProvider"]
# providers onnxruntime knows; asking for one that is not available falls back to CPU with a warning
# onnxruntime 1.32's get_all_providers(), in its order (the CPU's last)
ALL_PROVIDERS = [
    "TensorrtExecutionProvider", "CUDAExecutionProvider", "MIGraphXExecutionProvider",
    "OpenVINOExecutionProvider", "DnnlExecutionProvider", "VitisAIExecutionProvider", "QNNExecutionProvider",
    "NnapiExecutionProvider", "VSINPUExecutionProvider", "JsExecutionProvider", "CoreMLExecutionProvider",
    "DmlExecutionProvider", "RknpuExecutionProvider", "WebNNExecutionProvider", "WebGpuExecutionProvider",
    "XnnpackExecutionProvider", "CANNExecutionProvider", "AzureExecutionProvider", "CPUExecutionProvider",
]
# every name a session accepts (those not here fall back to the CPU): also providers of older onnxruntimes
KNOWN_PROVIDERS = ALL_PROVIDERS + ["ROCMExecutionProvider", "ACLExecutionProvider", "ArmNNExecutionProvider"]
_CPU_FIRST = ["CPUExecutionProvider", *(p for p in KNOWN_PROVIDERS if p != "CPUExecutionProvider")]


class _Named(enum.IntEnum):
    """An int enum printed by its name (``GraphOptimizationLevel.ORT_ENABLE_ALL``), as onnxruntime's are."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class GraphOptimizationLevel(_Named):
    """onnxruntime's graph optimization levels, for ``SessionOptions.graph_optimization_level``: the
    onnxruntime backend passes the level on; on the numpy engine ``ORT_DISABLE_ALL`` turns the plan-time
    fusions off and the other levels keep them."""

    ORT_DISABLE_ALL = 0
    ORT_ENABLE_BASIC = 1
    ORT_ENABLE_EXTENDED = 2
    ORT_ENABLE_LAYOUT = 3
    ORT_ENABLE_ALL = 99


class ExecutionMode(_Named):
    """onnxruntime's execution modes, for ``SessionOptions.execution_mode`` (the numpy engine runs nodes one
    at a time and warns of ``ORT_PARALLEL``; the onnxruntime backend passes the mode on)."""

    ORT_SEQUENTIAL = 0
    ORT_PARALLEL = 1


class ExecutionOrder(_Named):
    """onnxruntime's node orders, for ``SessionOptions.execution_order``: the onnxruntime backend passes
    the one set on; the numpy engine runs a graph's nodes in its own order and warns when another is set.
    Left unset, the backend runs the graph's order (``PRIORITY_BASED``, :mod:`onnxtrain.engine.ort_plan`)."""

    DEFAULT = 0
    PRIORITY_BASED = 1
    MEMORY_EFFICIENT = 2


class PropagateCastOpsStrategy(enum.IntFlag):
    """The legacy binding's cast-propagation strategies (flags that combine with ``|``). Its
    TrainingParameters never exposed a field taking them: onnxtrain's mixed-precision pass follows
    ``propagate_cast_ops_level`` and ``propagate_cast_ops_allow``."""

    NONE = 0
    INSERT_AND_REDUCE = 1
    FLOOD_FILL = 2
    REMOVE_INPUT_OUTPUT_UP_DOWN_CASTS = 4


def _field_value(owner: str, name: str, default: Any, value: Any) -> Any:
    """``value`` for field ``name``, of the type its ``default`` has, as onnxruntime's binding converts it:
    a TypeError naming the field for a value of another kind (``"False"`` for a bool would be true)."""
    def refuse(what: str) -> TypeError:
        return TypeError(f"{owner}.{name} takes {what}, got {type(value).__name__} {value!r}")

    if isinstance(default, enum.Enum):
        kind = type(default)
        if isinstance(value, kind):
            return value
        if getattr(value, "name", None) in kind.__members__:  # onnxruntime's own member of that name
            return kind[value.name]
        if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) \
                and int(value) in {m.value for m in kind}:
            return kind(int(value))
        raise refuse(f"{kind.__name__} (one of {', '.join(kind.__members__)})")
    if isinstance(default, bool):
        if isinstance(value, (str, bytes)):
            raise refuse("a bool")
        return bool(value)
    if isinstance(default, int):
        if isinstance(value, (int, np.integer, np.bool_)):
            return int(value)
        raise refuse("an int")
    if isinstance(default, str):
        if isinstance(value, (str, os.PathLike)):
            return os.fspath(value)
        raise refuse("a str")
    return value


class _Fields:
    """Options whose public fields are the ones ``__init__`` sets: assigning another (a misspelt
    ``intra_op_threads``) is an AttributeError, as on onnxruntime's objects, not a setting silently unused;
    a value of another type than the field's is a TypeError (:func:`_field_value`)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_") and "_fields" in self.__dict__ and type(self) in _FIELDED:
            if name in self._defaults:
                value = _field_value(type(self).__name__, name, self._defaults[name], value)
                check = self._checks.get(name)
                if check is not None:
                    value = check(value)
            elif not hasattr(type(self), name):  # (subclasses: their own)
                raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        object.__setattr__(self, name, value)

    _checks: dict[str, Any] = {}  # field -> a function checking (and converting) a value of it

    def _fix_fields(self) -> None:
        fields = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        object.__setattr__(self, "_fields", frozenset(fields))
        object.__setattr__(self, "_defaults", fields)


def _execution_order(value: Any) -> ExecutionOrder | None:
    """An ``execution_order`` value as an :class:`ExecutionOrder` (None: unset): a member, onnxruntime's
    member of the same name, a member's name or value; a TypeError otherwise, as onnxruntime's binding
    raises when it is given anything but its enum."""
    if value is None or isinstance(value, ExecutionOrder):
        return value
    key = getattr(value, "name", value)
    if isinstance(key, str) and key.upper() in ExecutionOrder.__members__:
        return ExecutionOrder[key.upper()]
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) \
            and int(value) in {m.value for m in ExecutionOrder}:
        return ExecutionOrder(int(value))
    raise TypeError(f"SessionOptions.execution_order takes an ExecutionOrder (one of "
                    f"{', '.join(ExecutionOrder.__members__)}), got {type(value).__name__} {value!r}")


class SessionOptions(_Fields):
    """Options of a session (onnxruntime.SessionOptions); unknown config entries are kept, not used."""

    _checks = {"execution_order": _execution_order}

    def __init__(self) -> None:
        self.enable_profiling = False
        self.profile_file_prefix = "onnxruntime_profile_"
        self.optimized_model_filepath = ""
        self.graph_optimization_level = GraphOptimizationLevel.ORT_ENABLE_ALL
        self.execution_mode = ExecutionMode.ORT_SEQUENTIAL
        # None until set (onnxruntime's default: DEFAULT); the onnxruntime backend then runs the graph's order
        self.execution_order: ExecutionOrder | str | int | None = None
        self.intra_op_num_threads = 0
        self.inter_op_num_threads = 0
        self.log_severity_level = -1  # onnxruntime's: the default logger's (set_default_logger_severity)
        self.log_verbosity_level = 0
        self.logid = ""
        self.enable_mem_pattern = True
        self.enable_mem_reuse = True
        self.enable_cpu_mem_arena = True
        self.use_deterministic_compute = False
        self.use_per_session_threads = True  # (each session has its own threads; taken, not used)
        self._config: dict[str, str] = {}
        self._initializers: dict[str, Any] = {}  # name → the array to use for that initializer
        self._external: set[str] = set()  # those given by add_external_initializers: the model must hold them
        self._dims: dict[tuple[str, str], int] = {}  # ("name" | "denotation", symbol) → its size
        self._files_in_memory: dict[str, bytes] = {}  # an external data file's location → its bytes
        self._fix_fields()

    def snapshot(self) -> SessionOptions:
        """A copy a session keeps, so that changing these options later does not change it (onnxruntime
        copies them when the session is made)."""
        out = copy.copy(self)
        out._config, out._initializers = dict(self._config), dict(self._initializers)
        out._external = set(self._external)
        out._dims = dict(self._dims)
        out._files_in_memory = dict(self._files_in_memory)
        return out

    def add_session_config_entry(self, key: str, value: str) -> None:
        key, value = _config_str("add_session_config_entry", key, value)
        self._config[key] = value

    def add_initializer(self, name: str, value: Any) -> None:
        """Use ``value`` (an OrtValue or array) for the model's initializer ``name`` in the sessions made with
        these options."""
        self._initializers[str(name)] = value

    def add_external_initializers(self, names: Sequence[str], values: Sequence[Any]) -> None:
        """:meth:`add_initializer` for each name and value."""
        if len(names) != len(values):
            raise FailValueError(f"add_external_initializers: {len(names)} names for {len(values)} values")
        for name, value in zip(names, values):
            self.add_initializer(name, value)
            self._external.add(str(name))

    def add_external_initializers_from_files_in_memory(
        self, file_names: Sequence[str], buffers: Sequence[Any], lengths: Sequence[int]
    ) -> None:
        """Give the contents of external data files by name: a tensor whose data location is one of
        ``file_names`` is read from the first ``lengths[k]`` bytes of ``buffers[k]`` (bytes or an array) in
        place of that file."""
        if not len(file_names) == len(buffers) == len(lengths):
            raise FailValueError(f"add_external_initializers_from_files_in_memory: {len(file_names)} file "
                                 f"names, {len(buffers)} buffers and {len(lengths)} lengths")
        taken: dict[str, bytes] = {}  # every entry checked before any is registered
        for name, buffer, length in zip(file_names, buffers, lengths):
            try:
                data = memoryview(buffer).cast("B").tobytes()
            except TypeError as e:
                raise FailValueError(f"add_external_initializers_from_files_in_memory: file {name!r}: the "
                                     f"buffer must be bytes or an array ({e})") from None
            if not 0 <= int(length) <= len(data):
                raise FailValueError(f"add_external_initializers_from_files_in_memory: file {name!r}: length "
                                     f"{length} of a buffer of {len(data)} bytes")
            taken[os.path.normpath(str(name))] = data[:int(length)]
        self._files_in_memory.update(taken)

    def add_free_dimension_override_by_name(self, dim_name: str, dim_value: int) -> None:
        """Fix the symbolic dimension ``dim_name`` of the model's inputs to ``dim_value``."""
        self._dims[("name", str(dim_name))] = int(dim_value)

    def add_free_dimension_override_by_denotation(self, dim_denotation: str, dim_value: int) -> None:
        """Fix the dimensions denoted ``dim_denotation`` (``DATA_BATCH``, ...) of the model's inputs."""
        self._dims[("denotation", str(dim_denotation))] = int(dim_value)

    def get_session_config_entry(self, key: str) -> str:
        key = _c_string(key) if isinstance(key, str) else key
        if key not in self._config:
            raise FailKeyError(f"SessionOptions does not have configuration with key: {key}")
        return self._config[key]

    def register_custom_ops_library(self, path: str) -> None:
        """Accepted, with a warning, for scripts that register a library (onnxruntime-extensions ...) whatever
        the model: onnxtrain runs standard ONNX ops only, so a session refuses a model using the library's
        ops by their names. A path that does not exist is onnxruntime's ``Fail``."""
        if not os.path.exists(os.fspath(path)):
            raise Fail(f"Failed to load library {path}: no such file")
        warn(f"register_custom_ops_library({os.fspath(path)!r}): onnxtrain runs standard ONNX ops only; a "
             "model using the library's ops is refused when a session loads it")


def _config_str(method: str, key: Any, value: Any) -> tuple[str, str]:
    """``key`` and ``value``, after checking that they are str, as onnxruntime's binding takes only those;
    each up to its first NUL character, as onnxruntime reads them (C strings)."""
    if not isinstance(key, str) or not isinstance(value, str):
        raise TypeError(f"{method}() takes a str key and a str value, got {type(key).__name__} and "
                        f"{type(value).__name__}")
    return _c_string(key), _c_string(value)


def _c_string(text: str) -> str:
    """``text`` up to its first NUL character."""
    return text.partition("\x00")[0]


class RunOptions(_Fields):
    """Options of one run (onnxruntime.RunOptions); ``training_mode`` is used by training sessions. On the
    onnxruntime backend the logging fields and the run config entries go to onnxruntime's own run options,
    and ``terminate`` set during a run reaches them too."""

    def __init__(self) -> None:
        self._linked: list[Any] = []  # onnxruntime RunOptions of the backend's runs in progress
        self.log_severity_level = -1  # onnxruntime's: the default logger's (set_default_logger_severity)
        self.log_verbosity_level = 0
        self.logid = ""
        self.run_tag = ""
        self.terminate = False
        self.only_execute_path_to_fetches = False
        self.training_mode = True
        self._config: dict[str, str] = {}
        self._fix_fields()

    @classmethod
    def _default(cls) -> RunOptions:
        """A new RunOptions of the default values, made without the fields' checks (for a run given none:
        the checked constructor took most of a small model's run)."""
        template = cls.__dict__.get("_template")
        if template is None:
            template = dict(cls().__dict__)
            type.__setattr__(cls, "_template", template)
        ro = object.__new__(cls)
        ro.__dict__.update(template)
        ro.__dict__["_linked"], ro.__dict__["_config"] = [], {}
        return ro

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "terminate":  # a run in progress on the onnxruntime backend stops before its next node
            for linked in tuple(self.__dict__.get("_linked", ())):
                linked.terminate = bool(self.terminate)

    def add_run_config_entry(self, key: str, value: str) -> None:
        key, value = _config_str("add_run_config_entry", key, value)
        self._config[key] = value

    def get_run_config_entry(self, key: str) -> str:
        key = _c_string(key) if isinstance(key, str) else key
        if key not in self._config:
            raise FailKeyError(f"RunOptions does not have configuration with key: {key}")
        return self._config[key]


_FIELDED = (SessionOptions, RunOptions)


def get_available_providers() -> list[str]:
    """The execution providers this installation can run (the CPU's, and CUDA's with onnxruntime-gpu)."""
    return list(AVAILABLE_PROVIDERS)


def get_all_providers() -> list[str]:
    """onnxruntime's provider names, in its order: the CPU's last."""
    return list(ALL_PROVIDERS)


def get_version_string() -> str:
    """onnxtrain's version (onnxruntime's function gives its own)."""
    from onnxtrain import __version__

    return __version__


def get_device() -> str:
    """The device the numpy engine runs on, as onnxruntime names it: always "CPU"."""
    return "CPU"


def resolve_providers(
    providers: Sequence[Any] | None, provider_options: Sequence[dict] | None = None
) -> tuple[list[str], list[dict]]:
    """Provider names and options, falling back to CPU for known but unavailable providers."""
    if not providers:
        return ["CPUExecutionProvider"], [{}]
    names: list[str] = []
    opts: list[dict] = []
    given = list(provider_options) if provider_options else []
    if given and len(given) != len(providers):
        raise ValueError("providers and provider_options must have the same length")
    if given and not all(isinstance(p, str) for p in providers):  # (onnxruntime's check)
        raise ValueError("providers must be names when provider_options is given (not (name, options) pairs)")
    for k, p in enumerate(providers):
        name, o = (p[0], dict(p[1])) if isinstance(p, (tuple, list)) else (p, dict(given[k]) if given else {})
        if name not in KNOWN_PROVIDERS:
            # (onnxruntime's words first)
            raise ValueError(f"Unknown Provider Type: {name}; valid names: {', '.join(_CPU_FIRST)}")
        if name not in AVAILABLE_PROVIDERS:
            warn(f"{name} is not available here; falling back to CPUExecutionProvider")
            continue
        if name in names:  # the first listing's options hold, as in onnxruntime
            warn(f"duplicate provider {name} in the providers list: ignoring this one")
            continue
        names.append(name)
        opts.append({str(k2): str(v) for k2, v in o.items()})
    if "CPUExecutionProvider" not in names:
        names.append("CPUExecutionProvider")
        opts.append({})
    return names, opts
