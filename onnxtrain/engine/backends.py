"""Execution backends: the numpy engine (default, the reference) and onnxruntime's inference package.

``make_plan(model, backend)`` returns an object with the interface of :class:`~onnxtrain.engine.plan.Plan`
(``run(feeds, output_names)``, ``input_names``, ``all_input_names``, ``output_names``, ``output_info``,
``initializers``, ``peak_bytes``, ``profiling``/``profile``). The onnxruntime backend hands the same
standard-ONNX graphs (training steps, optimizer updates, inference) to ``onnxruntime.InferenceSession``;
the state stays in the caller's store as numpy arrays, bound through an IOBinding each run (no copy of
the inputs on CPU), and the outputs come back as numpy views of onnxruntime's buffers (no copy either).

The onnxruntime plan lives in :mod:`onnxtrain.engine.ort_plan`, loaded only when a session asks for it.
A session picks its backend with the config entry ``onnxtrain.backend``::

    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    sess = onnxtrain.TrainingSession(model, params, so)
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import onnx

from onnxtrain.ir.graphs import RANDOM_OPS
from onnxtrain.user_warning import warn

if TYPE_CHECKING:
    import numpy as np

BACKENDS = ("numpy", "onnxruntime")
CONFIG_KEY = "onnxtrain.backend"
# session config entry of the numpy engine's batch split (onnxtrain/engine/batch_split.py): "0" off, "1" (the
# default) threads, "process"
BATCH_SPLIT_KEY = "onnxtrain.batch_split"
BATCH_SPLIT_MODES = {"0": "off", "1": "threads", "process": "process"}
_INSTALL_HINT = ("the onnxruntime backend needs the onnxruntime package: pip install onnxruntime "
                 "(or onnxruntime-gpu for CUDA)")


def check_backend(name: str) -> str:
    """``name`` if it is a known backend; ValueError listing the valid names otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"unknown onnxtrain backend {name!r}; valid names: {', '.join(BACKENDS)}")
    return name


def session_config_entry(options: Any, key: str) -> str:
    """The session options' config entry ``key``, stripped ("" when unset). Accepts onnxtrain's or
    onnxruntime's ``SessionOptions`` (or None)."""
    getter = getattr(options, "get_session_config_entry", None)
    if getter is None:
        return ""
    try:
        return str(getter(key)).strip()
    except Exception:  # unset: KeyError from onnxtrain, RuntimeError (or "") from onnxruntime
        return ""


def backend_of(options: Any) -> str:
    """The backend named by the session options' ``onnxtrain.backend`` entry ("numpy" when unset)."""
    return check_backend(session_config_entry(options, CONFIG_KEY) or "numpy")


def batch_split_mode(options: Any) -> str:
    """How the session options (onnxtrain's or onnxruntime's, or None) run the halves of a batch: "off",
    "threads" or "process", from their ``onnxtrain.batch_split`` entry ("1", threads, when unset)."""
    value = session_config_entry(options, BATCH_SPLIT_KEY) or "1"
    if value not in BATCH_SPLIT_MODES:
        raise ValueError(f"session config entry {BATCH_SPLIT_KEY!r} must be one of "
                         f"{', '.join(repr(k) for k in BATCH_SPLIT_MODES)}, got {value!r}")
    return BATCH_SPLIT_MODES[value]


_ort_ready: list[bool] = []  # [True] once import_onnxruntime has passed on the settings made before it
# onnxruntime's switch for its telemetry (1.32 starts a OneDS event uploader on Linux when imported), read
# once, when onnxruntime is imported
TELEMETRY_ENV = "ORT_DISABLE_TELEMETRY"


def load_onnxruntime() -> Any:
    """``import onnxruntime`` with its telemetry off unless the environment sets ``ORT_DISABLE_TELEMETRY``
    (the process's environment is left as it was). onnxruntime 1.32's event uploader holds 2.0-2.5 MiB of
    RSS and a thread from the import on, and starts three more threads now and then to send its events
    (the backend's LeNet step: peak RSS 93.6 -> 91.7 MiB, bench/HISTORY.md 2026-12-07). No effect once
    onnxruntime is imported; ImportError when it is not installed."""
    import os
    import sys

    ours = "onnxruntime" not in sys.modules and TELEMETRY_ENV not in os.environ
    if ours:
        os.environ[TELEMETRY_ENV] = "1"
    try:
        import onnxruntime
    finally:
        if ours:
            os.environ.pop(TELEMETRY_ENV, None)
    return onnxruntime


def import_onnxruntime() -> Any:
    """The ``onnxruntime`` module (:func:`load_onnxruntime`); ImportError with the install command when it
    is missing."""
    try:
        onnxruntime = load_onnxruntime()
    except ImportError as e:
        raise ImportError(f"{_INSTALL_HINT} ({e})") from e
    from onnxtrain.capi.runtime_info import apply_logger_settings
    from onnxtrain.engine.seeds import seed_onnxruntime

    if not _ort_ready:  # settings made before onnxtrain first imported it
        apply_logger_settings(onnxruntime)  # onnxtrain.set_default_logger_severity
        seed_onnxruntime(onnxruntime)  # onnxtrain.set_seed (later calls pass it on themselves)
        _ort_ready.append(True)
    return onnxruntime


def _provider_items(providers: Sequence[Any] | None,
                    provider_options: Sequence[dict] | None) -> list[tuple[str, dict]]:
    """``providers`` (names or ``(name, options)`` pairs) as ``(name, options)`` pairs."""
    if not providers:
        return []
    given = list(provider_options) if provider_options else []
    if given and len(given) != len(providers):
        raise ValueError("providers and provider_options must have the same length")
    out = []
    for k, p in enumerate(providers):
        if isinstance(p, (tuple, list)):
            out.append((str(p[0]), dict(p[1])))
        else:
            out.append((str(p), dict(given[k]) if given else {}))
    return out


def resolve_providers(backend: str, providers: Sequence[Any] | None = None,
                      provider_options: Sequence[dict] | None = None) -> tuple[list[str], list[dict]]:
    """Provider names and options a session of ``backend`` runs with.

    numpy: onnxtrain's CPU provider (see ``onnxtrain.capi.options.resolve_providers``). onnxruntime: the given
    providers onnxruntime reports available, in order (an unavailable one is dropped with a warning, a name
    onnxruntime does not know is a ValueError), CPUExecutionProvider last; by default CUDAExecutionProvider
    first when it is available."""
    if check_backend(backend) == "numpy":
        from onnxtrain.capi.options import resolve_providers as numpy_providers

        return numpy_providers(providers, provider_options)
    ort = import_onnxruntime()
    available = set(ort.get_available_providers())
    items = _provider_items(providers, provider_options)
    known = ort.get_all_providers()
    unknown = [name for name, _ in items if name not in known]
    if unknown:  # as on the numpy engine, and as onnxruntime refuses it
        raise ValueError(f"Unknown Provider Type: {unknown[0]}; valid names: {', '.join(known)}")
    if not items:
        items = [("CUDAExecutionProvider", {})] if "CUDAExecutionProvider" in available else []
    names: list[str] = []
    opts: list[dict] = []
    for name, o in items:
        if name not in available:
            warn(f"{name} is not available in this onnxruntime ({ort.__version__}, available: "
                 f"{', '.join(sorted(available))}); falling back to CPUExecutionProvider")
            continue
        if name not in names:
            names.append(name)
            opts.append({str(k): str(v) for k, v in o.items()})
    if "CPUExecutionProvider" not in names:
        names.append("CPUExecutionProvider")
        opts.append({})
    return names, opts


def make_plan(model: onnx.ModelProto | str | bytes, backend: str = "numpy",
              providers: Sequence[Any] | None = None, options: Any = None,
              provider_options: Sequence[dict] | None = None, follower: bool = False,
              updates: Mapping[str, str] | None = None, keep_binding: bool = False,
              random_state: dict[Any, dict[Any, Any]] | None = None,
              initializers: Mapping[str, np.ndarray] | None = None,
              scalar_inputs: Collection[str] | None = None) -> Any:
    """A compiled graph on ``backend``: a :class:`Plan` (numpy) or an :class:`OrtPlan` (onnxruntime).

    ``providers``/``provider_options`` and ``options`` (a SessionOptions: graph optimisation level,
    thread counts) go to the onnxruntime backend. ``follower``: the graph runs right after another
    onnxruntime graph of the same caller (an optimizer after its training graph), so its threads stop
    spinning as soon as its run ends (see :class:`OrtPlan`). ``updates`` (output name → the input it
    replaces, e.g. a weight's update → the weight): onnxruntime writes such an output into the input's
    array when that input is donated to the run and the graph allows it (the numpy plan finds its own).
    ``keep_binding``: the graph is run again and again on mostly the same arrays (a training step's weights
    and moments), so onnxruntime's IOBinding is kept between runs (see :meth:`OrtPlan._run_bound`).
    The numpy plan is not fused with ``options.enable_profiling`` (one profile event per node of the
    graph) or with ``graph_optimization_level`` ``ORT_DISABLE_ALL``; it splits kernels over
    ``options.intra_op_num_threads`` threads (0: the default width), and runs its nodes one at a time
    whatever ``inter_op_num_threads`` says (a warning says so). ``random_state``: one dict shared by the
    plans of a session, so that a random node in several of its graphs does not repeat its draws: the
    numpy plans share the node's generator; onnxruntime keeps a generator per session, so each later
    plan's copy of a seeded node gets a seed of its own (:func:`_distinct_seeds`). ``initializers``: arrays
    the numpy plan takes for the model's initializers of those names instead of converting its own copies
    (the caller's ``add_initializer`` values, another plan's arrays); onnxruntime reads the model's.
    ``scalar_inputs``: the inputs that are one value for every element of an elementwise graph (an optimizer's
    learning rate and step); given, onnxruntime runs a large such graph piece by piece
    (:mod:`onnxtrain.engine.ort_chunks`)."""
    if check_backend(backend) == "numpy":
        from onnxtrain.engine.plan import Plan  # here: onnxruntime sessions never load the numpy engine

        return Plan(model, fuse=numpy_fuse(options), threads=intra_op_threads(options),
                    random_state=random_state, initializers=initializers)
    from onnxtrain.engine.ort_plan import OrtPlan  # here: numpy sessions never load it

    if random_state is not None and isinstance(model, onnx.ModelProto):
        model = _distinct_seeds(model, random_state)
    if isinstance(model, onnx.ModelProto):
        _warn_float16_products(model)
    from onnxtrain.engine.interface import EngineError

    try:
        return OrtPlan(model, providers, options, provider_options, follower=follower, updates=updates,
                       keep_binding=keep_binding, scalar_inputs=scalar_inputs)
    except EngineError as e:
        raise _as_onnxruntime_raised(e, options) from None


# onnxruntime's exception class (by name) → the name of the EngineError that is also onnxtrain's mirror of
# it (named as onnxruntime's, as a comparison of class names with onnxruntime's expects)
_LOAD_FAILURE_NAMES = {"InvalidArgument": "InvalidArgument", "RuntimeException": "RuntimeException",
                       "NoSuchFile": "NoSuchFile", "InvalidProtobuf": "InvalidProtobuf",
                       "InvalidGraph": "InvalidGraph", "NotImplemented": "NotImplemented", "EPFail": "EPFail",
                       "ValueError": "EngineValueError", "IndexError": "EngineIndexError"}
_LOAD_FAILURES: dict[str, type] = {}  # class name → class, made on first use (the engine's modules load late)


def _load_failure(class_name: str) -> type:
    """The EngineError subclass ``class_name`` of :data:`_LOAD_FAILURE_NAMES` (a module attribute, so that
    its errors pickle)."""
    if not _LOAD_FAILURES:
        from onnxtrain import errors
        from onnxtrain.engine.interface import EngineError
        from onnxtrain.session_loading import FailIndexError

        mirrors = {"InvalidArgument": errors.InvalidArgument, "RuntimeException": errors.RuntimeException,
                   "NoSuchFile": errors.NoSuchFile, "InvalidProtobuf": errors.InvalidProtobuf,
                   "InvalidGraph": errors.InvalidGraph, "NotImplemented": errors.NotImplementedError_,
                   "EPFail": errors.EPFail, "EngineValueError": errors.FailValueError,
                   "EngineIndexError": FailIndexError}
        for name, mirror in mirrors.items():
            _LOAD_FAILURES[name] = type(name, (EngineError, mirror), {
                "__module__": __name__,
                "__doc__": f"onnxruntime refused to load the graph with its {name}: an EngineError and that "
                           "class."})
    return _LOAD_FAILURES[class_name]


def __getattr__(name: str) -> Any:
    if name in _LOAD_FAILURE_NAMES.values():
        return _load_failure(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _as_onnxruntime_raised(e: Exception, options: Any) -> Exception:
    """``e``, the onnxruntime plan's EngineError for a graph onnxruntime did not load, as an instance of the
    class onnxruntime raised too (its InvalidArgument for a bad session config entry, a ValueError...),
    so that ``except`` clauses written for onnxruntime catch it; the message names the caller's session
    config entries when onnxruntime's does not. Other errors are returned as they are."""
    from onnxtrain.engine.interface import EngineError

    raised = e.__context__  # (onnxruntime's exception, which the plan's raise ... from None hides)
    if type(e) is not EngineError or raised is None:
        return e
    module = type(raised).__module__
    name = type(raised).__name__
    if not (module.startswith("onnxruntime") or module == "builtins" and name in _LOAD_FAILURE_NAMES):
        return e
    cls = _load_failure(_LOAD_FAILURE_NAMES[name]) if name in _LOAD_FAILURE_NAMES else EngineError
    message = str(e)
    from onnxtrain.session_loading import config_entries

    given = {k: v for k, v in config_entries(options).items() if not k.startswith("onnxtrain.")}
    if given and not any(k in message for k in given):
        message += " (the session config entries given to onnxruntime: " + \
            ", ".join(f"{k} = {v!r}" for k, v in given.items()) + ")"
    out = cls(message)
    out.__traceback__ = e.__traceback__
    return out


_warned_float16: list[bool] = []


def _warn_float16_products(model: onnx.ModelProto) -> None:
    """Warn once per process when a MatMul, Gemm or Conv of ``model`` reads a value cast to float16 (mixed
    precision) for onnxruntime's CPU provider, which has no float16 kernels of them and computes them in
    float32 (float16 moments or a float16 inference model alone are not told)."""
    half = onnx.TensorProto.FLOAT16
    halves = {n.output[0] for n in model.graph.node if n.op_type == "Cast" and n.output
              and any(a.name == "to" and a.i == half for a in n.attribute)}
    products = ("MatMul", "Gemm", "Conv", "ConvTranspose")
    reads = any(n.op_type in products and halves.intersection(n.input) for n in model.graph.node)
    if _warned_float16 or not reads:
        return
    _warned_float16.append(True)
    warn("the onnxruntime backend (CPU) has no float16 MatMul, Gemm or Conv kernels: onnxruntime computes "
         "them in float32 (it casts around them), so float16 mixed precision there gives float32 products, "
         "and a loss scale that would overflow float16 does not (no step is skipped), nor does an input "
         "value beyond float16's ±65504 (onnxruntime drops its cast to float16 in front of the ops it "
         "computes in float32, such as these and Add/Sub); the numpy engine computes them in float16")


_SEED_STRIDE = 1_000_003  # between the seeds of one node's copies in a session's onnxruntime graphs


def _distinct_seeds(model: onnx.ModelProto, random_state: dict[Any, dict[Any, Any]]) -> onnx.ModelProto:
    """``model``, or a copy whose random nodes already met in an earlier graph of the session draw apart:
    a seeded one takes its seed plus a multiple of a large stride (the n-th graph holding the node: n - 1
    strides), an unseeded one but Dropout a seed from onnxtrain's seed sequence (onnxruntime seeds every
    session's unseeded random kernels alike, so each graph repeated the first one's draws; its Dropouts
    draw from one generator of the process and do not)."""
    out = model
    for k, node in enumerate(model.graph.node):
        if node.op_type not in RANDOM_OPS:
            continue
        seen = random_state.setdefault(node.name or tuple(node.output), {})
        n = seen.get("onnxruntime_graphs", 0)
        seen["onnxruntime_graphs"] = n + 1
        seeded = any(a.name == "seed" for a in node.attribute)
        if n == 0 or (not seeded and node.op_type == "Dropout"):
            continue
        if out is model:
            out = onnx.ModelProto()
            out.CopyFrom(model)
        copy = out.graph.node[k]
        if not seeded:
            from onnxtrain.engine.seeds import unseeded_generator  # (numpy.random loads hashlib)

            drawn = int(unseeded_generator({}).integers(2**24))  # (seed is a float32 attribute: exact)
            copy.attribute.append(onnx.helper.make_attribute("seed", float(drawn)))
            continue
        a = next(a for a in copy.attribute if a.name == "seed")
        if a.type == onnx.AttributeProto.INT:
            a.i = (a.i + n * _SEED_STRIDE) % 2**31
        else:
            a.f += n * _SEED_STRIDE
    return out


def intra_op_threads(options: Any) -> int | None:
    """``options.intra_op_num_threads`` when set above 0 (None: the plan's default, also for a negative count,
    which onnxruntime takes as its default too)."""
    n = getattr(options, "intra_op_num_threads", 0)
    if not isinstance(n, int) or isinstance(n, bool):
        raise ValueError(f"SessionOptions.intra_op_num_threads must be an integer, got {n!r}")
    return n if n > 0 else None


def numpy_fuse(options: Any) -> bool | None:
    """The numpy plan's ``fuse`` for these SessionOptions (None: the default); warns about
    ``inter_op_num_threads`` and onnxruntime's memory options, which the numpy engine has no use for."""
    inter = getattr(options, "inter_op_num_threads", 0)
    if isinstance(inter, int) and inter > 1:
        warn(
            "SessionOptions.inter_op_num_threads has no effect on the numpy engine, which runs a graph's "
            "nodes one at a time (intra_op_num_threads sets how many threads each node may use)"
        )
    mode = getattr(options, "execution_mode", None)
    if mode is not None and int(mode) == 1:  # ORT_PARALLEL
        warn(
            "SessionOptions.execution_mode = ORT_PARALLEL has no effect on the numpy engine, which runs a "
            "graph's nodes one at a time (intra_op_num_threads sets how many threads each node may use)"
        )
    memory = [k for k in ("enable_mem_pattern", "enable_mem_reuse", "enable_cpu_mem_arena")
              if getattr(options, k, True) is False]
    if memory:
        warn(
            f"SessionOptions.{' and '.join(memory)} = False has no effect on the numpy engine, which plans "
            "its own memory (each value freed after its last use; ONNXTRAIN_ALLOCATOR=system returns freed "
            "memory to the system)"
        )
    order = getattr(options, "execution_order", None)
    name = str(getattr(order, "name", order)).upper()
    if order is not None and name not in ("DEFAULT", "0"):
        warn(
            f"SessionOptions.execution_order = {name} has no effect on the numpy engine, which runs the "
            "nodes in the graph's order"
        )
    return fusion_choice(options)


def fusion_choice(options: Any) -> bool | None:
    """The numpy plan's ``fuse`` for these SessionOptions, without :func:`numpy_fuse`'s warnings: off when
    profiling (one event per node of the model) or with graph optimisations off, else None (the default)."""
    return False if getattr(options, "enable_profiling", False) or optimizations_off(options) else None


def optimizations_off(options: Any) -> bool:
    """True when the options' ``graph_optimization_level`` is ``ORT_DISABLE_ALL`` (0)."""
    level = getattr(options, "graph_optimization_level", None)
    return level is not None and int(level) == 0
