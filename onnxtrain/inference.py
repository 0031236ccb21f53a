"""``InferenceSession``: onnxruntime's inference API over the numpy engine."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
import onnx

from onnxtrain.capi.feeds import check_onnxruntime_feed, feed_array, map_feed
from onnxtrain.capi.node_args import inferred_output_types
from onnxtrain.capi.options import (
    RunOptions,
    SessionOptions,
    resolve_providers,
)
from onnxtrain.capi.ortvalue import IOBinding, OrtDevice, OrtValue, OrtValueVector, _type_name
from onnxtrain.capi.outputs import outputs_apart, own_outputs
from onnxtrain.engine.backends import backend_of, batch_split_mode, make_plan
from onnxtrain.engine.backends import resolve_providers as backend_providers
from onnxtrain.engine.feed_sizes import (
    FeedSizeMismatch,
    check_same_sizes,
    same_size_dims,
    shared_dim_mismatch,
)
from onnxtrain.engine.interface import (
    MAX_PROFILE_EVENTS,
    RUN_OPTIONS,
    EngineError,
    GraphInterface,
    ProfileEvent,
    Terminated,
    heavy_arrays,
    without_values,
)
from onnxtrain.errors import (
    Fail,
    InvalidArgument,
    InvalidFeed,
    InvalidFeedType,
    NoneFed,
    RuntimeException,
    raises_as_onnxruntime,
)
from onnxtrain.ir.builder import loadable_model
from onnxtrain.ir.graphs import model_for_outputs, path_to
from onnxtrain.ir.types import np_dtype_of, shape_dims, type_string, value_info_shape
from onnxtrain.model_config_env import (  # noqa: F401 (the sessions import them from here)
    model_config_asked,
    warn_on_device_model_config,
    warn_unread_model_config,
)
from onnxtrain.session_loading import (
    check_severity,
    config_entry,
    load_with_options,
    optimized_model_data,
    optimized_model_path,
    options_from_model,
    options_snapshot,
    refuse_bad_ort_entries,
    refuse_disabled_cpu_fallback,
    supplied_arrays,
    warn_config_not_applied,
    warn_options_model_config_drops,
)
from onnxtrain.session_profiling import end_profiling, profile_session_start
from onnxtrain.user_warning import warn


@dataclass(frozen=True)
class NodeArg:
    """Name, type string (``tensor(float)``) and shape (ints, symbolic names or None; ``[]`` when the graph
    declares none) of an input/output; read-only and hashable, as onnxruntime's."""

    name: str
    type: str
    shape: list[Any]

    def __hash__(self) -> int:
        return hash((self.name, self.type, tuple(self.shape)))

    def __repr__(self) -> str:
        return f"NodeArg(name='{self.name}', type='{self.type}', shape={self.shape})"


@dataclass
class ModelMetadata:
    producer_name: str = ""
    graph_name: str = ""
    domain: str = ""
    description: str = ""
    graph_description: str = ""
    version: int = 0
    custom_metadata_map: dict[str, str] = field(default_factory=dict)


def metadata_of(m: onnx.ModelProto) -> ModelMetadata:
    """The metadata onnxruntime reports for model ``m``."""
    return ModelMetadata(
        m.producer_name,
        m.graph.name,
        m.domain,
        m.doc_string,
        m.graph.doc_string,
        int(m.model_version) if m.HasField("model_version") else 2**63 - 1,  # onnxruntime's "no version"
        {p.key: p.value for p in m.metadata_props},
    )


def node_arg(v: onnx.ValueInfoProto) -> NodeArg:
    tp = v.type
    if tp.HasField("optional_type") and tp.optional_type.elem_type.HasField("tensor_type"):
        tp = tp.optional_type.elem_type  # an optional tensor's shape is its tensor's, as onnxruntime gives it
    shape = value_info_shape(tp)
    if tp.HasField("sparse_tensor_type") and tp.sparse_tensor_type.HasField("shape"):  # its dense shape
        shape = shape_dims(tp.sparse_tensor_type.shape)
    # an unknown shape as [], and a negative dim_value (some converters' unknown size) as None, as
    # onnxruntime gives them
    dims = [] if shape is None else [None if isinstance(d, int) and d < 0 else d for d in shape]
    return NodeArg(v.name, type_string(v.type, "unknown"), dims)


def _typed(v: onnx.ValueInfoProto, tp: onnx.TypeProto | None) -> onnx.ValueInfoProto:
    """``v`` with type ``tp`` (``v`` itself when None)."""
    if tp is None:
        return v
    out = onnx.ValueInfoProto()
    out.CopyFrom(v)
    out.type.CopyFrom(tp)
    return out


@dataclass(frozen=True)
class EpAssignedNode:
    """A node an execution provider runs: its domain, op and name."""

    domain: str
    op_type: str
    name: str


@dataclass(frozen=True)
class EpAssignedSubgraph:
    """Nodes one execution provider runs together (``ep_name``; ``get_nodes()``)."""

    ep_name: str
    nodes: tuple[EpAssignedNode, ...]

    def get_nodes(self) -> list[EpAssignedNode]:
        """The subgraph's nodes, in order."""
        return list(self.nodes)


# the session config entry that makes get_provider_graph_assignment_info answer, as in onnxruntime
_ASSIGNMENT_ENTRY = "session.record_ep_graph_assignment_info"


class FeedChecker:
    """Checks a feed dict against the graph inputs once per call: names, dtypes, ranks and fixed dims."""

    def __init__(self, plan: GraphInterface, overridable: Sequence[str], arrays_only: bool = False):
        # arrays_only: a tensor feed must be a numpy array, a list or an OrtValue, as onnxruntime's
        # InferenceSession.run takes them (the training sessions also take Python and numpy scalars and
        # tuples)
        self.arrays_only = arrays_only
        self.allowed = set(plan.input_names) | set(overridable)
        self.specs = {n: (plan.input_dtypes.get(n), plan.input_shapes.get(n)) for n in plan.all_input_names}
        # sequence- and optional-typed inputs: name → "seq" or "optional"; fed as lists (or None) as they are
        self.containers = {n: kind for n, v in plan.input_info.items()
                           if (kind := _container_kind(v.type)) is not None}
        # map-typed inputs (DictVectorizer's, CastMap's): name → how map_feed checks the dict fed
        self.maps = {n: (v.type.map_type.key_type == onnx.TensorProto.STRING,
                         np_dtype_of(v.type.map_type.value_type), type_string(v.type, "map"))
                     for n, v in plan.input_info.items() if v.type.WhichOneof("value") == "map_type"}
        # a sequence input's element type, where declared
        self.elements = {n: np_dtype_of(v.type.sequence_type.elem_type)
                         for n, v in plan.input_info.items() if self.containers.get(n) == "seq"
                         and v.type.sequence_type.elem_type.HasField("tensor_type")
                         and v.type.sequence_type.elem_type.tensor_type.elem_type}
        # an optional-typed input may be left out, as in onnxruntime (it is then None); an optional tensor's
        # value is checked as a tensor input's (dtype and shape of its element type), an optional
        # sequence's as a sequence input's
        self.required = [n for n in plan.input_names if self.containers.get(n) != "optional"]
        self.optional_tensors: dict[str, tuple[np.dtype | None, list | None]] = {}
        for n, v in plan.input_info.items():
            if self.containers.get(n) != "optional":
                continue
            elem = v.type.optional_type.elem_type
            if elem.HasField("tensor_type"):
                self.optional_tensors[n] = (np_dtype_of(elem) if elem.tensor_type.elem_type else None,
                                            value_info_shape(elem))
            elif elem.HasField("sequence_type") and elem.sequence_type.elem_type.HasField("tensor_type") \
                    and elem.sequence_type.elem_type.tensor_type.elem_type:
                self.elements[n] = np_dtype_of(elem.sequence_type.elem_type)

    def __call__(
        self, feeds: Mapping[str, Any], required: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        # required inputs missing are refused before the names fed are checked, as onnxruntime's Python
        # layer checks them first (a misspelt name is then reported as the input it misses)
        self.refuse_missing(feeds, required)
        out: dict[str, np.ndarray] = {}
        for name, v in feeds.items():
            if name not in self.allowed:
                raise InvalidFeed(f"unknown input {name!r}; the model's inputs are {self.required}")
            kind = self.containers.get(name)
            tensor = kind is None and name not in self.maps or name in self.optional_tensors
            if self.arrays_only and tensor and not isinstance(v, OrtValue):
                check_onnxruntime_feed(name, v)
            if kind is None and name in self.maps:  # a dict, its keys and values checked
                out[name] = map_feed(name, v, *self.maps[name])
            elif kind is None:
                out[name] = _tensor_feed(name, v, *self.specs[name])
            elif name in self.optional_tensors:  # an optional tensor: None, or a tensor input's feed
                a = v._array if isinstance(v, OrtValue) and v._array is None else v
                out[name] = None if a is None else _tensor_feed(name, a, *self.optional_tensors[name])
            else:
                if self.arrays_only and kind == "seq" and isinstance(v, tuple):  # (onnxruntime's refusal)
                    raise InvalidFeedType(f"Iterable of {type(v[0]) if v else object} should be given as "
                                          f"array for input {name!r}: feed a sequence as a list, not a tuple")
                out[name] = _container_feed(name, kind, v, self.elements.get(name))
        return out

    def refuse_missing(self, feeds: Any, required: Sequence[str] | None = None) -> None:
        """Refuse a feed that is not a mapping (onnxruntime's AttributeError) or lacks a required input."""
        _check_feed_mapping(feeds)
        missing = [n for n in (self.required if required is None else required) if n not in feeds]
        if missing:
            raise missing_inputs(missing, feeds, self.required)


def _check_feed_mapping(feeds: Any) -> None:
    """A feed that is not a mapping (a list of pairs, None) is refused with onnxruntime's AttributeError."""
    if type(feeds) is not dict and not (hasattr(feeds, "keys") and hasattr(feeds, "items")):
        raise AttributeError(f"'{type(feeds).__name__}' object has no attribute 'keys': input_feed must be a "
                             "dict of input name to value")


def missing_inputs(missing: Sequence[str], feeds: Mapping[str, Any], inputs: Sequence[str]) -> InvalidFeed:
    """The error for a feed that lacks the required inputs ``missing``, in onnxruntime's words (which name the
    inputs fed), and the model's ``inputs``."""
    return InvalidFeed(f"Required inputs ({list(missing)}) are missing from input feed ({list(feeds)}): "
                       f"missing input(s) {list(missing)}; the model's inputs are {list(inputs)}")


def _tensor_feed(name: str, v: Any, dtype: np.dtype | None, shape: list | None) -> np.ndarray:
    """The array fed to tensor input ``name`` of ``dtype`` and ``shape`` (either None when not declared):
    :func:`feed_array`; another dtype or rank is refused."""
    if isinstance(v, OrtValue) and v.is_sparse_tensor():  # (onnxruntime's InvalidArgument)
        raise InvalidFeedType(f"input {name!r}: a sparse tensor was fed to a dense tensor input")
    a = feed_array(name, v.numpy() if isinstance(v, OrtValue) else v, dtype)
    if dtype == np.dtype(object):  # str, bytes, raw bytes or other objects: str, as onnxruntime
        a = _as_strings(a)
    if dtype is not None and a.dtype != dtype:
        raise InvalidFeedType(
            f"input {name!r}: expected dtype {dtype} (tensor({_type_name(dtype)})), got {a.dtype}"
        )
    if shape is not None:
        check_feed_shape(name, a, shape)
    return a


def check_feed_shape(name: str, a: np.ndarray, shape: Sequence[int | str | None]) -> None:
    """InvalidFeed naming input ``name`` when ``a`` has not the rank of its declared ``shape`` (ints, symbolic
    names or None) or differs from one of its fixed dims (0 included). Any array fed to an input declared a
    scalar is taken, as onnxruntime takes it (``np.array([lr])``, ``[[7]]``; several values too: the
    graph computes with the shape fed)."""
    if not shape:
        return
    if a.ndim != len(shape):
        raise InvalidFeed(
            f"input {name!r}: expected rank {len(shape)} (shape {shape}), "
            f"got rank {a.ndim} (shape {list(a.shape)})"
        )
    for k, (want, got) in enumerate(zip(shape, a.shape)):
        if isinstance(want, int) and want >= 0 and want != got:
            raise InvalidFeed(
                f"input {name!r}: dimension {k} must be {want}, got {got} "
                f"(shape {list(a.shape)}, expected {shape})"
            )


def _container_kind(tp: onnx.TypeProto) -> str | None:
    kind = tp.WhichOneof("value")
    return {"sequence_type": "seq", "optional_type": "optional"}.get(kind or "")


def _as_strings(a: np.ndarray) -> np.ndarray:
    """A string input's feed as an object array of str: numpy str and bytes arrays (decoded), raw bytes
    (``np.void``) and objects other than str (``bytes`` objects too: converted with ``str``) as onnxruntime
    takes them."""
    if a.dtype.kind == "V":  # every byte of each element, trailing NULs too (an S view drops them)
        flat = [x.tobytes().decode("utf-8") for x in a.reshape(-1)]
        return np.array(flat, dtype=object).reshape(a.shape)
    if a.dtype.kind == "S":
        return np.strings.decode(a, "utf-8").astype(object)
    if a.dtype.kind == "U":
        return a.astype(object)
    if a.dtype == np.dtype(object) and not all(isinstance(x, str) for x in a.flat):
        flat = [str(x) for x in a.flat]  # bytes objects too: "b'ab'", as onnxruntime converts them
        return np.array(flat, dtype=object).reshape(a.shape)
    return a


def _container_feed(name: str, kind: str, v: Any, element: np.dtype | None = None) -> Any:
    """A feed for a sequence input (a list or tuple of arrays, of the declared ``element`` type) or an
    optional one (None, or its value)."""
    if isinstance(v, OrtValue):  # a sequence or optional a run handed back (run_with_ort_values)
        v = v._array
    if v is None:
        if kind == "optional":
            return None
        # (onnxruntime's Fail, as None fed to a tensor input)
        raise NoneFed(f"input {name!r}: None was fed; expected a sequence (a list of arrays)")
    if isinstance(v, (list, tuple)):
        items = [x.numpy() if isinstance(x, OrtValue) else np.asarray(x) for x in v]
        if element == np.dtype(object):  # strings, as a string input takes them
            items = [_as_strings(x) for x in items]
        wrong = next((k for k, x in enumerate(items) if element is not None and x.dtype != element), None)
        if wrong is not None:
            raise InvalidFeedType(f"input {name!r}: element {wrong} is {items[wrong].dtype}; the sequence "
                                  f"holds {element}")
        return items
    if kind == "seq":
        raise InvalidFeedType(f"input {name!r}: expected a sequence (a list of arrays), got "
                              f"{type(v).__name__}")
    return v.numpy() if isinstance(v, OrtValue) else np.asarray(v)


class InferenceSession:
    """Runs an ONNX model with the numpy engine; the interface of ``onnxruntime.InferenceSession``.

    Example::

        sess = onnxtrain.InferenceSession("model.onnx")
        logits, = sess.run(None, {"x": x})
    """

    _changes_state = False  # a run changes state the session keeps (a training session's weights)
    # dims a gradient graph takes for one size (its metadata): each run's feeds are checked against them
    # (a training session checks its own step's feeds instead)
    _same_size: Mapping[str, list[tuple[str, int]]] = MappingProxyType({})
    # writable arrays the plan runs on that outputs must not hand out (add_initializer's: see __init__)
    _held: Sequence[np.ndarray] = ()

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Sessions are not picklable, as onnxruntime's (a ``spawn`` worker builds its own): one TypeError
        whatever the model (pickle failed on whichever compiled kernel or lock it met first)."""
        raise TypeError(f"cannot pickle '{type(self).__module__}.{type(self).__qualname__}' object: build "
                        "the session in the process that runs it")

    @raises_as_onnxruntime  # onnxruntime raised RuntimeErrors where the checks raise ValueError, OSError...
    def __init__(
        self,
        path_or_bytes: str | bytes | os.PathLike | onnx.ModelProto,
        sess_options: SessionOptions | None = None,
        providers: Sequence[Any] | None = None,
        provider_options: Sequence[dict] | None = None,
        **kwargs: Any,
    ):
        begin = time.perf_counter_ns()
        self._sess_options = options_snapshot(sess_options)
        self._backend = backend_of(self._sess_options)  # config entry onnxtrain.backend
        # (with ORT_LOAD_CONFIG_FROM_MODEL=1 onnxruntime drops the caller's session config entries, whatever
        # the model's ort_config says: it applies none of them either, and there is nothing to warn of)
        if self._backend == "numpy" and not model_config_asked():
            warn_config_not_applied(self._sess_options)
            refuse_bad_ort_entries(self._sess_options)  # (those onnxruntime refuses, with its classes)
        # onnxruntime's enable_fallback keyword: a providers argument it cannot use (an unknown name, options
        # of another length) falls back to the CPU once, with its "EP Error" banner, instead of failing
        self._enable_fallback = int(kwargs.get("enable_fallback", 1)) == 1
        asked = providers
        try:
            self._providers, self._provider_options = backend_providers(self._backend, providers,
                                                                        provider_options)
        except (ValueError, RuntimeError) as e:
            if not self._enable_fallback:
                raise
            print("*************** EP Error ***************")
            print(f"EP Error {e} when using {providers}")
            print("Falling back to ['CPUExecutionProvider'] and retrying.")
            print("****************************************")
            asked = ["CPUExecutionProvider"]  # (the retry asks for the CPU provider itself)
            self._providers, self._provider_options = backend_providers(self._backend, asked)
            self._enable_fallback = False  # (once, as onnxruntime)
        if self._backend == "numpy" and not model_config_asked():  # (dropped by onnxruntime then, as above)
            refuse_disabled_cpu_fallback(self._sess_options, asked)
        self._model_path = path_or_bytes if isinstance(path_or_bytes, (str, os.PathLike)) else None
        model = load_with_options(path_or_bytes, self._sess_options)
        if model_config_asked():  # (onnxruntime's switch)
            warn_options_model_config_drops(self._sess_options, model)
            self._sess_options = options_from_model(self._sess_options, model)
        model = loadable_model(model, text_names=False)  # (the plans take bytes names as they are)
        self._same_size = same_size_dims(model)
        loaded = time.perf_counter_ns()
        arrays = supplied_arrays(model, self._sess_options)
        # the arrays of add_initializer that the plan reads in place (the caller's, writable): an output
        # passing one through is copied, or writing into it would change the weight of later runs
        self._held = list(arrays.values()) if self._backend == "numpy" else []
        self._model = model
        if self._backend == "numpy":  # the plan holds the weights' arrays, and the session's model only
            # their names, types and dims (it held a second copy: 192 MiB of weights took 442 MiB, now 250)
            arrays = heavy_arrays(model, arrays)
            self._model = without_values(model)
        self._plan = make_plan(self._model, self._backend, self._providers, self._sess_options,
                               self._provider_options, initializers=arrays)
        # onnxruntime runs path-only runs itself when every input is a tensor (see _path_plan); it then holds
        # the weights, and the session keeps their names, types and dims
        self._own_path_runs = self._backend != "numpy" and bool(getattr(self._plan, "_tensor_io", False))
        if self._own_path_runs:
            self._model = without_values(model)
        self._start_ns = time.time_ns()
        self._plan.profiling = bool(self._sess_options.enable_profiling)
        if self._sess_options.optimized_model_filepath:  # the graph the engine runs: the model as loaded
            from onnxtrain.errors import NoFolderForOutput
            from onnxtrain.ir.io import save_dump

            save_dump(model, optimized_model_path(self._sess_options),
                      "SessionOptions.optimized_model_filepath", missing_folder=NoFolderForOutput,
                      **optimized_model_data(self._sess_options))
        del model
        g = self._model.graph
        inits = {t.name for t in g.initializer}
        self._inputs = [node_arg(v) for v in g.input if v.name not in inits]
        # below IR version 4 every initializer is listed as an input too and is a constant (onnxruntime's)
        constants = self._model.ir_version < 4
        self._overridable = [] if constants else [node_arg(v) for v in g.input if v.name in inits]
        self._outputs = [node_arg(v) for v in g.output]
        self._output_names = [o.name for o in self._outputs]
        # what get_outputs() shows: the declarations merged with shape inference, as onnxruntime shows them;
        # (a declared rank or size that inference contradicts forgotten, as there); inferred at the first call
        self._shown_outputs: list[NodeArg] | None = None
        self._check = FeedChecker(self._plan, [a.name for a in self._overridable], arrays_only=True)
        # outputs of path-only runs → the inputs on their path and its plan (see _path_plan)
        self._path_plans: dict[tuple[str, ...], tuple[list[str] | None, GraphInterface | None]] = {}
        # the numpy engine may run the two halves of a batch at once (onnxtrain/engine/batch_split.py)
        split = batch_split_mode(self._sess_options)
        self._splitter = None
        if self._backend == "numpy" and split != "off":
            from onnxtrain.engine.batch_split import BatchSplitter  # numpy plans only

            self._splitter = BatchSplitter.for_plan(self._plan, split)
        profile_session_start(self, begin, loaded)

    # ---- running -------------------------------------------------------------------
    def run(
        self,
        output_names: Sequence[str] | None,
        input_feed: Mapping[str, Any],
        run_options: RunOptions | None = None,
    ) -> list[np.ndarray]:
        """The outputs ``output_names`` (all when None) of a run on ``input_feed``: the session's ``_run``."""
        if isinstance(output_names, (str, bytes)):
            raise TypeError("output_names must be a list of names or None, got "
                            f"{type(output_names).__name__} {output_names!r}")
        ro = RunOptions._default() if run_options is None else run_options  # ({} is no RunOptions)
        if not all(hasattr(ro, a) for a in ("terminate", "only_execute_path_to_fetches")):
            raise TypeError(f"run_options must be a RunOptions, got {type(ro).__name__} {ro!r}")
        if isinstance(ro, RunOptions):
            check_severity(ro.log_severity_level, "RunOptions")
        if getattr(ro, "terminate", False):
            raise Fail("Exiting due to terminate flag being set to true (RunOptions.terminate).")
        # given run options are watched during the run: terminate set from another thread stops it
        if self._same_size and isinstance(input_feed, Mapping):
            check_same_sizes(self._same_size, input_feed, "InferenceSession.run")
        token = RUN_OPTIONS.set(run_options) if run_options is not None else None
        begin = time.perf_counter_ns() if self._session_events is not None else 0
        try:
            out = outputs_apart(own_outputs(self._run(output_names, input_feed, ro), input_feed, self._held))
            if begin and self._session_events is not None and len(self._session_events) < MAX_PROFILE_EVENTS:
                took = time.perf_counter_ns() - begin
                self._session_events.append(ProfileEvent("model_run", "", begin, took, cat="Session"))
            return out
        except EngineError as e:  # named after the inputs when they disagree on a shared dimension
            if isinstance(input_feed, Mapping) and not isinstance(e, Terminated):
                why = shared_dim_mismatch(self._inputs, input_feed, "run failed")
                if why is not None:
                    raise FeedSizeMismatch(f"{why}; {e}") from e
            raise
        finally:
            if token is not None:
                RUN_OPTIONS.reset(token)

    def run_async(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
                  callback: Callable[[Any, Any, str], None], user_data: Any,
                  run_options: RunOptions | None = None) -> None:
        """Run on a thread of its own; ``callback(outputs, user_data, error)`` gets the outputs and "" on
        success, ``[]`` and the error's text on failure (onnxruntime's ``run_async``). Missing inputs are
        refused here, before the thread starts, as onnxruntime refuses them."""
        import threading

        self._check.refuse_missing(input_feed)

        def work() -> None:
            try:
                outputs = self.run(output_names, input_feed, run_options)
            except Exception as e:  # noqa: BLE001 - handed to the callback, as onnxruntime does
                callback([], user_data, f"{type(e).__name__}: {e}")
                return
            callback(outputs, user_data, "")

        threading.Thread(target=work, name="onnxtrain-run-async", daemon=True).start()

    def _run(
        self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], ro: RunOptions
    ) -> list[np.ndarray]:
        """The model's outputs on the checked feeds; with the run options' ``only_execute_path_to_fetches``,
        only the inputs on the outputs' path are required (the run options change nothing else)."""
        names = self._output_list(output_names) if output_names else None
        required, path = self._path_plan(names) if names and ro.only_execute_path_to_fetches else (None, None)
        feeds = self._check(input_feed, required)
        if path is self._plan:  # onnxruntime's own path-only run (see _path_plan)
            outs = path.run(feeds, names, path_only=True)
        elif path is not None:
            outs = path.run({n: v for n, v in feeds.items() if n in path.input_info}, names)
        elif self._splitter is not None:
            outs = self._splitter.run(feeds, names)
        else:
            outs = self._plan.run(feeds, names)
        return outs

    def _path_plan(self, names: list[str]) -> tuple[list[str] | None, GraphInterface | None]:
        """The required inputs on the way to outputs ``names`` and a plan of only that path; (None, None)
        when the path reads every required input (the session's plan then runs)."""
        key = tuple(sorted(names))
        if key not in self._path_plans:
            _, needed = path_to(self._model.graph.node, names)
            required = [n for n in self._check.required if n in needed]
            if len(required) == len(self._check.required):
                self._path_plans[key] = (None, None)
            elif self._own_path_runs:
                # onnxruntime runs only the path itself, the inputs off it fed empty: no second session
                # (with a second copy of the weights)
                self._path_plans[key] = (required, self._plan)
            else:
                plan = make_plan(model_for_outputs(self._model, names), self._backend, self._providers,
                                 self._sess_options, self._provider_options,
                                 initializers=self._plan.initializers)  # the session's arrays, shared
                plan.profiling = self._plan.profiling
                self._path_plans[key] = (required, plan)
        return self._path_plans[key]

    def _output_list(self, output_names: Sequence[str] | None) -> list[str]:
        """The outputs asked for (all of the session's when None); InvalidFeed naming an unknown one,
        InvalidFeedType one that is not a string; a TypeError for one string in place of the list (as
        onnxruntime's binding refuses it)."""
        if isinstance(output_names, (str, bytes)):
            raise TypeError("output_names must be a list of names or None, got "
                            f"{type(output_names).__name__} {output_names!r}")
        names = list(output_names) if output_names else list(self._output_names)
        for n in names:
            if not isinstance(n, str):  # (a nested list: onnxruntime's binding refuses the argument's type)
                raise InvalidFeedType(f"output names must be strings; got {type(n).__name__} {n!r} in "
                                      f"{output_names!r}")
            if n not in self._output_names:
                raise InvalidFeed(f"unknown output {n!r}; the session's outputs are {self._output_names}")
        return names

    def run_with_ort_values(
        self,
        output_names: Sequence[str] | None,
        input_dict_ort_values: Mapping[str, OrtValue],
        run_options: RunOptions | None = None,
    ) -> list[OrtValue]:
        names = self._output_list(output_names)
        declared = {o.name: o.type for o in self._outputs}
        return [OrtValue(v, declared.get(n)) for n, v in
                zip(names, self.run(names, input_dict_ort_values, run_options))]

    def run_with_ortvaluevector(self, run_options: RunOptions, feed_names: Sequence[str],
                                feeds: OrtValueVector, fetch_names: Sequence[str], fetches: OrtValueVector,
                                fetch_devices: Sequence[OrtDevice]) -> None:
        """onnxruntime's lowest-overhead run: the inputs as parallel lists of names and values (an
        ``OrtValueVector``), the outputs ``fetch_names`` put into ``fetches`` (an ``OrtValueVector``):
        appended when it is empty, else written into the values it holds, one per name (each of the output's
        shape and type). Every output is on the CPU, whatever ``fetch_devices`` (an ``OrtDevice`` per
        output) asks. Returns None, as onnxruntime's."""
        if not isinstance(run_options, RunOptions):
            raise TypeError(f"run_with_ortvaluevector: run_options must be a RunOptions, got "
                            f"{type(run_options).__name__}")
        for what, v in (("feeds", feeds), ("fetches", fetches)):
            if not isinstance(v, OrtValueVector):  # (onnxruntime's binding takes no plain list either)
                raise TypeError(f"run_with_ortvaluevector: {what} must be an OrtValueVector, got "
                                f"{type(v).__name__}")
        feed_names, fetch_names, fetch_devices = list(feed_names), list(fetch_names), list(fetch_devices)
        if len(feed_names) != len(feeds):
            raise InvalidArgument(f"run_with_ortvaluevector: size mismatch: feed_names has {len(feed_names)} "
                                  f"elements, but feeds has {len(feeds)}")
        if not fetch_names:
            raise InvalidArgument("run_with_ortvaluevector: at least one output should be requested "
                                  "(fetch_names is empty)")
        if len(fetches) not in (0, len(fetch_names)):
            raise InvalidArgument(f"run_with_ortvaluevector: fetches holds {len(fetches)} values for "
                                  f"{len(fetch_names)} fetch_names: pass it empty or with one value per name")
        if not all(isinstance(d, OrtDevice) for d in fetch_devices):
            raise TypeError(f"run_with_ortvaluevector: fetch_devices must be OrtDevices, got "
                            f"{fetch_devices!r}")
        if len(fetch_devices) < len(fetch_names):  # (onnxruntime 1.16 aborts the process)
            raise InvalidArgument(f"run_with_ortvaluevector: {len(fetch_devices)} fetch_devices for "
                                  f"{len(fetch_names)} fetch_names: one OrtDevice per output")
        if len(set(feed_names)) != len(feed_names):
            twice = sorted({n for n in feed_names if feed_names.count(n) > 1})
            raise InvalidArgument(f"run_with_ortvaluevector: feed_names names {twice} more than once")
        known = {a.name for a in [*self.get_inputs(), *self.get_overridable_initializers()]}
        unknown = [n for n in feed_names if n not in known]
        if unknown:  # (onnxruntime names the first)
            raise InvalidFeed(f"run_with_ortvaluevector: invalid feed input name {unknown[0]!r}; the "
                              f"session's inputs are {sorted(known)}")
        outs = self.run_with_ort_values(fetch_names, dict(zip(feed_names, feeds)), run_options)
        if not fetches:
            fetches.extend(outs)
            return
        pairs = [(getattr(target, "_array", None), out.numpy()) for target, out in zip(fetches, outs)]
        for name, target, (have, got) in zip(fetch_names, fetches, pairs):  # (all checked before any write)
            if not isinstance(have, np.ndarray) or have.shape != got.shape or have.dtype != got.dtype:
                raise RuntimeException(
                    f"run_with_ortvaluevector: the value in fetches for output {name!r} is "
                    f"{target!r}; the output is {_type_name(got.dtype)} of shape {list(got.shape)}")
        for have, got in pairs:
            np.copyto(have, got)

    def io_binding(self) -> IOBinding:
        return IOBinding(self)

    def run_with_iobinding(self, iobinding: IOBinding, run_options: RunOptions | None = None) -> None:
        names = list(iobinding._outputs)
        if not names:  # (onnxruntime's message)
            raise Fail("Error in execution: At least one output should be requested.")
        # a training session checks the buffers against the sizes the bound inputs fix too, before its run
        # changes the state (an inference session, as onnxruntime, takes outputs its model mis-declares)
        iobinding._check_targets(self._outputs, self._inputs if self._changes_state else ())
        iobinding._store(names, self.run(names, iobinding._inputs, run_options),
                         {o.name: o.type for o in self._outputs})

    # ---- introspection -------------------------------------------------------------
    def get_inputs(self) -> list[NodeArg]:
        return list(self._inputs)

    def get_outputs(self) -> list[NodeArg]:
        """The outputs' names, types and shapes: those the model declares, completed by shape inference (a
        declared symbolic or unknown dim that inference knows takes its size), as onnxruntime gives them."""
        shown = getattr(self, "_shown_outputs", self._outputs)  # (a training session: its own list)
        if shown is None:
            types = inferred_output_types(self._model)
            shown = [node_arg(_typed(v, types.get(v.name))) for v in self._model.graph.output]
            self._shown_outputs = shown
        return list(shown)

    def get_overridable_initializers(self) -> list[NodeArg]:
        return list(self._overridable)

    def get_input_memory_infos(self) -> list[Any]:
        """Where each input's memory lives, as onnxruntime's CPU provider reports it (its "Cpu" arena)."""
        return [_cpu_memory_info() for _ in self._inputs]

    def get_output_memory_infos(self) -> list[Any]:
        """Where each output's memory lives: the CPU, as for the inputs."""
        return [_cpu_memory_info() for _ in self._output_names]

    def get_provider_graph_assignment_info(self) -> list[EpAssignedSubgraph]:
        """The nodes each execution provider runs, one subgraph per node of the CPU provider (the numpy
        engine runs every node itself), when the session config entry
        ``session.record_ep_graph_assignment_info`` is "1"; else a Fail, as onnxruntime's."""
        if config_entry(self._sess_options, _ASSIGNMENT_ENTRY) != "1":  # (onnxtrain's or onnxruntime's)
            raise Fail(f"Session configuration entry '{_ASSIGNMENT_ENTRY}' must be set to \"1\" to retrieve "
                       "EP graph assignment information")
        return [EpAssignedSubgraph("CPUExecutionProvider", (EpAssignedNode(n.domain, n.op_type, n.name),))
                for n in self._model.graph.node]

    def get_input_epdevices(self) -> list[None]:
        """The execution-provider device of each input: None (no plug-in provider device), one per input
        as onnxruntime lists them."""
        return [None] * len(self._inputs)

    def get_modelmeta(self) -> ModelMetadata:
        return metadata_of(self._model)

    def get_providers(self) -> list[str]:
        return list(self._providers)

    @raises_as_onnxruntime
    def set_providers(
        self, providers: Sequence[Any] | None = None, provider_options: Sequence[dict] | None = None
    ) -> None:
        self._providers, self._provider_options = resolve_providers(providers, provider_options)

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        """Each provider's options, as onnxruntime reports them: none for its CPU provider, which keeps none
        of those given."""
        return {p: {} if p == "CPUExecutionProvider" else dict(o)
                for p, o in zip(self._providers, self._provider_options)}

    def get_session_options(self) -> SessionOptions:
        """A copy of the options the session was made with: changing it changes nothing in the session
        (as in onnxruntime); another library's options object as it was given."""
        options = self._sess_options
        return options.snapshot() if isinstance(options, SessionOptions) else options

    def disable_fallback(self) -> None:
        self._enable_fallback = False

    def enable_fallback(self) -> None:
        self._enable_fallback = True

    # ---- kernel tuning (onnxruntime's TunableOp) -----------------------------------
    def get_tuning_results(self) -> list[dict[str, Any]]:
        """The kernel choices the session's providers made by tuning, one dict (``ep``, ``results``,
        ``validators``) per provider that tunes. onnxtrain picks no kernels by timing them, so there are none:
        an empty list, as onnxruntime's CPU provider gives."""
        return []

    def set_tuning_results(self, results: list, *, error_on_invalid: bool = False) -> None:
        """Hand the session tuning results (``get_tuning_results``' form). Every entry is read first (a
        list of mappings with ``ep``, ``results``: {op: {params: kernel id}} and ``validators``): a missing
        key is a KeyError, a value of the wrong form a TypeError or ValueError, as onnxruntime 1.16's
        binding. Then each entry is checked against the session's providers: one it does not have, or one of
        its providers (none tunes here) is an invalid entry, a RuntimeError naming it when
        ``error_on_invalid``, else a warning and the entry is skipped. Nothing is ever taken."""
        if not isinstance(results, list):
            raise TypeError(f"set_tuning_results takes a list of tuning results (one dict per execution "
                            f"provider), got {type(results).__name__}")
        if error_on_invalid is not None and not isinstance(error_on_invalid, (bool, np.bool_, int, float)):
            raise TypeError(f"set_tuning_results: error_on_invalid must be a bool, got "
                            f"{type(error_on_invalid).__name__} {error_on_invalid!r}")
        eps = [_tuning_entry(k, entry) for k, entry in enumerate(results)]
        for k, ep in enumerate(eps):
            if ep not in self._providers:
                problem = f"Cannot find execution provider {ep} (the session's: {', '.join(self._providers)})"
            else:
                problem = (f"Invalid tuning results (index={k}): {ep} does not support TunableOp (onnxtrain "
                           "tunes no kernels)")
            if error_on_invalid:
                raise RuntimeError(f"set_tuning_results: {problem}")
            warn(f"set_tuning_results: {problem}; entry skipped")

    # onnxruntime's Python ``Session`` kept these lists as attributes, and its training frontends
    # (``ort_trainer.py``, ``onnxruntime.training._utils``) searched them for the special outputs' names
    @property
    def _inputs_meta(self) -> list[NodeArg]:
        return self.get_inputs()

    @property
    def _outputs_meta(self) -> list[NodeArg]:
        return self.get_outputs()

    @property
    def _overridable_initializers(self) -> list[NodeArg]:
        return self.get_overridable_initializers()

    @property
    def _model_meta(self) -> ModelMetadata:
        return self.get_modelmeta()

    @property
    def peak_bytes(self) -> int:
        """Peak bytes of live tensors during the last run (weights included)."""
        return self._plan.peak_bytes

    # ---- profiling -----------------------------------------------------------------
    def get_profiling_start_time_ns(self) -> int:
        return self._start_ns

    def end_profiling(self) -> str:
        """Write the per-node profile as a chrome-trace JSON file and end profiling, as onnxruntime does;
        returns its path ('' when not profiling, or profiling has ended)."""
        paths = [plan for _, plan in self._path_plans.values() if plan not in (None, self._plan)]
        return end_profiling(self, [self._plan, *paths])


def _tuning_entry(index: int, entry: Any) -> str:
    """The provider name of tuning results entry ``index``, once its keys and their values' forms are
    checked as onnxruntime's binding reads them (``ep`` as text, kernel ids as integers)."""
    where = f"set_tuning_results: entry {index}"
    try:
        entry = dict(entry)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{where} must be a dict with 'ep', 'results' and 'validators', got "
                        f"{type(entry).__name__} {entry!r}") from e

    def field(key: str) -> Any:  # (in the binding's order: a bad 'results' is named before no 'validators')
        if key not in entry:
            raise KeyError(f"{where} has no {key!r} (it needs 'ep', 'results' and 'validators')")
        return entry[key]

    def mapping(value: Any, what: str) -> dict:
        try:
            return dict(value)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{where}: {what} must be a dict, got {type(value).__name__} {value!r}") from e

    ep = field("ep")
    for op, kernels in mapping(field("results"), "'results'").items():
        for params, kernel in mapping(kernels, f"'results'[{op!r}]").items():
            try:
                int(kernel)
            except (TypeError, ValueError) as e:
                raise type(e)(f"{where}: kernel id 'results'[{op!r}][{params!r}] must be an integer, got "
                              f"{type(kernel).__name__} {kernel!r}") from e
    mapping(field("validators"), "'validators'")
    return str(ep)


def _cpu_memory_info() -> Any:
    """The memory info onnxruntime gives a CPU session's inputs and outputs."""
    from onnxtrain.capi.allocators import OrtAllocatorType, OrtMemoryInfo, OrtMemType

    return OrtMemoryInfo("Cpu", OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, OrtMemType.DEFAULT)
