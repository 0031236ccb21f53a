"""The legacy ``TrainingSession``: one ``run()`` = forward + backward + optimizer update.

Weights, optimizer state, accumulation buffers and BatchNormalization running statistics live in
the session's store (numpy arrays keyed by their legacy names); the step graphs take them as
inputs and return the new values, which are swapped into the store without copying.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from onnxtrain.capi.feeds import empty_run
from onnxtrain.capi.options import RunOptions, SessionOptions
from onnxtrain.capi.outputs import own_outputs
from onnxtrain.engine.allocator import release_free_memory
from onnxtrain.engine.backends import backend_of, make_plan
from onnxtrain.engine.backends import resolve_providers as backend_providers
from onnxtrain.engine.interface import GraphInterface, InvalidNodeError, check_graph_links, graph_interface
from onnxtrain.engine.ort_half_scatters import half_scatters_in_float32
from onnxtrain.errors import (
    InvalidFeed,
    InvalidFeedType,
    NoFolderForOutput,
    program_hint,
    raises_as_onnxruntime,
)
from onnxtrain.graph_transforms.accumulation import GROUP_OUTPUT
from onnxtrain.graph_transforms.flags import FLAG_SHAPE
from onnxtrain.graph_transforms.mixed_precision import MixedPrecisionInfo, check_loss_scale_feed, half_copies
from onnxtrain.inference import (
    FeedChecker,
    InferenceSession,
    ModelMetadata,
    NodeArg,
    metadata_of,
    node_arg,
    warn_unread_model_config,
)
from onnxtrain.interrupts import sigint_deferred
from onnxtrain.ir.builder import MODEL_DESCRIPTION, carry_description, gc_paused, loadable_model
from onnxtrain.ir.graphs import model_for_outputs, with_input_values
from onnxtrain.ir.io import save_dump
from onnxtrain.ir.types import widens_exactly
from onnxtrain.locks import fork_safe_rlock
from onnxtrain.optim import WeightSlot, get_optimizer
from onnxtrain.parallel import check_sizes
from onnxtrain.parallel import resolve as resolve_parallel
from onnxtrain.parallel.adasum import ALL_DELTAS_FINITE
from onnxtrain.parallel.fingerprint import check_same_on_all_ranks
from onnxtrain.parallel.zero import ZeroLayout
from onnxtrain.parameters import TrainingParameters
from onnxtrain.session_halves import HalfSteps
from onnxtrain.session_loading import (
    check_numpy_engine_entries,
    load_with_options,
    optimized_model_path,
    options_snapshot,
)
from onnxtrain.session_parallel import DataParallelSteps, fingerprint, with_value_outputs
from onnxtrain.session_profiling import end_profiling, profile_session_start
from onnxtrain.training_graph import (
    TRAINING_MODE,
    build_step_graphs,
    update_clips,
    warn_idle_max_norm_clip,
)
from onnxtrain.user_warning import warn

# plans run right after another of the same session, whose onnxruntime threads therefore stop spinning when
# their run ends
FOLLOWER_PLANS = ("accumulate", "update")
# plan name → the StepGraphs attribute holding its graph (the halves are built on first use)
PLAN_GRAPHS = {"full": "full", "accumulate": "accumulate", "forward": "forward",
               "gradients": "gradients_graph", "update": "update_graph"}
# plans run once per training step on the same weights and moments: onnxruntime's binding is kept between runs
STEP_PLANS = ("full", "accumulate", "gradients", "update", "zero_update")


def check_arguments(path_or_bytes: Any, parameters: Any) -> None:
    """TypeError unless the session's first two arguments are a model and a ``TrainingParameters``."""
    if not isinstance(path_or_bytes, (str, bytes, bytearray, os.PathLike, onnx.ModelProto)):
        raise TypeError(f"path_or_bytes must be a path or the serialized model, got "
                        f"{type(path_or_bytes).__name__}{program_hint(path_or_bytes)}")
    if not isinstance(parameters, TrainingParameters):
        raise TypeError(f"parameters must be a TrainingParameters, got {type(parameters).__name__}")
    check_sizes(parameters)


def serialized(method: Callable[..., Any]) -> Callable[..., Any]:
    """A training session's method that runs while no other thread runs one of these on the session: two
    threads training one session at once lost updates (onnxruntime's legacy session was no safer; a run is
    cheap to wait for, a lost step is not)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._run_lock:
            return method(self, *args, **kwargs)

    return wrapper


def all_or_nothing(load: Callable[..., None]) -> Callable[..., None]:
    """A ``load_state`` that leaves the session's state as it was when it fails part way (an entry of the
    wrong shape after good ones), as onnxruntime's checked every tensor before it changed one: its
    ``_assign`` calls only check and note the values, which are copied into the state's arrays once every
    one passed (as a training step updates them: the graphs' specs hold the same arrays; a load of Adam's
    whole state held three times the weights over it when it made new arrays)."""

    @functools.wraps(load)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        self._pending = {}
        try:
            load(self, *args, **kwargs)
            pending = self._pending
        finally:
            self._pending = None
        for name, value in pending.items():
            cur = self._store[name]
            if cur.flags.writeable:
                np.copyto(cur, value, casting="unsafe")  # (a lossless cast: checked)
            else:
                self._store[name] = value.astype(cur.dtype)

    return wrapper


def requested_dumps(p: TrainingParameters,
                    options: SessionOptions) -> list[tuple[str, str, str, type[FileNotFoundError] | None]]:
    """(option, path, graph, missing-folder class for :func:`save_dump`) of each model dump the session is
    asked for, the graph "transformed", "gradient" or "training". onnxruntime wrote its optimized training
    graph at ``optimized_model_filepath`` (refusing a missing folder with its InvalidArgument); onnxtrain
    writes the training graph it runs there."""
    asked = [(f"TrainingParameters.{name}", getattr(p, name), kind, None) for name, kind in (
        ("model_after_graph_transforms_path", "transformed"), ("model_with_gradient_graph_path", "gradient"),
        ("model_with_training_graph_path", "training"))]
    asked.append(("SessionOptions.optimized_model_filepath", optimized_model_path(options), "training",
                  NoFolderForOutput))
    return [dump for dump in asked if dump[1]]


def dumped_graph(model: onnx.ModelProto, store: Mapping[str, np.ndarray],
                 dropout_default: bool, last: Collection[str] = ()) -> onnx.ModelProto:
    """``model`` as a session writes it to a dump, a graph that runs on its own in any ONNX runtime: the
    state's values and a shared ``training_mode`` input (``dropout_default``: the model's Dropout mode) as
    initializers, as onnxruntime's dumps held them (its inputs stay, so a run may feed them), and float16 or
    bfloat16 scatters that add computed in float32, as in the GradientGraphBuilder's model (onnxruntime's CPU
    provider has no half kernel for them). Outputs named in ``last`` (a loss the model does not list, which
    onnxruntime's dumps did not output) come after the others, so the session's outputs lead in order."""
    if any(o.name in last for o in model.graph.output):
        copied = onnx.ModelProto()
        copied.CopyFrom(model)
        outputs = []
        for o in sorted(copied.graph.output, key=lambda o: o.name in last):  # (stable: the rest keep order)
            outputs.append(onnx.ValueInfoProto())
            outputs[-1].CopyFrom(o)
        del copied.graph.output[:]
        copied.graph.output.extend(outputs)
        model = copied
    model = with_input_values(model, {**store, TRAINING_MODE: np.asarray(dropout_default)})
    return half_scatters_in_float32(model)


@contextlib.contextmanager
def described_as(dump: onnx.ModelProto, model: onnx.ModelProto) -> Iterator[onnx.ModelProto]:
    """``dump`` carrying ``model``'s description while the block runs, as onnxruntime-training 1.16.3's
    dumps keep the user's model's: producer name and version, doc_string, domain, model_version,
    metadata_props (but its onnxtrain.* keys, which describe what onnxtrain made of it before; the dump's own
    keys after them) and graph name. Put back afterwards: the dump may be the session's own graph."""
    # (each field's value or None when unset: proto2 fields set to their default would be written)
    kept = ([getattr(dump, f) if dump.HasField(f) else None for f in MODEL_DESCRIPTION],
            list(dump.metadata_props), dump.graph.name if dump.graph.HasField("name") else None)
    carry_description(model, dump)
    try:
        yield dump
    finally:
        for f, value in zip(MODEL_DESCRIPTION, kept[0]):
            if value is None:
                dump.ClearField(f)
            else:
                setattr(dump, f, value)
        del dump.metadata_props[:]
        dump.metadata_props.extend(kept[1])
        if kept[2] is None:
            dump.graph.ClearField("name")
        else:
            dump.graph.name = kept[2]


class TrainingSession(DataParallelSteps, HalfSteps, InferenceSession):
    """Train an ONNX model whose graph computes its loss, with onnxruntime's legacy API.

    Example::

        p = TrainingParameters()
        p.loss_output_name = "loss"
        p.training_optimizer_name = "SGDOptimizer"
        sess = TrainingSession(model_bytes, p)
        loss, = sess.run(["loss"], {"x": x, "y": y, "Learning_Rate": np.array([0.1], np.float32)})
    """

    _pending: dict[str, np.ndarray] | None = None  # the values an all_or_nothing load has checked so far

    def __new__(cls, *args: Any, **kwargs: Any) -> TrainingSession:
        """A :class:`~onnxtrain.session_pipeline.PipelineTrainingSession` when the parameters ask for
        pipeline stages (``pipeline_parallel_size > 1``), a
        :class:`~onnxtrain.session_horizontal.HorizontalTrainingSession` for split layers
        (``horizontal_parallel_size > 1``, with stages or without)."""
        params = args[1] if len(args) > 1 else kwargs.get("parameters")
        if cls is TrainingSession and isinstance(params, TrainingParameters):
            if params.pipeline_parallel_size > 1 and params.horizontal_parallel_size == 1:
                from onnxtrain.session_pipeline import PipelineTrainingSession

                cls = PipelineTrainingSession
            elif params.horizontal_parallel_size > 1:  # with pipeline stages or without
                from onnxtrain.session_horizontal import HorizontalTrainingSession

                cls = HorizontalTrainingSession
        return super().__new__(cls)

    _changes_state = True

    @raises_as_onnxruntime
    def __init__(
        self,
        path_or_bytes: str | bytes | os.PathLike | onnx.ModelProto,
        parameters: TrainingParameters,
        sess_options: SessionOptions | None = None,
        providers: Sequence[Any] | None = None,
        provider_options: Sequence[dict] | None = None,
    ):
        begin = time.perf_counter_ns()
        check_arguments(path_or_bytes, parameters)
        if not parameters.training_optimizer_name and not parameters.set_gradients_as_graph_outputs:
            warn("TrainingParameters.training_optimizer_name is empty: run() computes the loss and updates "
                 "no weight, as onnxruntime's session without an optimizer; set it ('SGDOptimizer', "
                 "'AdamOptimizer', 'LambOptimizer') to train, or set_gradients_as_graph_outputs to fetch "
                 "the gradients")
        if parameters.allow_layer_norm_mod_precision:
            warn("TrainingParameters.allow_layer_norm_mod_precision: LayerNormalization keeps float32 "
                 "statistics (stash_type=1) under mixed precision in onnxtrain; the option changes nothing")
        # a copy: the legacy constructor read its parameters once, and steps read them on every run (an
        # object changed afterwards, to build another session, made a running one use another accumulation)
        self._params = parameters = parameters.snapshot()
        fork_safe_rlock(self, "_run_lock")  # runs and state reads/writes one at a time (see serialized)
        self._sess_options = options_snapshot(sess_options)
        self._backend = backend_of(self._sess_options)  # config entry onnxtrain.backend
        if self._backend == "numpy":  # config entries the engine cannot honour: as an InferenceSession's
            check_numpy_engine_entries(self._sess_options, providers)
        self._providers, self._provider_options = backend_providers(
            self._backend, providers, provider_options
        )
        self._fallback = True
        self._model_path = path_or_bytes if isinstance(path_or_bytes, (str, os.PathLike)) else None
        with gc_paused():
            self._build(path_or_bytes)
        # the graphs, models and bytes made on the way are gone: their pages go back to the kernel (glibc
        # keeps them in the heap otherwise). Peak RSS of the bench's MLP at batch 64, 30 steps: numpy
        # 81.8 -> 81.0 MiB, onnxruntime backend 107.2 -> 106.3
        release_free_memory()
        profile_session_start(self, begin, getattr(self, "_loaded_ns", begin))

    def _build(self, path_or_bytes: str | bytes | os.PathLike | onnx.ModelProto) -> None:
        """The session's graphs and state from the model (the options and backend are kept): one process's,
        or one replica's under data parallelism; the sessions that cut the model build their own."""
        p = self._params
        pending = p.unsupported_options()
        if pending:
            raise NotImplementedError(
                f"TrainingParameters option(s) {', '.join(pending)} are not implemented yet"
            )
        idle = p.pipeline_only_options()
        if idle:
            warn(f"TrainingParameters option(s) {', '.join(idle)} have no effect with "
                 "pipeline_parallel_size=1")
        self._warn_idle_options()
        self._dp = resolve_parallel(p)
        if p.gradient_accumulation_mode not in ("legacy", "auto"):
            raise ValueError(
                f"gradient_accumulation_mode must be 'legacy' or 'auto', got {p.gradient_accumulation_mode!r}"
            )
        self._start_ns = time.time_ns()
        model = load_with_options(path_or_bytes, self._sess_options)
        warn_unread_model_config(model)
        self._ir_version = model.ir_version  # the user's, before any upgrade
        model = loadable_model(model)
        self._loaded_ns = time.perf_counter_ns()
        check_graph_links(model)  # before the gradient is built: a broken link is not a gradient problem
        if self._backend == "numpy":  # the user's nodes first: an error names them, not the training graph's
            _check_user_nodes(model)

        self._user_meta = metadata_of(model)  # what get_modelmeta reports: the user's model, not the step's
        declared = {i.name for i in model.graph.input} & {t.name for t in model.graph.initializer}
        self._opt = (get_optimizer(p.training_optimizer_name, p.use_fp16_moments)
                     if p.training_optimizer_name else None)
        adasum = self._dp is not None and self._dp.mode == "adasum"
        self._clips = update_clips(p, adasum)
        g = build_step_graphs(model, p, self._opt, adasum=adasum)
        self._graphs = g
        self._check_attribute_maps({t.name for t in model.graph.initializer})
        mp = g.mixed_precision
        self.loss_scale_input_name = mp.loss_scale if mp is not None else None
        # a loss scale the model's own scaled loss reads (scaled_loss_output_name) may be fed 0-d, as that
        # input was declared; the step graphs take it as [1]
        self._scale_as_one = mp is not None and bool(p.scaled_loss_output_name)
        self._store: dict[str, np.ndarray] = g.initial_state  # (one dict: no stale arrays kept beside it)
        self._specs = list(g.state_specs)
        self._zero: ZeroLayout | None = None
        self._extra_models: dict[str, onnx.ModelProto] = {}
        if self._dp is not None and self._opt is not None:  # (without an optimizer nothing is exchanged: a
            # rank may make such a session alone, to read its gradients)
            check_same_on_all_ranks(self._dp.comm, fingerprint(model, g, p), "model and training setup")
            self._setup_data_parallel()
        self._apply_initial_optimizer_state(p.optimizer_initial_state())
        graphs = {"transformed": g.transformed, "gradient": g.gradient, "training": g.full}
        unlisted = {p.loss_output_name} - {o.name for o in model.graph.output}  # (see self._outputs below)
        for where, path, kind, missing_folder in requested_dumps(p, self._sess_options):
            dump = dumped_graph(graphs[kind], self._store, g.training_mode_default, unlisted)
            with described_as(dump, model):
                save_dump(dump, path, where, missing_folder=missing_folder)
        self._model = g.full
        self._plans: dict[str, GraphInterface] = {}
        self._random_state: dict[Any, dict[Any, Any]] = {}  # random nodes' generators, shared by the plans
        # on the backend, a step runs as two graphs (session_halves): the single graph's plan is then made
        # only if a run asks for what neither half computes
        self._grad_arrays: dict[str, np.ndarray] = {}  # a two-graph step's gradients, written into next step
        self._halves = self._steps_in_halves()
        try:
            self._plan = self._get_plan("gradients" if self._halves else "full")
        except InvalidNodeError:
            if self._backend != "numpy":  # onnxruntime refused the training graph: the user's node if one is
                _check_user_nodes(model)  # why (checked only now: the backend's memory)
            raise
        self._state_inputs = [i.name for i in g.full.graph.input if i.name in self._store]
        lr = p.lr_params_feed_name
        feed_names = set(g.user_inputs) | ({lr} if self._opt else set())
        if self.loss_scale_input_name:
            feed_names.add(self.loss_scale_input_name)
        self._inputs = [node_arg(v) for v in g.full.graph.input if v.name in feed_names]
        # a weight that the model also declares as a graph input may be fed, as onnxruntime's sessions let a
        # feed override such an initializer from IR version 4 on; below it (where exporters listed every
        # initializer as an input) they are constants there, as in InferenceSession: not overridable. A
        # trained one too, as in onnxruntime 1.16.3: the run computes with the fed value and leaves the
        # weight as it was (its optimizer state is updated); not over MPI, nor where a step runs as two graphs
        # on the backend (on the numpy engine, a run that feeds one runs the single graph)
        inits = {t.name for t in g.full.graph.initializer} if self._ir_version >= 4 else set()
        feedable = declared if self._dp is None and not (self._halves and self._backend != "numpy") else set()
        self._fed_weights = [w for w in g.trainable if w in feedable] if self._ir_version >= 4 else []
        frozen = [node_arg(v) for v in g.full.graph.input
                  if v.name in inits and v.name not in self._store or v.name in self._fed_weights]
        self._overridable = [*frozen, *([NodeArg(TRAINING_MODE, "tensor(bool)", [])]
                                        if g.has_training_mode else [])]
        self._outputs = [
            node_arg(v) for v in g.full.graph.output if v.name in set(g.user_outputs) | set(g.extra_outputs)
        ]
        if self._dp is not None and self._dp.mode == "adasum" and mp is not None and self._opt is not None:
            # made by the exchange
            self._outputs.append(NodeArg(ALL_DELTAS_FINITE, "tensor(bool)", FLAG_SHAPE))
        # a loss the model computes but does not list as an output stays out of get_outputs() and run(None),
        # as onnxruntime-training 1.16.3 kept it inside its training graph (a script unpacks run(None) by
        # position); a run may still fetch it by name (1.16.3 refused that), see _output_list
        self._unlisted_outputs = unlisted & {o.name for o in self._outputs}
        self._outputs = [o for o in self._outputs if o.name not in unlisted]
        self._output_names = [o.name for o in self._outputs]
        overridable = [a.name for a in self._overridable]
        self._check = FeedChecker(graph_interface(g.full) if self._halves else self._plan, overridable)
        self._check.required = [n for n in self._check.required if n in feed_names]
        self._check.allowed = feed_names | set(overridable)
        self._micro_step = 0

    # ---- construction helpers ---------------------------------------------------------
    def _check_attribute_maps(self, initializers: set[str]) -> None:
        """Every trained weight has its entries; entries of other initializers are ignored (as onnxruntime
        did: scripts fill the maps for every weight they asked for), of unknown names an error."""
        p, opt = self._params, self._opt
        if opt is None:
            return
        fmap, imap = p.optimizer_attributes_map, p.optimizer_int_attributes_map
        for w in self._graphs.trainable:
            for label, m in (("optimizer_attributes_map", fmap), ("optimizer_int_attributes_map", imap)):
                if m and w not in m:
                    raise ValueError(
                        f"{label} has no entry for trained weight {w!r} (give every trained weight "
                        "an entry, possibly {})"
                    )
        opt.check_attrs(self._graphs.trainable, fmap, imap)
        warn_idle_max_norm_clip(p, opt, self._graphs.trainable, self._clips)
        for label, m in (("optimizer_attributes_map", fmap), ("optimizer_int_attributes_map", imap)):
            absent = sorted(w for w in m if w not in self._graphs.trainable and w not in initializers)
            if absent:  # onnxruntime reads the maps for the trained weights only
                warn(f"{label}: {absent} are not initializers of the model; their entries are not used "
                     f"(trained: {self._graphs.trainable})")

    def _apply_initial_optimizer_state(self, initial: dict[str, dict[str, np.ndarray]]) -> None:
        z = self._zero
        trained = self._graphs.trainable
        untrained = sorted(w for w in initial if w != "shared_optimizer_state" and w not in trained)
        if untrained:  # onnxruntime looks up initial states for the trained weights only
            warn(f"set_optimizer_initial_state: {untrained} are not trained; their states are not used")
        for w, d in initial.items():
            if w in untrained:
                continue
            for key, v in d.items():
                if w == "shared_optimizer_state":
                    targets = [(key, v)]
                elif z is not None and w in z.shapes:
                    # full-size state, sliced to this rank's pieces (spec §11.5)
                    arr = np.asarray(v)
                    full = arr.shape == z.shapes[w]
                    targets = [
                        (f"{key}_{pc.name}", z.piece_view(pc, arr) if full else arr)
                        for pc in z.pieces
                        if pc.weight == w
                    ]
                else:
                    targets = [(f"{key}_{w}", v)]
                for name, value in targets:
                    if name not in self._store:
                        raise ValueError(f"set_optimizer_initial_state: no optimizer state {key!r} for {w!r}")
                    self._assign(name, value)

    def _get_plan(self, kind: str) -> GraphInterface:
        if kind not in self._plans:
            model = self._extra_models.get(kind) or getattr(self._graphs, PLAN_GRAPHS[kind])
            # the onnxruntime backend may write an updated state tensor into the donated old one; the graphs
            # that run in turn with "full" or "gradients" stop their threads spinning when their run ends
            # (measured, MLP with 2 accumulation steps: 3.46 ms per micro-step with both spinning on, 1.76 ms
            # with the accumulating graph's never spinning; its micro-step alone, stopping after its run
            # against never spinning: 0.94-1.19 against 1.13-1.30 ms)
            updates = {o: state for state, o in self._graphs.updates.get(kind, {}).items()}
            self._plans[kind] = self._new_plan(
                model, updates, keep_binding=kind in STEP_PLANS, follower=kind in FOLLOWER_PLANS,
                scalar_inputs=self._update_scalars() if kind == "update" else None,
            )
        return self._plans[kind]

    def _path_plan(self, names: list[str], extra: Sequence[str] = ()) -> GraphInterface:
        """The plan of only what the step computes on the way to ``names``: no update; the gradient
        accumulation buffers are written when the path runs through their accumulation (the global norm
        and the finiteness flag of a micro-step do, as onnxruntime's in-place accumulators wrote theirs), and
        the BatchNormalization running statistics when it runs their training-mode forward (gradients, their
        norm: onnxruntime's BatchNormInternal wrote them in place), their new values being extra outputs of
        the plan (:meth:`_path_updates`). ``extra``: values of the step graph returned after ``names`` (not
        outputs of the step)."""
        key = "path:" + "\0".join(sorted(names)) + ("\1" + "\0".join(extra) if extra else "")
        if key not in self._plans:
            full = self._graphs.full
            if extra:
                full = with_value_outputs(full, extra)
            model = model_for_outputs(full, [*names, *extra])
            computed = {o for n in model.graph.node for o in n.output}
            buffers = {v.name: v for v in model.graph.input}
            updates = {}
            for b, o in self._path_state().items():
                if o in computed:  # the accumulated value or new statistic: typed as its state
                    out = model.graph.output.add()
                    out.CopyFrom(buffers[b])
                    out.name = o
                    updates[o] = b
            self._plans[key] = self._new_plan(model, updates or None, False)
        return self._plans[key]

    def _forward_plan(self, names: list[str]) -> GraphInterface:
        """The plan of the evaluation graph cut to what ``names`` need (the whole of it when they need
        all): a path-only run of some outputs reads only the inputs on their path."""
        key = "forward:" + "\0".join(sorted(names))
        if key not in self._plans:
            forward = self._graphs.forward
            cut = model_for_outputs(forward, names)
            if len(cut.graph.node) == len(forward.graph.node):
                self._plans[key] = self._get_plan("forward")
            else:
                self._plans[key] = self._new_plan(cut, None, False)
        return self._plans[key]

    def _path_state(self) -> dict[str, str]:
        """State → output of the state a path plan writes when it computes the output: the running statistics
        and, under gradient accumulation, the buffers (whose micro-step graph writes both)."""
        return {**self._graphs.bn_stats, **self._graphs.updates.get("accumulate", {})}

    def _path_updates(self, plan: GraphInterface) -> list[tuple[str, str]]:
        """(state, output) of the accumulation buffers and running statistics a path plan writes (see
        :meth:`_path_plan`)."""
        return [(b, o) for b, o in self._path_state().items() if o in plan.output_info]

    def _new_plan(self, model: onnx.ModelProto, updates: Mapping[str, str] | None, keep_binding: bool,
                  follower: bool = False, scalar_inputs: Collection[str] | None = None) -> GraphInterface:
        """A plan of ``model`` on the session's backend, providers and options (``updates``: output → the
        state input it may be written into; ``scalar_inputs``: an update graph's, see ``make_plan``)."""
        plan = make_plan(model, self._backend, self._providers, self._sess_options, self._provider_options,
                         follower=follower, updates=updates, keep_binding=keep_binding,
                         random_state=self._random_state, scalar_inputs=scalar_inputs)
        # every graph's runs go in the trace, until end_profiling
        ended = getattr(self, "_profiling_ended", False)
        plan.profiling = bool(self._sess_options.enable_profiling) and not ended
        return plan

    def _warn_idle_options(self) -> None:
        """A warning for each option set to a value that does nothing under the others."""
        for message in self._params.idle_options():
            warn(f"TrainingParameters.{message}")

    def _check_loss_scale(self, feeds: Mapping[str, Any]) -> None:
        """The fed loss scale, when the session takes one, is a positive finite number."""
        if self.loss_scale_input_name and self.loss_scale_input_name in feeds:
            check_loss_scale_feed(self.loss_scale_input_name, feeds[self.loss_scale_input_name])

    # ---- running ----------------------------------------------------------------------
    @serialized
    def _run(
        self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], ro: RunOptions
    ) -> list[np.ndarray]:
        """Forward, backward and (when due) the optimizer update; returns the requested outputs. Ctrl-C
        waits for the run's end in one process (under MPI a rank must stop at once)."""
        with sigint_deferred(self._dp is None):
            return self._run_step(output_names, input_feed, ro)

    def _run_step(
        self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], ro: RunOptions
    ) -> list[np.ndarray]:
        names = self._output_list(output_names)
        kind = self._kind(names, ro)
        required = None
        if kind != "full":  # the model's own inputs (an optional one may be left out, as in a full run); an
            # evaluation of some outputs, those on their path (onnxruntime's label-less eval_step)
            reads = set(self._forward_plan(names).all_input_names) if kind == "forward" else None
            required = [n for n in self._graphs.user_inputs if self._check.containers.get(n) != "optional"
                        and (reads is None or n in reads)]
            if self.loss_scale_input_name and kind != "forward":  # gradients of the scaled loss
                required.append(self.loss_scale_input_name)
        feeds = self._check(input_feed, required)
        if self._graphs.same_size_dims and kind != "forward":
            from onnxtrain.engine.feed_sizes import check_same_sizes

            check_same_sizes(self._graphs.same_size_dims, feeds, "TrainingSession.run")
        self._check_loss_scale(feeds)
        if self._scale_as_one and np.ndim(feeds.get(self.loss_scale_input_name, ())) == 0:
            feeds[self.loss_scale_input_name] = np.reshape(feeds[self.loss_scale_input_name], [1])
        if self._graphs.has_training_mode and TRAINING_MODE not in feeds:
            # (the model's own Dropout mode, as onnxruntime's shared initializer copied it, unless the run
            # options turn it off)
            feeds[TRAINING_MODE] = np.asarray(bool(ro.training_mode) and self._graphs.training_mode_default)
        self._last_plan = None  # the plan this run runs, when one (peak_bytes)
        if kind == "full" and self._dp is not None and self._opt is not None:
            return self._run_data_parallel(names, feeds)
        if kind == "full" and self._halves:
            out = self._run_halves(names, feeds)
            if out is not None:
                return out
        path = kind in ("gradients", "micro-path")
        # under data parallelism the norm and the finiteness flag on the fetches' path are the ranks' (their
        # averaged gradients'), as in the step: the plan also returns what the rank's norm is taken from
        if path and ALL_DELTAS_FINITE in names:  # (the Adasum exchange's, made by an update step alone)
            if output_names is not None:
                raise ValueError(f"output {ALL_DELTAS_FINITE!r} is not computed on a gradient-accumulation "
                                 "micro-step or a run of the fetches' path alone: only an update step "
                                 "combines the ranks' deltas")
            names = [n for n in names if n != ALL_DELTAS_FINITE]
        sources = [s for s in self._path_norm_sources(names) if s not in names] if path else []
        if path:
            plan = self._path_plan(names, sources)
        else:
            plan = self._forward_plan(names) if kind == "forward" else self._get_plan(kind)
        if output_names is None:  # "all outputs" of this kind of run (a micro-step has no norm yet)
            names = [n for n in names if n in plan.output_info]
        else:
            missing = [n for n in names if n not in plan.output_info]
            if missing:
                raise ValueError(
                    f"output(s) {missing} are not computed on a gradient-accumulation micro-step"
                )
        kept = self._graphs.bn_stats if empty_run(feeds) else ()  # running statistics left as they were
        fed = {w: feeds[w] for w in self._fed_weights if w in feeds}  # trained weights the caller overrides
        feeds = self._feeds_of(plan, feeds)  # e.g. no learning rate when not updating
        feeds.update((w, v) for w, v in fed.items() if w in feeds)
        kept = (*kept, *fed)
        if path and self._backend != "numpy":  # onnxruntime writes the new running statistics of a
            # training-mode BatchNormalization into the buffers of the old ones when the graph does not
            # return them (a path run's): it gets copies, so the session's stay as on the numpy engine
            for s in self._graphs.bn_stats:
                if s in feeds:
                    feeds[s] = feeds[s].copy()
        if kind == "forward":
            upd_items: list[tuple[str, str]] = []
        elif kind in ("gradients", "micro-path"):
            upd_items = self._path_updates(plan)
        else:
            upd_items = list(self._graphs.updates[kind].items())
        # the old state arrays are the session's own (get_state and load_state copy), and each is replaced by
        # its update below: the plan may write the new values into them
        donate = [s for s, _ in upd_items if s in feeds and s not in kept]
        results = plan.run(feeds, names + sources + [o for _, o in upd_items], donate=donate)
        self._last_plan = plan
        for (state, _), v in zip(upd_items, results[len(names) + len(sources) :]):
            if state not in kept:
                self._store[state] = v
        if path and self._dp is not None:
            got = dict(zip(names + sources, results))
            results[: len(names)] = self._path_checks_across_ranks(names, got)
        if kind == "full" and self._graphs.buffers:
            for b in self._graphs.buffers:
                self._store[b] = np.zeros_like(self._store[b])
        if kind != "gradients":
            self._micro_step = 0 if kind == "full" else self._micro_step + (kind != "forward")
        out = results[: len(names)]
        # a path run's Identity of a weight is the session's array: the caller gets a copy
        return own_outputs(out, self._store) if kind != "full" else out

    def _output_list(self, output_names: Sequence[str] | None) -> list[str]:
        """As the base class's, and an unlisted loss (see _build) may be asked for by name."""
        unlisted = getattr(self, "_unlisted_outputs", ())
        if not unlisted or not output_names or isinstance(output_names, (str, bytes)):
            return super()._output_list(output_names)
        names = list(output_names)
        for n in names:  # (the base class's refusal, naming the caller's list)
            if not isinstance(n, str):
                raise InvalidFeedType(f"output names must be strings; got {type(n).__name__} {n!r} in "
                                      f"{output_names!r}")
        listed = [n for n in names if n not in unlisted]
        if listed:
            super()._output_list(listed)  # (the checks of the others)
        return names

    def _feeds_of(self, plan: GraphInterface, feeds: Mapping[str, Any],
                  given: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """What ``plan`` reads: the session's state, else the values ``given`` (gradients computed by another
        graph), else the caller's ``feeds``; inputs none of them holds are left out."""
        out = {n: feeds[n] for n in plan.all_input_names if n in feeds}
        if given:
            out.update(given)
        out.update((n, self._store[n]) for n in plan.all_input_names if n in self._store)
        return out

    def _kind(self, names: list[str], ro: RunOptions) -> str:
        g = self._graphs
        if ro.only_execute_path_to_fetches and all(n in g.user_outputs for n in names):
            return "forward"
        if g.accumulate is not None:
            if self._params.gradient_accumulation_mode == "auto":
                if self._micro_step + 1 >= self._params.gradient_accumulation_steps:
                    return "full"
                if all(n in self._get_plan("accumulate").output_info for n in names):
                    return "accumulate"
                return "micro-path"  # the norm or the finiteness flag of the sums so far: the path plan
            if (ro.only_execute_path_to_fetches and GROUP_OUTPUT in names
                    and all(n in self._get_plan("accumulate").output_info for n in names)):
                return "accumulate"  # else the path plan: with the norm, computed on the accumulated sums
        # gradients, their norm, the finiteness flag: the path to them stops before the optimizer
        return "gradients" if ro.only_execute_path_to_fetches and self._opt is not None else "full"

    def get_modelmeta(self) -> ModelMetadata:
        return self._user_meta

    @property
    def next_run_updates(self) -> bool:
        """Whether the next ``run()`` applies the optimizer update (onnxtrain's): under
        ``gradient_accumulation_mode = "auto"``, on the N-th run of each accumulation; otherwise, unless
        that run fetches ``Group_Accumulated_Gradients`` or runs only the path to its fetches."""
        steps = self._params.gradient_accumulation_steps
        if self._graphs.accumulate is None or self._params.gradient_accumulation_mode != "auto":
            return self._opt is not None
        return self._opt is not None and self._micro_step + 1 >= steps

    def finalize(self) -> None:
        """The legacy binding's shutdown hook (MPI on Windows); onnxtrain's communicator needs none."""

    def end_profiling(self) -> str:
        return end_profiling(self, list(self._plans.values()))

    # ---- state ------------------------------------------------------------------------
    def _state_names(self) -> list[str]:
        g = self._graphs
        return sorted([*g.trainable, *(s.name for s in self._specs), *g.bn_stats])

    @serialized
    def get_state(self) -> dict[str, np.ndarray]:
        """Trained weights, optimizer state and BatchNormalization running statistics, by name (copies);
        under mixed precision also the trained weights' half twins (``<w>_fp16``), as onnxruntime's."""
        state = {n: self._store[n].copy() for n in self._state_names()}
        state.update(self._half_twins())
        return dict(sorted(state.items()))

    def _mixed_precision(self) -> MixedPrecisionInfo | None:
        """What the mixed-precision pass did to the model (None without it)."""
        return self._graphs.mixed_precision

    def _trained(self) -> list[str]:
        """The trained weights this session holds (by the names it holds them under)."""
        return self._graphs.trainable

    def _twin_masters(self) -> dict[str, str]:
        """Under mixed precision, each trained weight's half twin (``<w>_fp16``) → the weight; else empty."""
        mp = self._mixed_precision()
        if mp is None:
            return {}
        return {mp.twins[w]: w for w in self._trained() if w in mp.twins and w in self._store}

    def _half_twins(self) -> dict[str, np.ndarray]:
        """The half copies of the trained weights under mixed precision, by their twins' names: the
        graph makes them from the masters each step, so they are derived state."""
        masters = self._twin_masters()
        if not masters:
            return {}
        copies = half_copies({w: self._store[w] for w in masters.values()}, self._mixed_precision().dtype)
        return {t: copies[w] for t, w in masters.items()}

    def _is_twin(self, name: str, value: Any, masters: Mapping[str, str]) -> bool:
        """Whether ``name`` is one of the half twins (``masters``: twin → weight; derived from the weights:
        checked, not loaded); ValueError when its shape is not its weight's, TypeError when its dtype is not
        the half type's."""
        if name not in masters:
            return False
        arr, want = np.asarray(value), self._store[masters[name]].shape
        if arr.shape != want:
            raise ValueError(f"state {name!r}: expected shape {list(want)}, got {list(arr.shape)}")
        half = half_copies({name: np.zeros(0, np.float32)}, self._mixed_precision().dtype)[name].dtype
        if arr.dtype != half:
            raise TypeError(f"state {name!r}: expected dtype {half} (the half twin of {masters[name]!r}), "
                            f"got {arr.dtype}")
        return True

    def _assign(self, name: str, value: Any) -> None:
        """Replace state ``name`` by a copy of ``value``: its shape, and its dtype or a float dtype that
        casts to it without loss (float32 moments saved for a float64 weight before they were kept in
        float64; bfloat16 or float16 moments for float32 ones)."""
        cur = self._store[name]
        arr = np.asarray(value)
        if arr.shape != cur.shape:
            raise ValueError(f"state {name!r}: expected shape {list(cur.shape)}, got {list(arr.shape)}")
        if arr.dtype != cur.dtype and not widens_exactly(arr.dtype, cur.dtype):
            raise TypeError(f"state {name!r}: expected dtype {cur.dtype}, got {arr.dtype}")
        if self._pending is not None:  # (an all_or_nothing load: copied once every value passed)
            self._pending[name] = arr
        else:
            self._store[name] = arr.astype(cur.dtype)  # a copy

    @raises_as_onnxruntime
    @serialized
    @all_or_nothing
    def load_state(self, state: Mapping[str, Any], strict: bool = False) -> None:
        """Copy ``state`` (as from ``get_state()``) into the session; shapes and dtypes must match.
        ``strict``: every name given must be a state tensor of the session (names not given keep their
        values, as in onnxruntime).

        Under ZeRO stage 1, unpartitioned optimizer state (as from ``gather_state()``) is sliced to this
        rank's pieces, and the optimizer state of weights another rank updates is skipped.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"load_state takes a mapping of names to arrays, got {type(state).__name__}")
        if isinstance(strict, (str, bytes)):  # ("no" would be true; ints and numpy bools are taken)
            raise TypeError(f"load_state's strict must be a bool, got {type(strict).__name__} {strict!r}")
        known = set(self._state_names())
        zero_names = self._zero_full_names() if self._zero is not None else {}
        twins = self._twin_masters()
        for name, value in state.items():
            if isinstance(value, Mapping):  # (get_model_state()'s nesting: onnxruntime refused it too)
                raise TypeError(f"load_state: {name!r} holds a {type(value).__name__}, not an array; "
                                "load_state takes the flat {name: array} layout of get_state()")
            if self._is_twin(name, value, twins):  # derived from the masters (loaded too)
                continue
            if name not in known:
                if name in zero_names:
                    arr = np.asarray(value)
                    for local, pc, elementwise in zero_names[name]:
                        full = elementwise and arr.shape == self._zero.shapes[pc.weight]
                        self._assign(local, self._zero.piece_view(pc, arr) if full else arr)
                    continue
                if self._zero is not None and name in self._all_optimizer_state_names():
                    continue  # optimizer state of a weight another rank updates
                if strict:
                    raise KeyError(
                        f"load_state: {name!r} is not a state tensor of this session; known: {sorted(known)}"
                    )
                continue
            self._assign(name, value)

    def _all_optimizer_state_names(self) -> set[str]:
        """Names the optimizer state of every trained weight has, whichever rank holds it."""
        if self._opt is None:
            return set()
        slots = [WeightSlot(w, "", (), 1) for w in self._graphs.trainable]
        return {sp.name for sp in self._opt.state(slots)}

    @serialized
    def get_model_state(
        self, include_mixed_precision_weights: bool = False
    ) -> dict[str, dict[str, np.ndarray]]:
        out = {"full_precision": {w: self._store[w].copy() for w in self._graphs.trainable}}
        if include_mixed_precision_weights:
            mp = self._graphs.mixed_precision
            out["mixed_precision"] = {} if mp is None else half_copies(out["full_precision"], mp.dtype)
        return out

    @serialized
    def get_optimizer_state(self) -> dict[str, dict[str, np.ndarray]]:
        out: dict[str, dict[str, np.ndarray]] = {}
        for sp in self._specs:
            key = sp.weight or "shared_optimizer_state"
            if self._zero is not None and key in self._zero.piece_of:
                key = self._zero.piece_of[key].weight  # a piece's state, under its weight's name
            out.setdefault(key, {})[sp.key] = self._store[sp.name].copy()
        return out

    def get_partition_info_map(self) -> dict[str, dict[str, list[int]]]:
        """ZeRO stage 1: ``{weight: {"original_dim": [...], "megatron_row_partition": [-1]}}`` for the
        weights that straddle this rank's partition boundary; empty otherwise."""
        return (
            {}
            if self._zero is None
            else {w: {k: list(v) for k, v in d.items()} for w, d in self._zero.partition_info.items()}
        )

    def is_output_fp32_node(self, output_name: str) -> bool:
        for n in self._graphs.full.graph.node:
            if output_name in n.output:
                types = {
                    v.name: v for v in (*self._graphs.full.graph.output, *self._graphs.full.graph.value_info)
                }
                v = types.get(output_name)
                if v is None:
                    inferred = onnx.shape_inference.infer_shapes(self._graphs.full)
                    v = next((x for x in inferred.graph.value_info if x.name == output_name), None)
                return v is not None and v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        raise InvalidFeed(f"{output_name!r} is not produced by any node of the training graph")


def _check_user_nodes(model: onnx.ModelProto) -> None:
    """Raise the :class:`InvalidNodeError` naming the nodes of the user's ``model`` that their schemas do
    not allow, if any."""
    from onnxtrain.engine.node_checks import check_nodes  # (onnxruntime sessions load it only here)

    check_nodes(model)
