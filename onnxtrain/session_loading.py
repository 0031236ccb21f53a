"""What a session's options do when it is made: the model loaded with the initializers and free dimensions
they override, the options it keeps (a snapshot, with what the model's ``ort_config`` sets), and where the
optimized model is written."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx

from onnxtrain.capi.options import ExecutionMode, GraphOptimizationLevel, SessionOptions
from onnxtrain.engine.interface import load_model
from onnxtrain.errors import Fail, FailValueError, InvalidArgument, RuntimeException
from onnxtrain.user_warning import warn


def optimized_model_path(options: SessionOptions) -> str:
    """``options.optimized_model_filepath`` ("" when unset), with a warning when it names an ``.ort`` file:
    onnxruntime wrote its own ORT format there, onnxtrain writes an ONNX model under any name."""
    path = options.optimized_model_filepath
    if path.lower().endswith(".ort"):
        warn(f"SessionOptions.optimized_model_filepath {path!r}: onnxtrain writes an ONNX model (protobuf) "
             "there, not onnxruntime's ORT format; name it .onnx, or convert it with onnxruntime's "
             "convert_onnx_models_to_ort")
    elif config_entry(options, _SAVE_FORMAT) == "ORT":  # (onnxruntime writes its ORT format then)
        warn(f"session config entry {_SAVE_FORMAT} = 'ORT': onnxtrain writes an ONNX model (protobuf) to "
             f"SessionOptions.optimized_model_filepath {path!r}, not onnxruntime's ORT format; convert it "
             "with onnxruntime's convert_onnx_models_to_ort")
    return path


_SAVE_FORMAT = "session.save_model_format"
_NO_CPU_FALLBACK = "session.disable_cpu_ep_fallback"


def refuse_disabled_cpu_fallback(options: Any, providers: Any) -> None:
    """Refuse session config entry ``session.disable_cpu_ep_fallback = "1"`` for a session of the numpy
    engine, which runs every node on the CPU: as onnxruntime refuses it (an InvalidArgument when the CPU
    provider is among ``providers``, else a Fail: its nodes would fall back to the CPU)."""
    if config_entry(options, _NO_CPU_FALLBACK) != "1":
        return
    names = [p[0] if isinstance(p, (tuple, list)) and p else p for p in providers or ()]
    if "CPUExecutionProvider" in names:
        raise InvalidArgument("Conflicting session configuration: the CPU execution provider is asked for, "
                              f"and config entry {_NO_CPU_FALLBACK} = '1' disables falling back to it")
    raise Fail(f"session config entry {_NO_CPU_FALLBACK} = '1' disables running nodes on the CPU, where the "
               "numpy engine runs every node (use the onnxruntime backend, config entry onnxtrain.backend, "
               "for another execution provider)")


_POLICIES = ("", "auto", "latency", "memory", "safe")
# what C++'s std::stoi reads at the start of a string: C-locale spaces, a sign, ASCII digits (Python's \s and
# \d would take Unicode ones, which stoi refuses)
_STOI = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")
# what onnxruntime takes as a positive whole number (function expansion limits): decimal or 0x hexadecimal
_WHOLE = re.compile(r"[0-9]+|0[xX][0-9a-fA-F]+")


class FailIndexError(Fail, IndexError):
    """A session config entry whose number is past int32 (``session.dynamic_block_base``): the IndexError
    onnxruntime's binding raises for std::stoi's out_of_range, and onnxruntime's ``Fail``."""


def _stoi_fails(text: str) -> type[Exception] | None:
    """The class std::stoi's failure on ``text`` comes out as in onnxruntime's binding: ValueError for no
    number at its start, IndexError for one past int32; None when it reads it."""
    m = _STOI.match(text)
    if m is None:
        return ValueError
    return None if -2**31 <= int(m.group(1)) < 2**31 else IndexError


def _positive_whole(text: str) -> bool:
    """Whether onnxruntime takes ``text`` as a positive whole number below 2**64."""
    return _WHOLE.fullmatch(text) is not None and 0 < int(text, 0 if text[1:2] in "xX" else 10) < 2**64


def check_numpy_engine_entries(options: Any, providers: Any) -> None:
    """The config-entry checks of a training session on the numpy engine (the legacy session, ``Module``):
    :func:`refuse_disabled_cpu_fallback`, :func:`warn_config_not_applied`, :func:`refuse_bad_ort_entries`."""
    refuse_disabled_cpu_fallback(options, providers)
    warn_config_not_applied(options)
    refuse_bad_ort_entries(options)


def refuse_bad_ort_entries(options: Any) -> None:
    """Refuse the values of onnxruntime's session config entries that onnxruntime 1.32 refuses when it makes
    a session, with the class it raises, for a session of the numpy engine (which reads none of them): so
    that an ``except`` clause written for onnxruntime catches it on either engine. InvalidArgument for
    ``optimization.minimal_build_optimizations`` other than "" or "apply" ("save" only with
    ``session.save_model_format`` "ORT"), ``session.kernel_dispatch_policy`` other than "", "auto",
    "latency", "memory", "safe", ``session.function_expansion_byte_limit`` / ``_node_limit`` other than a
    positive whole number below 2**64 in decimal or 0x hexadecimal digits; RuntimeException for a
    ``session.graph_optimizations_loop_level`` and a ValueError (a Fail) for a ``session.dynamic_block_base``
    that C++'s ``stoi`` does not read, an IndexError (a Fail) for one past int32, as onnxruntime's binding
    raises std::stoi's invalid_argument and out_of_range."""
    value = config_entry(options, "optimization.minimal_build_optimizations")
    saves_ort = config_entry(options, _SAVE_FORMAT) == "ORT"
    if value not in (None, "", "apply") and not (value == "save" and saves_ort):
        why = ("is only valid when saving an ORT format model" if value == "save"
               else "is not one of '', 'apply', 'save'")
        raise InvalidArgument(f"session config entry optimization.minimal_build_optimizations: {value!r} "
                              f"{why}")
    value = config_entry(options, "session.kernel_dispatch_policy")
    if value is not None and value not in _POLICIES:
        raise InvalidArgument(f"session config entry session.kernel_dispatch_policy must be empty or one of "
                              f"'auto', 'latency', 'memory', or 'safe' (case-sensitive), got {value!r}")
    for key in ("session.function_expansion_byte_limit", "session.function_expansion_node_limit"):
        value = config_entry(options, key)
        if value is not None and not _positive_whole(value):
            raise InvalidArgument(f"session config entry {key} must be a positive whole number, got "
                                  f"{value!r}")
    value = config_entry(options, "session.graph_optimizations_loop_level")
    if value is not None and _stoi_fails(value):
        raise RuntimeException(f"session config entry session.graph_optimizations_loop_level must be a whole "
                               f"number, got {value!r}")
    value = config_entry(options, "session.dynamic_block_base")
    failed = None if value is None else _stoi_fails(value)
    if failed is IndexError:
        raise FailIndexError(f"session config entry session.dynamic_block_base: {value!r} is past int32's "
                             "range")
    if failed is not None:
        raise FailValueError(f"session config entry session.dynamic_block_base must be a whole number, got "
                             f"{value!r}")


# the session config entries that put the optimized model's initializers in a data file, as onnxruntime's do
_DATA_FILE = "session.optimized_model_external_initializers_file_name"
_DATA_MIN_BYTES = "session.optimized_model_external_initializers_min_size_in_bytes"


def optimized_model_data(options: Any) -> dict[str, Any]:
    """How ``optimized_model_filepath`` keeps its initializers: with the config entry
    ``session.optimized_model_external_initializers_file_name`` (a file name beside the model), those of
    ``..._min_size_in_bytes`` bytes or more (1024 unless set) in that file, as onnxruntime writes them;
    without it, in the model."""
    name = config_entry(options, _DATA_FILE)  # (onnxtrain's SessionOptions or onnxruntime's)
    if not name:
        return {}
    if os.path.basename(name) != name or name in (".", ".."):
        raise FailValueError(f"session config entry {_DATA_FILE} must be a file name (written beside the "
                             f"optimized model), got {name!r}")
    text = config_entry(options, _DATA_MIN_BYTES)
    text = "1024" if text is None else text
    try:
        threshold = int(text)
    except ValueError:
        threshold = -1
    if threshold < 0:
        raise FailValueError(f"session config entry {_DATA_MIN_BYTES} must be a whole number of bytes, got "
                             f"{text!r}")
    return {"external_data": name, "size_threshold": threshold}


def options_snapshot(options: Any) -> Any:
    """The options a session keeps: a copy of onnxtrain's (later changes do not reach the session, as in
    onnxruntime), new defaults without any; another library's SessionOptions (onnxruntime's) as it is;
    anything else a TypeError naming the argument, as onnxruntime's constructor refuses it."""
    if options is None:
        return SessionOptions()
    if not isinstance(options, SessionOptions):
        if not all(hasattr(options, a) for a in ("graph_optimization_level", "intra_op_num_threads")):
            raise TypeError(f"sess_options must be a SessionOptions, got {type(options).__name__}"
                            + (" (providers go in the providers argument)" if isinstance(options, list)
                               else ""))
        return options
    check_severity(options.log_severity_level, "SessionOptions")
    if options.use_per_session_threads is False:
        warn("SessionOptions.use_per_session_threads = False has no effect: every onnxtrain session has its "
             "own threads (onnxruntime refuses it unless its environment has global thread pools)")
    return options.snapshot()


_LEVELS = {int(level) for level in GraphOptimizationLevel}
# the session options a model's "ort_config" metadata may set, as onnxruntime reads them: name → the values
# taken and how they are stored
_MODEL_OPTIONS: dict[str, Callable[[int], Any]] = {
    "intra_op_num_threads": lambda v: v if v >= 0 else None,
    "inter_op_num_threads": lambda v: v if v >= 0 else None,
    "execution_mode": lambda v: ExecutionMode(v) if v in (0, 1) else None,
    "graph_optimization_level": lambda v: GraphOptimizationLevel(v) if v in _LEVELS else None,
    "enable_profiling": lambda v: bool(v) if v in (0, 1) else None,
}


def options_from_model(options: Any, model: onnx.ModelProto) -> Any:
    """``options`` with the session options the model's metadata entry ``ort_config`` sets (JSON:
    ``{"session_options": {"intra_op_num_threads": 2, ...}}``), as onnxruntime applies them when the
    environment variable ORT_LOAD_CONFIG_FROM_MODEL is 1: the thread counts, ``execution_mode``,
    ``graph_optimization_level`` and ``enable_profiling``, other keys ignored; a value of another kind, or
    JSON that does not parse, is an InvalidArgument naming the entry. Another library's options are
    returned as they are."""
    text = next((p.value for p in model.metadata_props if p.key == "ort_config"), None)
    if text is None or not isinstance(options, SessionOptions):
        return options
    try:
        config = json.loads(text)
    except ValueError as e:
        raise InvalidArgument(f"the model's metadata entry ort_config is not JSON: {e}") from None
    given = config.get("session_options", {}) if isinstance(config, dict) else {}
    for key, value in (given.items() if isinstance(given, dict) else ()):
        convert = _MODEL_OPTIONS.get(key)
        if convert is None:
            continue  # (onnxruntime ignores the session options it does not read from a model)
        taken = convert(value) if isinstance(value, int) and not isinstance(value, bool) else None
        if taken is None:
            raise InvalidArgument(f"the model's metadata entry ort_config sets session_options.{key} to "
                                  f"{value!r}, which onnxruntime does not take for it")
        setattr(options, key, taken)
    return options


# the SessionOptions fields onnxruntime 1.32 drops with ORT_LOAD_CONFIG_FROM_MODEL=1 (it makes the session
# with default options and the model's ort_config) that change what an onnxtrain session computes or writes
# (the numpy engine fuses nothing at ORT_DISABLE_ALL; the others write files); thread counts, logging and
# memory options are dropped too, and change neither
_DROPPED_FIELDS = ("graph_optimization_level", "enable_profiling", "profile_file_prefix",
                   "optimized_model_filepath")
# the onnxruntime session config entries that change what an onnxtrain session loads or writes (the others
# it does not apply: onnxruntime dropping them makes no difference)
_ENTRIES_READ = (_DATA_FILE, _DATA_MIN_BYTES, "session.model_external_initializers_file_folder_path")


def _plain(value: Any) -> Any:
    """A field's value comparable across onnxtrain's and onnxruntime's enums (an enum by its name)."""
    name = getattr(value, "name", None)
    return name if isinstance(name, str) else value


def warn_options_model_config_drops(options: Any, model: onnx.ModelProto) -> None:
    """With ORT_LOAD_CONFIG_FROM_MODEL=1 onnxruntime 1.32 makes the session with default options and those of
    the model's ``ort_config`` only: every field, config entry, initializer and free dimension override the
    caller set is dropped (checked: an add_initializer weight is not used, optimized_model_filepath is not
    written). onnxtrain keeps the caller's (the model's ``ort_config`` over them): warn naming those
    onnxruntime would drop that change what onnxtrain computes, loads or writes, so that a difference of
    values or files is not silent."""
    text = next((p.value for p in model.metadata_props if p.key == "ort_config"), None)
    try:
        config = json.loads(text) if text is not None else {}
        from_model = set(config.get("session_options", {})) if isinstance(config, dict) else set()
    except (ValueError, TypeError, AttributeError):
        from_model = set()  # (options_from_model refuses it)
    defaults = SessionOptions()
    dropped = []
    for key in _DROPPED_FIELDS:
        value = getattr(options, key, getattr(defaults, key))
        default = getattr(defaults, key)
        if key not in from_model and _plain(value) != _plain(default):
            dropped.append(key)
    dropped += [f"config entry {k}" for k in config_entries(options) if k in _ENTRIES_READ]
    for attr, what in (("_initializers", "add_initializer"), ("_dims", "free dimension overrides"),
                       ("_files_in_memory", "add_external_initializers_from_files_in_memory")):
        if getattr(options, attr, None):
            dropped.append(what)
    if dropped:
        warn(f"ORT_LOAD_CONFIG_FROM_MODEL=1: onnxruntime makes the session with default options and the "
             f"model's ort_config only, dropping the SessionOptions' {', '.join(dropped)}; onnxtrain applies "
             "them (the model's ort_config over them), so its values or files may differ from onnxruntime's")


def check_severity(level: Any, owner: str) -> None:
    """Refuse a ``log_severity_level`` onnxruntime refuses: −1 (the default logger's) and 0..4 are valid."""
    if isinstance(level, bool) or not isinstance(level, (int, np.integer)) or not -1 <= level <= 4:
        raise FailValueError(f"{owner}.log_severity_level must be -1 (the default logger's) or 0 (verbose) "
                             f"to 4 (fatal), got {level!r}")


def load_with_options(path_or_bytes: str | bytes | os.PathLike | onnx.ModelProto,
                      options: Any) -> onnx.ModelProto:
    """The model a session of ``options`` runs: loaded (its external data from the folder of config entry
    ``session.model_external_initializers_file_folder_path`` or from ``add_external_initializers``), with
    the initializers and free dimensions the options override (:func:`with_option_overrides`)."""
    folder = config_entry(options, "session.model_external_initializers_file_folder_path")
    supplied = getattr(options, "_initializers", {})
    in_memory = getattr(options, "_files_in_memory", None)
    return with_option_overrides(load_model(path_or_bytes, folder, supplied, in_memory), options)


def with_option_overrides(model: onnx.ModelProto, options: Any) -> onnx.ModelProto:
    """``model`` with the initializers and free dimensions ``options`` override (``add_initializer``,
    ``add_free_dimension_override_by_name/denotation``, in the inputs' and outputs' declarations; a copy), or
    ``model`` itself without any. An ``add_initializer`` name the model lacks is skipped, as onnxruntime skips
    it (one ``SessionOptions`` may hold the weights several models share); an ``add_external_initializers``
    one is an error, as there."""
    inits, dims = getattr(options, "_initializers", {}), getattr(options, "_dims", {})
    if not inits and not dims:
        return model
    from onnx import numpy_helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    known = {t.name: t for t in g.initializer}
    for name, value in inits.items():
        if name not in known:
            if name in getattr(options, "_external", ()):  # onnxruntime fails on these, skips the others
                raise FailValueError(f"add_external_initializers: {name!r} is not an initializer of the "
                                     f"model ({sorted(known)[:10]})")
            continue
        array = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
        old = known[name]
        wanted = onnx.helper.tensor_dtype_to_np_dtype(old.data_type)
        if list(array.shape) != list(old.dims) or array.dtype != wanted:
            raise FailValueError(f"add_initializer: {name!r} is {array.dtype}{list(array.shape)}, the "
                                 f"model's is {wanted}{list(old.dims)}")
        old.CopyFrom(numpy_helper.from_array(array, name))
    for v in g.input:
        _fix_dims(v, dims)
    if dims:  # the outputs' sizes as inference finds them from the fixed inputs (onnxruntime's resolve),
        _inferred_output_sizes(out)  # else as the overrides name them
        for v in g.output:
            _fix_dims(v, dims)
    return out


def supplied_arrays(model: onnx.ModelProto, options: Any) -> dict[str, np.ndarray]:
    """The ``add_initializer`` values of ``model``'s initializers as arrays (checked against the model by
    :func:`with_option_overrides`), for the numpy plan to read in place of copies of its own: the session
    holds the caller's memory, as onnxruntime does."""
    names = {t.name for t in model.graph.initializer}
    out = {}
    for name, value in getattr(options, "_initializers", {}).items():
        if name in names:
            array = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
            # (np.ascontiguousarray would make a 0-d array [1])
            out[name] = array if array.flags.c_contiguous else np.array(array, order="C")
    return out


def _fix_dims(v: onnx.ValueInfoProto, dims: Mapping[tuple[str, str], int]) -> None:
    """Give the dims of ``v`` the overrides name (by symbol or denotation) their sizes, in place."""
    if v.type.HasField("tensor_type"):
        for d in v.type.tensor_type.shape.dim:
            size = dims.get(("name", d.dim_param)) if d.HasField("dim_param") else None
            size = dims.get(("denotation", d.denotation), size) if d.denotation else size
            if size is not None:
                d.dim_value = size


def _inferred_output_sizes(model: onnx.ModelProto) -> None:
    """Give ``model``'s outputs (in place) the sizes ONNX shape inference finds for them, where it finds
    one; a model inference fails on keeps its declarations."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    # an overridable initializer's value is not known here (below IR version 4 initializers are constants)
    fed = {i.name for i in probe.graph.input} if model.ir_version >= 4 else set()
    kept = [t for t in probe.graph.initializer if t.name not in fed]
    del probe.graph.initializer[:]
    probe.graph.initializer.extend(kept)
    try:
        inferred = onnx.shape_inference.infer_shapes(probe, strict_mode=False)
    except Exception:  # noqa: BLE001 - the declarations stay as they are
        return
    found = {v.name: v for v in inferred.graph.output}
    for v in model.graph.output:
        other = found.get(v.name)
        if other is None or not v.type.HasField("tensor_type") or not other.type.HasField("tensor_type"):
            continue
        mine, theirs = v.type.tensor_type.shape.dim, other.type.tensor_type.shape.dim
        if v.type.tensor_type.HasField("shape") and len(mine) != len(theirs):
            continue
        if not v.type.tensor_type.HasField("shape"):
            v.type.tensor_type.shape.CopyFrom(other.type.tensor_type.shape)
            continue
        for d, e in zip(mine, theirs):
            if e.HasField("dim_value"):
                d.dim_value = e.dim_value


# session config entries with which onnxruntime computes other values than the numpy engine, which does not
# apply them: key → (the value that asks for it, the lowest graph_optimization_level at which onnxruntime
# applies it, what the engine does instead); measured with onnxruntime 1.32's CPU provider
_NOT_APPLIED = {
    "session.set_denormal_as_zero": (
        "1", 0, "keeps subnormal floats (IEEE), where onnxruntime flushes inputs and results below 1.2e-38 "
                "(float32) to zero"),
    "optimization.enable_cast_chain_elimination": (
        "1", 1, "rounds at every Cast of a chain (float32 → float16 → float32 rounds to float16), where "
                "onnxruntime removes the chain's inner Casts"),
    "optimization.enable_gelu_approximation": (
        "1", 2, "computes an exported GELU (x·½·(1 + erf(x/√2))) exactly, where onnxruntime replaces it by "
                "its tanh approximation (up to 5e-4 apart)"),
    "session.enable_quant_qdq_cleanup": (
        "1", 2, "rounds at every QuantizeLinear → DequantizeLinear pair, where onnxruntime removes the pair"),
}


def warn_config_not_applied(options: Any) -> None:
    """Warn of each session config entry of ``options`` that asks, at the options' graph optimization level,
    for what the numpy engine does not do (:data:`_NOT_APPLIED`), naming it: a run's values would differ
    from onnxruntime's without a word."""
    level = getattr(options, "graph_optimization_level", None)
    level = int(GraphOptimizationLevel.ORT_ENABLE_ALL if level is None else level)
    for key, (value, lowest, instead) in _NOT_APPLIED.items():
        if config_entry(options, key) == value and level >= lowest:
            warn(f"session config entry {key} = {value!r} has no effect on the numpy engine, which "
                 f"{instead}: such values differ (the onnxruntime backend, config entry onnxtrain.backend, "
                 "applies it)")


# onnxruntime's session config keys for a CPU session (those of onnxruntime 1.32 that change what a CPU
# session computes, how it runs, or what it writes: the keys its library holds, less those of other
# providers, EP context models, compiling and MoE offload; session.disable_optimizers is onnxtrain's own,
# which the backend gives onnxruntime as disabled_optimizers): onnxruntime's own SessionOptions cannot list
# their entries, so these are read from them one by one (config_entries)
ORT_SESSION_KEYS = tuple(f"session.{k}" for k in (
    "set_denormal_as_zero", "disable_prepacking", "use_env_allocators", "save_model_format",
    "load_model_format", "disable_cpu_ep_fallback", "disable_optimizers", "enable_quant_qdq_cleanup",
    "disable_quant_qdq", "disable_double_qdq_remover", "disable_qdq_constant_folding", "qdqisint8allowed",
    "x64quantprecision", "enable_dq_matmulnbits_fusion", "qdq_matmulnbits_accuracy_level",
    "qdq_matmulnbits_block_size", "inter_op.allow_spinning", "intra_op.allow_spinning",
    "intra_op.spin_duration_us", "inter_op.spin_duration_us", "intra_op_thread_affinities",
    "force_spinning_stop", "dynamic_block_base", "allow_released_opsets_only", "strict_shape_type_inference",
    "graph_optimizations_loop_level", "disable_aot_function_inlining", "record_ep_graph_assignment_info",
    "optimized_model_external_initializers_file_name",
    "optimized_model_external_initializers_min_size_in_bytes", "model_external_initializers_file_folder_path",
    "use_device_allocator_for_initializers", "use_ort_model_bytes_for_initializers",
    "save_external_prepacked_constant_initializers", "prepack.enable_parallel",
    "collect_node_memory_stats_to_file", "node_partition_config_file",
    "intra_op.spin_backoff_max", "inter_op.spin_backoff_max", "kernel_dispatch_policy",
    "function_expansion_byte_limit", "function_expansion_node_limit", "max_shape_override",
    "gqa_value_layout", "debug_layout_transformation", "strict_workspace_verification",
    "use_external_initializer_file_buffers_directly", "external_data_loader.chunk_bytes",
    "external_data_loader.min_size_bytes", "external_data_loader.pinned_memory_bytes",
    "external_data_loader.threads",
)) + tuple(f"mlas.{k}" for k in (
    "disable_kleidiai", "kleidiai.conv_igemm_max_work", "nchwc_depthwise_sliding",
    "nchwc_pointwise_conv_max_input_channel_batch", "qnbit.force_fp32", "use_lut_gemm",
)) + ("ep.cpu.qmoe_deferred_scale",) + tuple(f"optimization.{k}" for k in (
    "enable_gelu_approximation", "enable_cast_chain_elimination", "disable_specified_optimizers",
    "constant_folding_max_output_size_in_bytes", "minimal_build_optimizations",
))


def config_entries(options: Any) -> dict[str, str]:
    """The session config entries of ``options``: all of onnxtrain's SessionOptions'; of onnxruntime's
    (which cannot list them), those of :data:`ORT_SESSION_KEYS` that are set (an ``onnxtrain.*`` entry is
    read where it is used, with :func:`config_entry`); none of other objects."""
    if isinstance(options, SessionOptions) or hasattr(options, "_config"):
        return dict(getattr(options, "_config", {}) or {})
    if getattr(options, "get_session_config_entry", None) is None:
        return {}
    found = {k: config_entry(options, k) for k in ORT_SESSION_KEYS}
    return {k: v for k, v in found.items() if v is not None}


def config_entry(options: Any, key: str) -> str | None:
    """The session config entry ``key`` of ``options`` as set, unstripped (None when unset): onnxtrain's
    SessionOptions, or onnxruntime's, whose entries cannot be listed but are read one by one (a session
    given onnxruntime's options with an entry that changes its values is warned, or refused, as with
    onnxtrain's)."""
    if isinstance(options, SessionOptions) or hasattr(options, "_config"):
        return dict(getattr(options, "_config", {}) or {}).get(key)
    getter = getattr(options, "get_session_config_entry", None)
    if getter is None:
        return None
    try:
        return str(getter(key))
    except Exception:  # noqa: BLE001 - onnxruntime's RuntimeError for an entry not set
        return None
