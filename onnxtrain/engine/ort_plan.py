"""The onnxruntime backend's plan: a graph run by ``onnxruntime.InferenceSession`` with the interface of
:class:`~onnxtrain.engine.plan.Plan`, its arrays bound through an IOBinding (see
:mod:`onnxtrain.engine.backends` for how a session picks it)."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from onnxtrain.engine.allocator import release_free_memory
from onnxtrain.engine.backends import import_onnxruntime, optimizations_off, resolve_providers
from onnxtrain.engine.donation import check_fed, donatable
from onnxtrain.engine.failure_classes import NodeRuntimeException, ort_failure_class
from onnxtrain.engine.interface import (
    RUN_OPTIONS,
    EngineError,
    GraphInterface,
    InvalidNodeError,
    ProfileEvent,
    TensorArrays,
    Terminated,
    heavy_bytes,
    repeats_copied,
    without_values,
)
from onnxtrain.engine.ort_chunks import layout_for_pieces, piece_count, split_models
from onnxtrain.engine.ort_inplace import safe_updates
from onnxtrain.engine.ort_optimizers import DISABLED_OPTIMIZERS, disabled_optimizers
from onnxtrain.engine.ort_rewrites import for_onnxruntime, label_range_error, label_range_messages
from onnxtrain.engine.ort_sums import two_level_sum_squares
from onnxtrain.engine.parallel import default_width, local_ranks
from onnxtrain.ir.types import np_dtype, np_dtype_of, onnx_elem_type, value_info_shape
from onnxtrain.session_loading import config_entries

SPIN_KEY = "session.intra_op.allow_spinning"
ENV_ALLOCATORS_KEY = "session.use_env_allocators"
STOP_KEY = "session.force_spinning_stop"  # "1": the threads stop spinning as soon as a run ends
# a node event's arguments a ProfileEvent holds in fields of its own (the others go to its ``stats``)
_WRITTEN_ARGS = frozenset({"op_name", "input_type_shape", "output_type_shape", "output_size", "node_index",
                           "provider"})

RELEASE_AFTER_BYTES = 32 << 20  # weights loaded from which a plan gives freed memory back (see __init__)
_arena_lock = threading.Lock()
_arena: list[bool] = []  # [registered]: shared_cpu_arena's result, once per process


def intra_op_threads(options: Any) -> int | None:
    """The intra-op threads onnxruntime runs a plan's graph on under ``options``: theirs when set above 0,
    else this rank's share of the host's CPUs in an MPI job of several ranks here, else None (its own
    default)."""
    intra = getattr(options, "intra_op_num_threads", None)
    if isinstance(intra, int) and intra > 0:
        return intra
    return default_width() if local_ranks() > 1 else None


def _unread_feed(tp: onnx.TypeProto) -> np.ndarray:
    """An empty array of a tensor input's type and declared rank (its unnamed and symbolic dims 0, its fixed
    ones as declared), fed for an input that a path-only run does not read."""
    dims = value_info_shape(tp) or []
    return np.zeros([d if isinstance(d, int) else 0 for d in dims], np_dtype_of(tp))


def _without_model_bytes(session: Any) -> Any:
    """``session`` without the serialized model its Python wrapper keeps to rebuild itself when a run on a
    GPU provider falls back to the CPU (a second copy of every weight): dropped on CPU-only sessions,
    which never fall back."""
    if session.get_providers() == ["CPUExecutionProvider"] and getattr(session, "_model_bytes", None):
        session._model_bytes = None
    return session


def shared_cpu_arena(ort: Any) -> bool:
    """Register once per process, in onnxruntime's environment, one CPU arena that grows by what each
    allocation asks (not by powers of two) for the backend's sessions to share; False when onnxruntime
    refuses (e.g. the process registered one of its own). A training step's graph and its optimizer's then
    reuse one pool: peak RSS of the MLP at batch 64, ``Module`` 104.8 -> 101.6 MiB, legacy 110.9 -> 109.7,
    LeNet 94.4 -> 93.3 (2026-11-29, 20 steps)."""
    with _arena_lock:
        if not _arena:
            try:
                cpu = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                        ort.OrtMemType.DEFAULT)
                # max memory 0 (no limit), extend strategy 1 (kSameAsRequested), defaults for the rest
                ort.create_and_register_allocator(cpu, ort.OrtArenaCfg(0, 1, -1, -1))
                _arena.append(True)
            except Exception:
                _arena.append(False)
        return _arena[0]


class OrtPlan(GraphInterface):
    """A graph run by ``onnxruntime.InferenceSession``, with the interface of :class:`Plan`.

    Each onnxruntime session has its own intra-op threads, which by default spin a while after each
    parallel section before they sleep, also after the run has ended. Two sessions run in turn (a training
    graph, then its optimizer) would each keep a core spinning while the other works: GPT step 33-39 ms
    with both spinning, 21-26 ms with the optimizer's threads not spinning at all. A ``follower`` plan's
    threads therefore spin during its run and stop as soon as it ends (``session.force_spinning_stop =
    1``, unless the caller's options set that entry), so that they neither steal the next graph's cores
    nor sleep between its own nodes. Against not spinning at all (bench, on-device API): MLP step at batch
    64 1.74 -> 1.42 ms, at batch 256 4.57 -> 4.03 ms, transformer 26.7 -> 25.3 ms, GPT 16.7 -> 16.3 ms.
    """

    backend = "onnxruntime"

    def __init__(self, model: onnx.ModelProto | str | bytes, providers: Sequence[Any] | None = None,
                 options: Any = None, provider_options: Sequence[dict] | None = None,
                 follower: bool = False, updates: Mapping[str, str] | None = None,
                 keep_binding: bool = False, scalar_inputs: Collection[str] | None = None):
        ort = import_onnxruntime()
        self._ort = ort
        self._follower = follower
        self._keep_binding = keep_binding
        model = self._read_interface(model, convert=False)  # (onnxruntime reads the model's tensors)
        g = model.graph
        self.peak_bytes = 0
        self.profiling = False
        self.profile: list[ProfileEvent] = []
        # onnxruntime traces each node itself when the options ask for a profile (see drained_profile)
        self._ort_profiling = bool(getattr(options, "enable_profiling", False))
        names, opts = resolve_providers("onnxruntime", providers, provider_options)
        self.providers = names
        self._device = "cuda" if names[0] == "CUDAExecutionProvider" else "cpu"
        # tensors only go through the IOBinding; sequences/optionals take session.run
        self._tensor_io = all(v.type.HasField("tensor_type") for v in (*g.input, *g.output))
        # onnxtrain's own rewrites (onnxtrain/engine/ort_rewrites.py): the label losses' check, and those
        # that speed it up unless optimisations are off
        # (onnxruntime's own default on a host of one CPU is one thread: its scatters cannot race there)
        threads = intra_op_threads(options) or (1 if os.cpu_count() == 1 else None)
        self.onnxruntime_model = for_onnxruntime(model, optimise=not optimizations_off(options),
                                                 threads=threads)
        # the labels' range checks: the node that fails → the loss and the error raised then
        self._label_checks = label_range_messages(self.onnxruntime_model)
        # a large elementwise graph (an optimizer's update) runs piece by piece (see ort_chunks)
        self._chunks = (layout_for_pieces(self.onnxruntime_model, scalar_inputs)
                        if scalar_inputs is not None and self._tensor_io and self._device == "cpu" else None)
        self._prefix = None  # (its session, its inputs) when the pieces read reduced scalars
        # sums of squares over large tensors (a clipped update's norm) in two levels, for their rounding
        squares = (lambda m: m) if optimizations_off(options) else two_level_sum_squares
        if self._chunks is not None:
            prefix, main = split_models(self.onnxruntime_model, self._chunks)
            if prefix is not None:
                prefix = squares(prefix)
                self._prefix = (self._create_session(prefix, options, names, opts),
                                [vi.name for vi in prefix.graph.input])
            self._session = self._create_session(main, options, names, opts)
            self._piece_inputs = {vi.name for vi in main.graph.input}
        else:
            self.onnxruntime_model = squares(self.onnxruntime_model)
            self._session = self._create_session(self.onnxruntime_model, options, names, opts)
        # overridable initializers cannot be bound (onnxruntime's IOBinding knows the inputs proper only); a
        # run in pieces binds what its two graphs read of the inputs (an optimizer's: all of them are inputs)
        self._bindable = ({i.name for i in self._session.get_inputs()} if self._chunks is None
                          else set(self.input_info))
        # output → the input whose array it may be written into, when that input is donated (CPU only);
        # judged on the graph onnxruntime runs, whose rewrites may add readers of an input
        self._inplace = (safe_updates(self.onnxruntime_model, updates)
                         if updates and self._device == "cpu" else {})
        # onnxruntime holds the weights now: the plan keeps their names, types and dims (and the values of
        # small tensors), so that a session holds its weights once (192 MiB of them: 868 -> 290 MiB)
        released = heavy_bytes(self.model)
        self.onnxruntime_model = without_values(self.onnxruntime_model)
        self._hold_model(without_values(self.model))
        self.initializers = TensorArrays(self.model.graph)
        if released >= RELEASE_AFTER_BYTES:  # the model's copies made to load it are freed: not kept
            release_free_memory()
        # the IOBinding kept from run to run (see _run_bound), and the lock of the run using it
        self._kept: _KeptBinding | None = None
        self._kept_lock = threading.Lock()
        # the shared arena grows by what is asked: a run on new shapes shrinks it afterwards (see _shrink)
        self._shapes: tuple | None = None
        self._shrink_options: Any = None

    def _session_options(self, options: Any, model_name: str = "graph",
                         ours: Sequence[str] = DISABLED_OPTIMIZERS) -> Any:
        """onnxruntime's SessionOptions from ``options``, the optimizers ``ours`` disabled."""
        ort = self._ort
        so = ort.SessionOptions()
        level = getattr(options, "graph_optimization_level", None)
        levels = {int(v): v for v in ort.GraphOptimizationLevel.__members__.values()}
        so.graph_optimization_level = levels.get(int(level) if level is not None else 99,
                                                 ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
        for key in ("intra_op_num_threads", "inter_op_num_threads"):
            value = getattr(options, key, None)
            if isinstance(value, int) and value > 0:
                setattr(so, key, value)
        mode = getattr(options, "execution_mode", None)
        if mode is not None and int(mode) == int(ort.ExecutionMode.ORT_PARALLEL):
            so.execution_mode = ort.ExecutionMode.ORT_PARALLEL
        # the caller's threads, or (MPI ranks sharing a host) this rank's share of the CPUs, as the numpy
        # engine and its BLAS take
        threads = intra_op_threads(options)
        if threads is not None:
            so.intra_op_num_threads = threads
        # onnxruntime's memory planning, as the caller set it (training graphs run one shape per step, so
        # enable_mem_pattern=False lowers the peak without slowing the step: see the README)
        for key in ("enable_mem_pattern", "enable_mem_reuse", "enable_cpu_mem_arena"):
            value = getattr(options, key, None)
            if isinstance(value, bool):
                setattr(so, key, value)
        severity = getattr(options, "log_severity_level", None)
        if isinstance(severity, int):
            so.log_severity_level = severity
        verbosity, logid = getattr(options, "log_verbosity_level", 0), getattr(options, "logid", "")
        if isinstance(verbosity, int) and verbosity:
            so.log_verbosity_level = verbosity
        if isinstance(logid, str) and logid:
            so.logid = logid
        if self._ort_profiling:  # onnxruntime's own file, read and removed by drained_profile
            so.enable_profiling = True
            prefix = getattr(options, "profile_file_prefix", None) or "onnxruntime_profile_"
            so.profile_file_prefix = f"{prefix}onnxruntime_{model_name}_"
        if getattr(options, "use_deterministic_compute", False):
            so.use_deterministic_compute = True
        so.execution_order = self._execution_order(options)
        # the caller's session config entries go to onnxruntime (ours, "onnxtrain.*", stay here); the
        # optimizers we must disable are added to any the caller disables
        config = config_entries(options)  # (onnxruntime's own SessionOptions: the keys onnxtrain knows)
        disabled = [x for x in config.pop("session.disable_optimizers", "").split(",") if x]
        for key, value in config.items():
            if not key.startswith("onnxtrain."):
                so.add_session_config_entry(key, value)
        # the graphs of a training step (kept bindings) share the arena; an inference or evaluation graph,
        # whose shapes vary more, keeps its own, as onnxruntime's sessions do
        self._shared_arena = (self._device == "cpu" and self._keep_binding
                              and ENV_ALLOCATORS_KEY not in config and so.enable_cpu_mem_arena
                              and shared_cpu_arena(self._ort))
        if self._shared_arena:
            so.add_session_config_entry(ENV_ALLOCATORS_KEY, "1")
        if self._follower and STOP_KEY not in config:
            so.add_session_config_entry(STOP_KEY, "1")
        disabled += [x for x in ours if x not in disabled]
        so.add_session_config_entry("session.disable_optimizers", ",".join(disabled))
        return so

    def _execution_order(self, options: Any) -> Any:
        """The options' ``execution_order`` when they carry one (onnxruntime's ``SessionOptions`` always
        do), else ``PRIORITY_BASED``: onnxruntime then runs the nodes in the graph's own order (by node
        index), which onnxtrain writes forward, backward, update. onnxruntime's ``DEFAULT`` order, a
        depth-first walk back from the outputs, keeps more activations alive in a training graph:
        measured peak RSS of the transformer step 195-199 → 168-171 MiB, GPT 168-173 → 155-161 MiB, the
        MLP and CNN within 4 MiB either way, step times unchanged."""
        ort = self._ort
        value = getattr(options, "execution_order", None)
        if value is None:
            return ort.ExecutionOrder.PRIORITY_BASED
        if isinstance(value, ort.ExecutionOrder):
            return value
        members = ort.ExecutionOrder.__members__
        key = getattr(value, "name", value)  # a name, or an enum of onnxtrain's or another's by its name
        if isinstance(key, str):
            order = members.get(key.upper())
        else:
            order = {int(v): v for v in members.values()}.get(value) if isinstance(value, int) else None
        if order is None:
            raise ValueError(f"SessionOptions.execution_order: unknown value {value!r}; valid: "
                             f"{', '.join(members)}")
        return order

    def _create_session(self, model: onnx.ModelProto, options: Any, names: list[str],
                        opts: list[dict]) -> Any:
        ort = self._ort
        ours = disabled_optimizers(model)
        so = self._session_options(options, model.graph.name or "graph", ours)
        # onnxruntime reads no config entry session.disable_optimizers (1.32 ignores it): the caller's
        # disabled optimizers and ours reach it as InferenceSession's disabled_optimizers only
        disabled = [x for x in so.get_session_config_entry("session.disable_optimizers").split(",") if x]
        kw = {"providers": names, "provider_options": opts, "disabled_optimizers": disabled}
        model = self._outside_the_proto(model, so)
        try:
            return _without_model_bytes(ort.InferenceSession(model.SerializeToString(), so, **kw))
        except Exception as e:
            if "IR version" not in str(e):
                # a node its schema does not allow: the InvalidNodeError the numpy engine raises, with
                # onnxruntime's words (its own check is not loaded here: the backend's memory)
                cls = InvalidNodeError if _invalid_node(e) else EngineError
                raise cls(f"onnxruntime could not load the graph {model.graph.name!r}: {e}"
                          f"{_bfloat16_hint(model, e)}") from None
            first = e
        # an IR version newer than this onnxruntime reads: the lowest one the opsets allow
        lowered = onnx.ModelProto()
        lowered.CopyFrom(model)
        lowered.ir_version = onnx.helper.find_min_ir_version_for(list(model.opset_import),
                                                                 ignore_unknown=True)
        try:
            return _without_model_bytes(ort.InferenceSession(lowered.SerializeToString(), so, **kw))
        except Exception as e:
            raise EngineError(f"onnxruntime could not load the graph {model.graph.name!r} (IR version "
                              f"{model.ir_version}: {first}; lowered to {lowered.ir_version}: {e})") from None

    def _outside_the_proto(self, model: onnx.ModelProto, so: Any) -> onnx.ModelProto:
        """``model`` itself, or past protobuf's 2 GiB (it cannot be serialized) a skeleton whose large
        initializers onnxruntime takes from memory (``add_external_initializers`` on ``so``; the arrays
        are kept with the plan, which onnxruntime reads without copying)."""
        from onnxtrain.ir.large import external_skeleton, is_large

        if not is_large(model):
            return model
        skeleton, moved = external_skeleton(model)
        values = [numpy_helper.to_array(t) for t in moved]
        self._external_values = getattr(self, "_external_values", []) + values
        so.add_external_initializers([t.name for t in moved],
                                     [self._ort.OrtValue.ortvalue_from_numpy(v) for v in values])
        return skeleton

    # ---- running ---------------------------------------------------------------------
    def run(self, feeds: Mapping[str, Any], output_names: Sequence[str] | None = None,
            overrides: Mapping[str, Any] | None = None, donate: Collection[str] = (),
            reuse: Mapping[str, np.ndarray] | None = None, path_only: bool = False) -> list[np.ndarray]:
        """Run the graph on ``feeds`` (name → array) and return the requested outputs as numpy arrays.
        ``path_only``: only the nodes on the outputs' path run (onnxruntime's
        ``only_execute_path_to_fetches``), and the inputs not fed are fed empty (onnxruntime checks that each
        is there; none of them is read).
        ``donate``: feeds the run may overwrite; an output paired with one of them by ``updates`` comes back
        in that very array when the graph allows it (see :mod:`onnxtrain.engine.ort_inplace`). ``reuse``:
        output name → an array the caller is done with; the output is written into it (and comes back in
        it) when it has the output's static shape and type, so that a step's outputs (gradients) stay in
        the same memory from step to step instead of onnxruntime's arena holding two generations of them."""
        check_fed(feeds, donate)
        if overrides:
            feeds = {**feeds, **overrides}
        asked = list(self.output_names) if output_names is None else list(output_names)
        for n in asked:
            if n not in self.output_info:
                raise EngineError(f"unknown output {n!r}; graph outputs: {self.output_names}")
        names = list(dict.fromkeys(asked))  # each once: onnxruntime's binding holds a name once
        arrays: dict[str, Any] = {}
        bindable = self._tensor_io
        for name, v in feeds.items():
            if name not in self.input_info:
                raise EngineError(f"unknown feed {name!r}; graph inputs: {self.all_input_names}")
            if name not in self._bindable:
                bindable = False
            if isinstance(v, np.ndarray):
                if not v.flags.c_contiguous:
                    v = np.ascontiguousarray(v)
            elif not isinstance(v, (list, tuple)) and v is not None:
                v = np.asarray(v)
            if not isinstance(v, np.ndarray) or v.dtype.kind in "OUS":
                bindable = False
            arrays[name] = v
        into = self._donated_outputs(arrays, names, donate) if bindable and donate and self._inplace else {}
        if reuse and bindable and self._device == "cpu":
            into.update(self._reused_outputs(reuse, names, into, arrays))
        if path_only:
            arrays.update((n, _unread_feed(self.input_info[n].type))
                          for n in self.input_names if n not in arrays)
        t0 = time.perf_counter_ns()
        ro = self._shrink(arrays)
        given = RUN_OPTIONS.get()
        if path_only or given is not None:
            ro = self._run_options(given, shrink=ro is not None, path_only=path_only)
        # (onnxtrain's RunOptions forward terminate to it), but not to a run that writes state in place: a
        # stop there would leave the weights and moments half updated
        linked = getattr(given, "_linked", None) if not into else None
        if linked is not None:
            linked.append(ro)
        try:
            if self._chunks is not None:
                out = self._run_pieces(arrays, names, into, ro, whole=path_only)
            elif bindable:
                out = self._run_bound(arrays, names, into, ro)
            else:
                out = self._session.run(names, arrays, ro)
        except Exception as e:
            if getattr(given, "terminate", False):
                raise Terminated(f"Exiting due to terminate flag being set to true (RunOptions.terminate): "
                                 f"onnxruntime stopped running graph {self.model.graph.name!r}") from None
            shapes = ", ".join(f"{n}: {getattr(v, 'dtype', type(v).__name__)}{list(np.shape(v))}"
                               for n, v in arrays.items() if not isinstance(v, (list, tuple)))
            refused = label_range_error(self._label_checks, str(e))
            if refused is not None:  # a label out of range: the numpy engine's error
                loss, why = refused
                raise NodeRuntimeException(f"{loss} failed in graph {self.model.graph.name!r} on inputs "
                                           f"[{shapes}]: ValueError: {why}") from None
            raise ort_failure_class(e)(f"onnxruntime failed running graph {self.model.graph.name!r} on "
                                       f"[{shapes}]: {type(e).__name__}: {e}") from e
        finally:
            if linked is not None:
                linked.remove(ro)
        if self.profiling and not self._ort_profiling:  # (onnxruntime's own trace ended: one event a run)
            self.profile.append(ProfileEvent("onnxruntime_run", "onnxruntime", t0,
                                             time.perf_counter_ns() - t0,
                                             [list(np.shape(v)) for v in arrays.values()]))
        self.peak_bytes = sum(getattr(v, "nbytes", 0) for v in arrays.values()) + sum(
            getattr(v, "nbytes", 0) for v in out)
        if len(names) < len(asked):  # a name asked for again: run once, then a copy each further time
            got = dict(zip(names, out))
            out = repeats_copied(asked, [got[n] for n in asked])
        return out

    def _shrink(self, arrays: Mapping[str, Any]) -> Any:
        """Run options that give the shared CPU arena's free regions back at the end of the run, when the
        fed shapes differ from the last run's (None otherwise). That arena grows by exactly what is asked,
        so regions sized for other shapes would stay unused: training LeNet over batch sizes 1..128 held
        892 MiB where onnxruntime-training holds 106; a run on the shapes of the last costs nothing."""
        shapes = tuple(getattr(v, "shape", None) for v in arrays.values())
        if shapes == self._shapes or not self._shared_arena:
            self._shapes = shapes
            return None
        first = self._shapes is None
        self._shapes = shapes
        if first:
            return None
        if self._shrink_options is None:
            ro = self._ort.RunOptions()
            ro.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
            self._shrink_options = ro
        return self._shrink_options

    def _run_options(self, given: Any, shrink: bool, path_only: bool) -> Any:
        """onnxruntime run options for a run that shrinks the arena after it (``shrink``), runs only the
        nodes on the fetched outputs' path (``path_only``) and takes the logging fields and run config
        entries of the caller's :class:`~onnxtrain.capi.options.RunOptions` ``given`` (None: none; its
        ``only_execute_path_to_fetches`` and ``training_mode`` are the session's to apply, and its
        ``terminate`` is checked before the run and forwarded during it)."""
        ro = self._ort.RunOptions()
        if given is not None:
            ro.log_severity_level = int(getattr(given, "log_severity_level", -1))
            ro.log_verbosity_level = int(getattr(given, "log_verbosity_level", 0))
            ro.logid = str(getattr(given, "logid", "") or getattr(given, "run_tag", ""))
            for key, value in getattr(given, "_config", {}).items():
                if not key.startswith("onnxtrain."):
                    ro.add_run_config_entry(key, value)
            ro.terminate = bool(getattr(given, "terminate", False))
        if shrink:
            ro.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        ro.only_execute_path_to_fetches = path_only
        return ro

    def drained_profile(self) -> list[ProfileEvent]:
        """onnxruntime's per-node events of the runs so far (its "Node" kernel times), on this process's
        ``perf_counter_ns`` clock as the numpy engine's events; its trace file is removed. onnxruntime's
        profiling ends here, as its ``end_profiling`` ends it (a plan still profiling logs a run an event)."""
        if not self._ort_profiling:
            return []
        self._ort_profiling = False
        path = self._session.end_profiling()
        if not path:
            return []
        import json
        import os

        try:
            with open(path, encoding="utf-8") as f:
                events = json.load(f)
        finally:
            os.remove(path)
        # onnxruntime's event times are µs since its profiling started, a wall-clock time in ns
        origin = self._session.get_profiling_start_time_ns() - (time.time_ns() - time.perf_counter_ns())
        out = []
        for e in events:
            name = e.get("name", "")
            if e.get("cat") != "Node" or not name.endswith("_kernel_time"):
                continue
            args = e.get("args", {})
            index = args.get("node_index")
            out.append(ProfileEvent(name[: -len("_kernel_time")], args.get("op_name", ""),
                                    origin + int(e["ts"] * 1000), int(e["dur"] * 1000),
                                    list(args.get("input_type_shape", [])),
                                    outputs=list(args.get("output_type_shape", [])),
                                    output_bytes=int(args.get("output_size", 0) or 0),
                                    index=int(index) if str(index).isdigit() else None,
                                    stats={k: v for k, v in args.items() if k not in _WRITTEN_ARGS}))
        return out

    def _donated_outputs(self, arrays: Mapping[str, np.ndarray], names: list[str],
                         donate: Collection[str]) -> dict[str, np.ndarray]:
        """Requested outputs → the donated input arrays they are written into: inputs paired with them
        by ``updates`` that the graph allows to be overwritten, whose arrays the run may overwrite
        (``donation.donatable``) and have the declared shape and type."""
        given = donatable(arrays, donate)
        into = {}
        for o in names:
            x = self._inplace.get(o)
            v = given.get(x) if x is not None else None
            if v is not None and list(v.shape) == self.input_shapes.get(x) \
                    and v.dtype == self.input_dtypes.get(x):
                into[o] = v
        return into

    def _reused_outputs(self, reuse: Mapping[str, np.ndarray], names: list[str],
                        taken: Mapping[str, np.ndarray], inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The entries of ``reuse`` that outputs ``names`` can be written into: a writeable C-contiguous
        array of the output's static shape and type, neither given to another output nor fed as an input
        (a view of a fed array is the caller's mistake: ``reuse`` says the array's contents are free)."""
        used = {id(v) for v in (*taken.values(), *inputs.values())}
        out = {}
        for o in names:
            v = reuse.get(o)
            if (o in taken or not isinstance(v, np.ndarray) or id(v) in used or not v.flags.c_contiguous
                    or not v.flags.writeable):
                continue
            if v.dtype == self.output_dtypes[o] and list(v.shape) == self.output_shapes[o]:
                out[o] = v
                used.add(id(v))
        return out

    def release_binding(self) -> None:
        with self._kept_lock:
            self._kept = None

    def _run_bound(self, arrays: Mapping[str, np.ndarray], names: list[str],
                   into: Mapping[str, np.ndarray] | None = None, ro: Any = None) -> list[np.ndarray]:
        """Inputs bound in place (numpy memory); an output of ``into`` is written into the donated array given
        there, the others are freshly allocated by onnxruntime each run, so that they never overwrite an array
        the caller still holds (e.g. last step's weights).

        The binding is kept from one run to the next: an input (or an output of ``into``) is bound again only
        when its array is another object, or has another shape or dtype, since onnxruntime reads a bound
        array's memory when it runs (each step's weights and moments are the same arrays, updated in place).
        Outputs left to onnxruntime are bound afresh each run: a kept one would be overwritten by the next.
        The binding holds its arrays until they are replaced, so only plans made with ``keep_binding`` keep
        it (an inference session must not hold on to the last batch); a run while another thread runs this
        plan binds everything on a binding of its own, too."""
        into = into or {}
        if not self._keep_binding or not self._kept_lock.acquire(blocking=False):
            return self._bind_and_run(_KeptBinding(self._session.io_binding(), names), arrays, names, into,
                                      ro)
        try:
            kept = self._kept
            if kept is None or kept.names != names or kept.inputs.keys() != arrays.keys():
                kept = self._kept = _KeptBinding(self._session.io_binding(), names)
            return self._bind_and_run(kept, arrays, names, into, ro)
        finally:
            self._kept_lock.release()

    def _bind_and_run(self, kept: _KeptBinding, arrays: Mapping[str, np.ndarray], names: list[str],
                      into: Mapping[str, np.ndarray], ro: Any = None) -> list[np.ndarray]:
        io, held_in, held_out = kept.io, kept.inputs, kept.outputs
        for name, v in arrays.items():
            if not _still_bound(held_in.get(name), v):
                if v.dtype in _WHOLE_BYTE_DTYPES:  # bfloat16, float8: no numpy type in onnxruntime's binding
                    io.bind_ortvalue_input(name, self._ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                        v.view(f"u{v.itemsize}"), onnx_elem_type(v.dtype)))
                else:
                    io.bind_cpu_input(name, v)
                held_in[name] = (v, v.shape, v.dtype, v.ctypes.data)
        for n in names:
            v = into.get(n)
            if v is None:
                io.bind_output(n, "cpu")
                held_out.pop(n, None)
                continue
            if not _still_bound(held_out.get(n), v):
                io.bind_output(n, "cpu", 0, v.dtype, list(v.shape), v.ctypes.data)
                held_out[n] = (v, v.shape, v.dtype)
        self._session.run_with_iobinding(io, ro)
        if len(into) == len(names):  # every output written into a donated array (an optimizer's update)
            return [into[n] for n in names]
        # an output onnxruntime passes through from an input (the input itself, an Identity or Reshape of
        # it) is a view of the bound array, which may be a copy the caller never sees, freed after the run
        # (a feed made row-major): such outputs are copied
        fed = {h[3] for h in held_in.values()}
        return [into[n] if n in into else _own(_numpy_of(o, self.output_dtypes.get(n)), o, fed)
                for n, o in zip(names, io.get_outputs())]

    def _run_pieces(self, arrays: Mapping[str, np.ndarray], names: list[str], into: Mapping[str, np.ndarray],
                    ro: Any = None, whole: bool = False) -> list[np.ndarray]:
        """A run of a graph of :class:`~onnxtrain.engine.ort_chunks.ChunkLayout`: its prefix on the whole
        arrays first (the reduced scalars), then the rest as ``piece_count`` runs (``whole``: one), each
        binding every grouped array flat at its piece's address. Outputs go into the donated arrays of
        ``into``, the others into arrays made here at their full size, so that onnxruntime only ever holds
        piece-sized intermediates."""
        layout = self._chunks
        for name, v in arrays.items():
            k = layout.group.get(name)
            if k is not None and not whole and list(v.shape) != layout.shapes[k]:
                raise EngineError(f"input {name!r} is {v.dtype}{list(v.shape)}; the graph declares "
                                  f"{layout.shapes[k]}")
        got: dict[str, np.ndarray] = {}
        if self._prefix is not None:
            session, inputs = self._prefix
            got = dict(zip(layout.reduced, session.run(list(layout.reduced), {n: arrays[n] for n in inputs},
                                                        ro)))
        out = {n: into[n] if n in into else np.empty(layout.shapes[layout.group[n]], self.output_dtypes[n])
               for n in names if n in layout.group}
        io = self._session.io_binding()
        bound = []  # (bind, name, dtype, group, address, itemsize, size) of each grouped input and output
        for name, v in (*arrays.items(), *got.items()):
            if name not in self._piece_inputs:
                continue
            k = layout.group.get(name)
            if k is None:
                io.bind_cpu_input(name, v)
            else:
                bound.append((io.bind_input, name, v.dtype, k, v.ctypes.data, v.itemsize, v.size))
        bound.extend((io.bind_output, n, v.dtype, layout.group[n], v.ctypes.data, v.itemsize, v.size)
                     for n, v in out.items())
        if out:
            for piece in layout.pieces(1 if whole else piece_count(layout)):
                for bind, name, dtype, k, address, itemsize, size in bound:
                    start, stop = (0, size) if whole else piece[k]
                    bind(name, "cpu", 0, dtype, [stop - start], address + start * itemsize)
                self._session.run_with_iobinding(io, ro)
        return [out[n] if n in out else got[n] for n in names]

    def __repr__(self) -> str:
        return f"OrtPlan({self.model.graph.name!r}, providers={self.providers})"


class _KeptBinding:
    """An onnxruntime IOBinding for one list of output names, with the arrays bound to it (input or output
    name → (array, shape, dtype)); holding the arrays keeps alive the memory onnxruntime reads."""

    __slots__ = ("io", "names", "inputs", "outputs")

    def __init__(self, io: Any, names: list[str]):
        self.io = io
        self.names = list(names)
        self.inputs: dict[str, tuple] = {}
        self.outputs: dict[str, tuple] = {}


def _numpy_of(value: Any, dtype: np.dtype | None) -> np.ndarray:
    """An onnxruntime OrtValue's tensor as a numpy array; declared of an ml_dtypes type (``dtype``:
    bfloat16, float8), for which ``OrtValue.numpy`` has no type or gives uint8, its bytes copied."""
    if dtype not in _WHOLE_BYTE_DTYPES:
        return value.numpy()
    out = np.empty(value.shape(), dtype)
    if out.nbytes:
        ctypes.memmove(out.ctypes.data, value.data_ptr(), out.nbytes)
    return out


# the ml_dtypes element types onnxruntime stores a byte or two each, as numpy does (the 4-, 2- and 6-bit
# ones it packs: not these)
_WHOLE_BYTES = ("BFLOAT16", "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ", "FLOAT8E8M0")
_WHOLE_BYTE_DTYPES = frozenset(np_dtype(getattr(onnx.TensorProto, name)) for name in _WHOLE_BYTES
                               if hasattr(onnx.TensorProto, name))


def _own(array: np.ndarray, value: Any, fed: set[int]) -> np.ndarray:
    """``array`` (of OrtValue ``value``), copied when its memory is that of a bound input (at ``fed``)."""
    return array.copy() if array.size and value.data_ptr() in fed else array


def _still_bound(held: tuple | None, v: np.ndarray) -> bool:
    """Whether ``held`` (the array, shape and dtype bound last) is ``v`` as it is now."""
    return held is not None and held[0] is v and held[1] == v.shape and held[2] == v.dtype


def _bfloat16_hint(model: onnx.ModelProto, err: Exception) -> str:
    """For onnxruntime's NOT_IMPLEMENTED on a graph with bfloat16 values (a bfloat16 model's, or mixed
    precision's casts): what to do. Mixed precision casts float32 weights to bfloat16; a stage of a cut
    session's mixed-precision graph also receives bfloat16 activations or gradients, which alone do not make
    it a bfloat16 model."""
    if "NOT_IMPLEMENTED" not in str(err):
        return ""
    bf16, g = onnx.TensorProto.BFLOAT16, model.graph
    casts = [n for n in g.node
             if n.op_type == "Cast" and any(a.name == "to" and a.i == bf16 for a in n.attribute)]
    wide = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE}
    given = {v.name for v in g.input if v.type.tensor_type.elem_type in wide}
    given |= {t.name for t in g.initializer if t.data_type in wide}
    mixed = ("; onnxruntime's CPU provider lacks bfloat16 kernels for ops of this graph (bfloat16 mixed "
             "precision): train on the numpy engine (the default backend) or with float16")
    if any(n.input and n.input[0] in given for n in casts):  # a float32 weight cast: mixed precision
        return mixed
    held = [v.name for v in g.input if v.type.tensor_type.elem_type == bf16]
    held += [t.name for t in g.initializer if t.data_type == bf16]
    if held:  # a bfloat16 model (or bfloat16 state fed in): its own type, not a cast's
        return (f"; onnxruntime's CPU provider lacks bfloat16 kernels for ops of this graph, whose "
                f"{held[0]!r} is bfloat16: train it on the numpy engine (the default backend)")
    return mixed if casts else ""


def _invalid_node(e: Exception) -> bool:
    """Whether onnxruntime refused a graph for a node its schema does not allow (a type or attribute error
    found at load), rather than for another reason (a missing kernel, an IR version)."""
    text = str(e)
    return type(e).__name__ == "InvalidGraph" or "Type Error" in text or "[TypeInferenceError]" in text
