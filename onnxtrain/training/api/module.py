"""``Module``: runs the training and eval models over a :class:`CheckpointState` (spec §3).

The training model takes the user inputs, every parameter, one gradient accumulation buffer per
trainable parameter and ``lazy_reset_grad``; it returns the user outputs and the new buffers
(``<p>_grad.accumulation.out``), which become the parameters' ``.grad`` (written into the arrays held
``.grad`` values refer to: ``checkpoint_state.replace_grads``). The new running statistics of
training-mode BatchNormalization nodes are written into their (frozen) parameters.

Mixed-precision artifacts (``generate_artifacts(..., mixed_precision="float16")``) also take
``loss_scale``: the Module feeds it from its loss scaler (``Module(..., loss_scaler=...)``, by
default a ``DynamicLossScaler``), so ``.grad`` holds gradients of ``loss · loss_scale``; the
:class:`Optimizer` unscales them, skips non-finite steps and updates the scaler. The scale is taken
on the call that starts a new accumulation (after construction or ``lazy_reset_grad``) and kept while
gradients accumulate, so every accumulated gradient has the same scale.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from onnxtrain.capi.feeds import empty_run
from onnxtrain.capi.outputs import outputs_apart, own_outputs, unshared_with
from onnxtrain.engine.backends import (
    backend_of,
    fusion_choice,
    intra_op_threads,
    make_plan,
    numpy_fuse,
    session_config_entry,
)
from onnxtrain.engine.feed_sizes import (
    check_same_sizes,
    same_size_dims,
    shared_dim_mismatch,
    shared_dim_slots,
    sizes_agree,
)
from onnxtrain.engine.interface import GraphInterface, UnsupportedOpError
from onnxtrain.errors import raises_as_onnxruntime
from onnxtrain.graph_transforms.loss_scaler import DynamicLossScaler, LossScaler
from onnxtrain.graph_transforms.mixed_precision import mixed_precision_info
from onnxtrain.interrupts import sigint_deferred
from onnxtrain.ir.builder import NameGen, pausing_gc
from onnxtrain.ir.graphs import eval_batch_norms, last_statistics
from onnxtrain.model_config_env import warn_on_device_model_config
from onnxtrain.session_loading import check_numpy_engine_entries
from onnxtrain.training.api._accumulation import (
    ACCUMULATED_SUFFIX,
    BUFFER_SUFFIX,
    RESET_INPUT,
    overwrite_variant,
)
from onnxtrain.training.api._export import export_for_inference
from onnxtrain.training.api._graph import (
    InputSpec,
    ModelLike,
    check_device,
    check_user_inputs,
    is_optimizer_model,
    load_model,
)
from onnxtrain.training.api._profile import (
    SessionProfile,
    profiles_written_at_collection,
    session_option,
    write_optimized_model,
)
from onnxtrain.training.api.checkpoint_state import (
    LOAD_HINT,
    CheckpointState,
    NominalStateError,
    drop_unheld_grads,
    replace_grads,
)
from onnxtrain.training.ort_artifacts import translate_training_model
from onnxtrain.user_warning import warn

LOSS_SCALING_KEY = "onnxtrain.loss_scaling"


def loss_scaling(model: onnx.ModelProto) -> dict[str, str] | None:
    """The loss-scaling record of generated mixed-precision artifacts (None: no loss scaling)."""
    for p in model.metadata_props:
        if p.key == LOSS_SCALING_KEY:
            return dict(json.loads(p.value))
    info = mixed_precision_info(model)
    return None if info is None else {"loss_scale": info.loss_scale}


class _Shape(tuple):
    """A shape tuple that can also be called, as onnxruntime's ``OrtValue.shape()``: a list of the dims."""

    __slots__ = ()

    def __call__(self) -> list[int]:
        return list(self)


class ContiguousBuffer(np.ndarray):
    """A 1-D numpy array of parameters that also answers the calls scripts written for onnxruntime make on
    the ``OrtValue`` it returns: ``.numpy()``, ``.shape()`` (a list; ``.shape`` stays numpy's tuple),
    ``.data_type()`` (``'tensor(float)'``), ``.element_type()`` (the ONNX type number), ``.device_name()``,
    ``.is_tensor()``, ``.has_value()``, ``.data_ptr()``."""

    @property  # type: ignore[override]
    def shape(self) -> _Shape:
        return _Shape(np.ndarray.shape.__get__(self))

    @shape.setter
    def shape(self, value: Any) -> None:
        np.ndarray.shape.__set__(self, value)

    def numpy(self) -> np.ndarray:
        return self.view(np.ndarray)

    def element_type(self) -> int:
        return int(onnx.helper.np_dtype_to_tensor_dtype(self.dtype))

    def data_type(self) -> str:
        return f"tensor({onnx.TensorProto.DataType.Name(self.element_type()).lower()})"

    def device_name(self) -> str:
        return "Cpu"

    def is_tensor(self) -> bool:
        return True

    def has_value(self) -> bool:
        return True

    def data_ptr(self) -> int:
        return int(self.ctypes.data)


def _ortvalue_class(values: Sequence[Any]) -> Any:
    """The class of ``values`` when they are all ``OrtValue``-like (not numpy arrays, with ``numpy()`` and
    a class method ``ortvalue_from_numpy``) and of one class; else None."""
    if values and type(values[0]) is np.ndarray:  # (the usual call: numpy arrays)
        return None
    kinds = {type(v) for v in values}
    if len(kinds) != 1:
        return None
    (cls,) = kinds
    if issubclass(cls, np.ndarray) or not callable(getattr(cls, "numpy", None)):
        return None
    return cls if callable(getattr(cls, "ortvalue_from_numpy", None)) else None


def _own(outs: list[Any], user_feeds: dict[str, Any]) -> list[Any]:
    """``outs`` as the caller's own arrays, as onnxruntime-training gives them: none shares memory with the
    caller's inputs (a Flatten of an input) or with another output (an Identity of an output), each is
    writable and row-major (:mod:`onnxtrain.capi.outputs`)."""
    return outputs_apart(own_outputs(outs, user_feeds))


def _unshared(outs: list[Any], params: Iterable[Any]) -> list[Any]:
    """``outs`` with a copy of each output that is a parameter's array or a view into one (an output that
    reshapes or slices a weight): the caller's arrays must not change with the next update, nor change the
    weights, as onnxruntime-training's do not (:func:`~onnxtrain.capi.outputs.unshared_with`)."""
    return unshared_with(outs, (a for p in params for a in (p.data, p.grad)))


def _expose_running_stats(model: onnx.ModelProto, state: CheckpointState
                          ) -> tuple[onnx.ModelProto, dict[str, str], set[str]]:
    """``model`` with the new running statistics of its training-mode BatchNormalization nodes as graph
    outputs, {frozen parameter: the output holding its new value} and the outputs added (not user outputs).

    Such a node (torch's export in training mode, or onnxruntime-training's ``BatchNormInternal`` once
    translated) returns ``running_mean · momentum + batch_mean · (1 − momentum)`` and the same for the
    variance (the batch's biased variance, as ONNX defines it); the training step writes them back into
    the state, as onnxruntime-training does, so that eval mode and the exported model use them. The model
    is copied before it is changed (it may be the caller's proto)."""
    params = state._params
    inputs = {v.name: v for v in model.graph.input}
    found: list[tuple[int, int, str]] = []  # (node index, output index, parameter)
    for k, n in enumerate(model.graph.node):
        if n.op_type != "BatchNormalization" or n.domain not in ("", "ai.onnx"):
            continue
        if not any(a.name == "training_mode" and a.i for a in n.attribute):
            continue
        for out_index, in_index in ((1, 3), (2, 4)):
            name = n.input[in_index] if len(n.input) > in_index else ""
            p = params.get(name)
            if p is not None and not p.requires_grad and name in inputs:
                found.append((k, out_index, name))
    if not found:
        return model, {}, set()
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    names = NameGen({o for n in g.node for o in n.output} | set(inputs) | {t.name for t in g.initializer})
    graph_outputs = {v.name for v in g.output}
    stats: dict[str, str] = {}
    added: set[str] = set()
    for k, out_index, name in found:
        node = g.node[k]
        while len(node.output) <= out_index:
            node.output.append("")
        if not node.output[out_index]:
            node.output[out_index] = names(f"{name}.running_update")
        result = last_statistics(g.node, node.output[out_index], out_index)  # the layer's last application
        if result not in graph_outputs:
            vi = g.output.add()
            vi.CopyFrom(inputs[name])
            vi.name = result
            graph_outputs.add(result)
            added.add(result)
        stats[name] = result
    return out, stats, added


def _compile(model: onnx.ModelProto, what: str, session_options: Any = None, follower: bool = False,
             updates: dict[str, str] | None = None,
             random_state: dict[Any, dict[Any, Any]] | None = None,
             scalar_inputs: Collection[str] | None = None) -> GraphInterface:
    """The model compiled on the backend ``session_options`` name (config entry ``onnxtrain.backend``);
    ``follower``: it runs right after the training model; ``updates``: output → the input it replaces
    (see ``make_plan``); ``random_state``: shared by the plans whose random nodes must not repeat each
    other's draws; ``scalar_inputs``: see ``make_plan``. The training and optimizer models keep
    onnxruntime's binding between runs."""
    backend = backend_of(session_options)
    try:
        if backend != "numpy":
            return make_plan(model, backend, None, session_options, follower=follower, updates=updates,
                             keep_binding=what in ("training", "optimizer"), random_state=random_state,
                             scalar_inputs=scalar_inputs)
        from onnxtrain.engine.plan import compile_model  # here: onnxruntime sessions never load it

        # an InferenceSession's options for the numpy plan: its thread count and fusion (the defaults when
        # the options leave them unset; _check_session_options gave numpy_fuse's warnings once)
        return compile_model(model, random_state=random_state, threads=intra_op_threads(session_options),
                             fuse=fusion_choice(session_options))
    except UnsupportedOpError as e:
        foreign = sorted({n.domain for n in model.graph.node if n.domain not in ("", "ai.onnx")})
        # (onnxruntime-training's com.microsoft operators never get here: Module translates them on load)
        hint = (f" The model uses operators of domain(s) {foreign}, which onnxtrain has no kernels for."
                if foreign else "")
        raise UnsupportedOpError(f"cannot run the {what} model: {e}.{hint}") from None


def _check_session_options(options: Any) -> None:
    """Refuse weight prepacking, as onnxruntime-training's Module does; name the SessionOptions a Module on
    the numpy engine does not apply (once per Module, not per plan): those the numpy engine has no use
    for."""
    if options is None:
        return
    prepacking = session_config_entry(options, "session.disable_prepacking")
    if prepacking not in ("", "1"):
        raise ValueError(f"Prepacking is not supported for training scenarios: the session config entry "
                         f"session.disable_prepacking must be '1' (or unset), got {prepacking!r}")
    if backend_of(options) != "numpy":
        return
    numpy_fuse(options)  # (its warnings; its fusion choice is _compile's)
    # config entries the engine cannot honour: as an InferenceSession's (a Module runs on the CPU device)
    check_numpy_engine_entries(options, ["CPUExecutionProvider"])


class Module:
    """The training and eval models of a generated artifact set, bound to a :class:`CheckpointState`.

    Example::

        state = CheckpointState.load_checkpoint("checkpoint")
        module = Module("training_model.onnx", state, "eval_model.onnx")
        loss = module(x, y)            # training mode: gradients accumulate in state.parameters[p].grad
        module.eval(); eval_loss = module(x, y)

    ``loss_scaler`` (onnxtrain extension): the scaler feeding ``loss_scale`` to mixed-precision
    training models (default: a new ``DynamicLossScaler()``); refused for models without loss scaling.
    A dynamic scaler resumes the scale and count of clean steps the state holds (saved in its
    checkpoint, or of a Module trained over it before); ``module.loss_scaler.reset()`` starts afresh.
    """

    @raises_as_onnxruntime
    @pausing_gc
    def __init__(self, train_model_uri: ModelLike, state: CheckpointState,
                 eval_model_uri: ModelLike | None = None, device: str = "cpu",
                 session_options: Any = None, *, loss_scaler: LossScaler | None = None) -> None:
        if not isinstance(state, CheckpointState):
            raise TypeError(f"state must be a CheckpointState, got {type(state).__name__}")
        check_device(device)
        _check_session_options(session_options)
        warn_on_device_model_config("Module")
        self._state = state
        self._session_options = session_options
        self.training = True
        self._accumulate = False  # §3.3: the first train call after construction or a reset overwrites
        # SessionOptions.enable_profiling: the traces of the training and eval models (None: not profiled)
        self._train_profile: SessionProfile | None = None
        times: dict[str, tuple[int, int]] = {}  # the loading and initialization spans of the traces
        begin = time.perf_counter_ns()
        # artifacts of onnxruntime-training: their private operators rewritten as standard ONNX
        train_model, train_path = load_model(train_model_uri, "training")
        self._train_model = translate_training_model(train_model)
        del train_model
        times["training loading"] = (begin, time.perf_counter_ns())
        # BatchNormalization running statistics the training step updates (frozen parameter -> output)
        self._train_model, self._running_stats, self._added_outputs = _expose_running_stats(
            self._train_model, state)
        # dims the gradient takes for one size (our artifacts'; a step refuses feeds that break it)
        self._same_size = same_size_dims(self._train_model)
        self._eval_model: onnx.ModelProto | None = None
        self._eval_plan: GraphInterface | None = None
        # parameters of the state the eval model holds as initializers of its own (_classify_eval_graph)
        self._eval_shadowed: list[str] = []
        eval_path = None
        if eval_model_uri is not None:
            begin = time.perf_counter_ns()
            eval_model, eval_path = load_model(eval_model_uri, "eval")
            if is_optimizer_model(eval_model):
                shown = f" {eval_path}" if eval_path else ""
                raise ValueError(f"eval_model_uri{shown} is an optimizer model, not an eval model: pass it "
                                 "to Optimizer(optimizer_model, module)")
            self._eval_model = eval_batch_norms(translate_training_model(eval_model))
            times["eval loading"] = (begin, time.perf_counter_ns())
            self._eval_plan = _compile(self._eval_model, "eval", session_options)
            times["eval initialization"] = (times["eval loading"][1], time.perf_counter_ns())
        self._classify_training_graph()
        if self._eval_model is not None:
            self._classify_eval_graph()
        if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
            raise TypeError(f"loss_scaler must be an onnxtrain.graph_transforms.loss_scaler.LossScaler (e.g. "
                            f"DynamicLossScaler()), got {type(loss_scaler).__name__}")
        if self._loss_scale_input is None:
            if loss_scaler is not None:
                raise ValueError("loss_scaler given but the training model takes no loss scale: generate the "
                                 "artifacts with mixed_precision='float16' (or 'bfloat16')")
            self._loss_scaler: LossScaler | None = None
        else:
            self._loss_scaler = loss_scaler if loss_scaler is not None else DynamicLossScaler()
            state._attach_loss_scaler(self._loss_scaler)  # resumes a saved scaler state
        self._grad_loss_scale: np.ndarray | None = None  # the scale of the gradients accumulated now
        # Modules over one state share its gradients (onnxruntime-training gives each Module buffers of its
        # own): a new Module leaves them as they are, so that another Module's Optimizer still steps with
        # the gradients its Module made (the README: call lazy_reset_grad() to start this one from zero)
        for p in self._trainable:
            param = state._params[p]
            if param.grad is None and param.data is not None:
                param.grad = np.zeros_like(param.data)
        # a step that overwrites the gradients (the usual one, after lazy_reset_grad) runs a variant without
        # the accumulators, and the accumulating model is compiled on the first step that accumulates:
        # onnxruntime would run the accumulators anyway, and the numpy engine, which skips them, still pays
        # for six selects out of cache (MLP 784-512-512-10: 35 µs a step)
        variant = None
        if self._has_reset:
            variant = overwrite_variant(self._train_model,
                                        self._trainable + self._unheld_trainable + self._frozen_trained)
        self._overwrite_plan: GraphInterface | None = None
        self._full_plan: GraphInterface | None = None
        self._last_step_plan: GraphInterface | None = None
        # the two forms of the training model are one model to the user: a seeded Dropout's draws go on from
        # one to the other (each plan's own generator restarted from the seed: steps repeated masks)
        self._random_state: dict[Any, dict[Any, Any]] = {}
        begin = time.perf_counter_ns()
        if variant is not None:
            self._overwrite_plan = _compile(variant, "training", session_options,
                                            random_state=self._random_state)
        else:
            self._full_plan = _compile(self._train_model, "training", session_options,
                                       random_state=self._random_state)
        times["training initialization"] = (begin, time.perf_counter_ns())
        # onnxruntime-training's training session, then its eval session, write their optimized models to the
        # one path: the eval model's is left there (the training model's without one)
        write_optimized_model(session_options, self._eval_model if self._eval_model is not None
                              else self._train_model)
        if session_option(session_options, "enable_profiling"):
            self._start_profiles(times, train_path is not None, eval_path is not None)

    def _start_profiles(self, times: dict[str, tuple[int, int]], train_file: bool, eval_file: bool) -> None:
        """Profile the training and eval models' plans, each model in a trace of its own written when this
        Module is collected (as onnxruntime-training's sessions write theirs when destroyed)."""
        options = self._session_options
        profiles = []
        self._train_profile = SessionProfile(options, "training", train_file, times["training loading"])
        profiles.append(self._train_profile)
        try:
            init: tuple[int, int] | None = times["training initialization"]
            for attr in ("_overwrite_plan", "_full_plan"):
                plan = getattr(self, attr)
                if plan is not None:
                    setattr(self, attr, self._train_profile.watch(plan, init))
                    init = None
            if self._eval_plan is not None:
                eval_profile = SessionProfile(options, "eval", eval_file, times["eval loading"])
                profiles.append(eval_profile)
                self._eval_plan = eval_profile.watch(self._eval_plan, times["eval initialization"])
        except BaseException:
            for p in profiles:
                p.discard()
            raise
        profiles_written_at_collection(self, profiles)

    @property
    def _step_plan(self) -> GraphInterface:
        """The plan that ran the last training step (before any: the one the next step will run)."""
        if self._last_step_plan is not None:
            return self._last_step_plan
        overwrite = self._overwrite_plan is not None and not self._accumulate
        return self._overwrite_plan if overwrite else self._train_plan

    @property
    def _train_plan(self) -> GraphInterface:
        """The training model's plan (with the gradient accumulators), compiled when first needed."""
        if self._full_plan is None:
            plan = _compile(self._train_model, "training", self._session_options,
                            random_state=self._random_state)
            self._full_plan = plan if self._train_profile is None else self._train_profile.watch(plan)
        return self._full_plan

    def _release_bindings(self) -> None:
        """Let the training plans drop the arrays their kept bindings hold (before an Optimizer moves the
        weights into its flat buffers: it keeps the arrays that something else holds)."""
        for plan in (self._overwrite_plan, self._full_plan):
            if plan is not None:
                plan.release_binding()

    # ---------------------------------------------------------------- graph interface
    def _classify_training_graph(self) -> None:
        g = self._train_model.graph
        params = self._state._params
        init = {t.name for t in g.initializer}
        inputs = [v for v in g.input if v.name not in init]
        names = {v.name for v in inputs}
        # the base model (or another artifact set's training model) passed as the training model: its own
        # values of the state's parameters would be used, and no gradient of them computed
        self._train_shadowed = [t.name for t in g.initializer if t.name in params]
        if self._train_shadowed:
            warn(self._shadowing("training"))
        self._param_order: list[str] = [v.name for v in inputs if v.name in params]
        self._trainable = [p for p in self._param_order if params[p].requires_grad]
        self._buffers = {p: p + BUFFER_SUFFIX for p in self._trainable if p + BUFFER_SUFFIX in names}
        outputs = [v.name for v in g.output]
        self._accumulated = {p: p + ACCUMULATED_SUFFIX for p in self._trainable
                             if p + ACCUMULATED_SUFFIX in outputs}
        missing = [p for p in self._trainable if p not in self._buffers or p not in self._accumulated]
        if missing:
            raise ValueError(
                f"the training model does not accumulate the gradient of trainable parameter(s) {missing}: "
                f"expected inputs '<p>{BUFFER_SUFFIX}' and outputs '<p>{ACCUMULATED_SUFFIX}' (was it "
                "generated with these parameters in requires_grad?)")
        self._has_reset = RESET_INPUT in names
        record = loss_scaling(self._train_model)
        self._loss_scale_input = record["loss_scale"] if record and record["loss_scale"] in names else None
        hidden = set(self._param_order) | set(self._buffers.values()) | {RESET_INPUT}
        if self._loss_scale_input is not None:
            hidden.add(self._loss_scale_input)
        # buffers of parameters this state does not hold: not user inputs either
        hidden |= {n for n in names if n.endswith(BUFFER_SUFFIX)}
        self._train_inputs = [InputSpec.of(v) for v in inputs if v.name not in hidden]
        self._train_shared_dims = shared_dim_slots(self._train_inputs)
        self._train_outputs = [n for n in outputs if not n.endswith(ACCUMULATED_SUFFIX)
                               and n not in self._added_outputs]
        # parameters of the model the checkpoint lacks: user inputs, as in onnxruntime-training (§3.1), whose
        # gradient buffers the Module feeds with zeros and whose gradients it drops
        self._unheld_trainable = [s.name for s in self._train_inputs if s.name + BUFFER_SUFFIX in names
                                  and s.name + ACCUMULATED_SUFFIX in outputs]
        # parameters the checkpoint freezes but the training model trains (artifacts generated with them in
        # requires_grad): they stay frozen, their gradient buffers fed with zeros and their gradients dropped
        self._frozen_trained = [p for p in self._param_order if not params[p].requires_grad
                                and p + BUFFER_SUFFIX in names and p + ACCUMULATED_SUFFIX in outputs]
        if self._frozen_trained:
            warn(f"the training model computes gradients of parameter(s) {self._frozen_trained} that the "
                 "checkpoint holds as frozen: they stay frozen and their gradients are dropped (generate the "
                 "artifacts with them in frozen_params to save that work)")
        self._warn_unheld(inputs, names, "training")
        self._check_param_shapes(self._train_model, "training")

    def _warn_unheld(self, inputs: Sequence[onnx.ValueInfoProto], names: set[str], what: str) -> None:
        """Warn about graph inputs that are parameters of the model but not of the checkpoint: those with a
        gradient buffer, and those among the parameter inputs (generated models list the user inputs first,
        then the parameters in initializer order, then the buffers)."""
        params = self._state._params
        order = [v.name for v in inputs]
        at = [i for i, n in enumerate(order) if n in params or n.endswith(BUFFER_SUFFIX) or n == RESET_INPUT]
        first = at[0] if at else len(order)
        trainable = [n for n in order if n not in params and n + BUFFER_SUFFIX in names]
        frozen = [n for n in order[first:] if n not in params and n not in trainable
                  and not n.endswith(BUFFER_SUFFIX) and n not in (RESET_INPUT, self._loss_scale_input)]
        where = f"the checkpoint {self._state.path!r}" if self._state.path else "the checkpoint state"
        if trainable:
            warn(f"the {what} model trains parameter(s) {trainable} that {where} does not hold: "
                 "they are user inputs of the Module, in the order of input_names() (a parameter the "
                 "checkpoint lacks comes after the other inputs; a graph input whose gradient the artifacts "
                 "compute keeps its place); their gradients are not kept, and an Optimizer cannot update "
                 "them")
        if frozen:
            warn(f"the {what} model reads parameter(s) {frozen} that {where} does not hold: they "
                 "are user inputs of the Module (pass their values after the other inputs)")

    def _classify_eval_graph(self) -> None:
        assert self._eval_model is not None
        g = self._eval_model.graph
        init = {t.name for t in g.initializer}
        inputs = [v for v in g.input if v.name not in init]
        self._eval_params = [v.name for v in inputs if v.name in self._state._params]
        hidden = set(self._eval_params) | {RESET_INPUT}
        self._eval_inputs = [InputSpec.of(v) for v in inputs if v.name not in hidden]
        self._eval_shared_dims = shared_dim_slots(self._eval_inputs)
        if self._eval_params:  # (what the training model lacks was reported already)
            training = {s.name for s in self._train_inputs}
            self._warn_unheld([v for v in inputs if v.name not in training], {v.name for v in inputs}, "eval")
        self._eval_outputs = [v.name for v in g.output]
        self._check_param_shapes(self._eval_model, "eval")
        # the base model (or an eval model of other artifacts) passed as the eval model: its own values of the
        # state's parameters are not the trained ones. onnxruntime-training builds the Module and refuses the
        # evaluation (it feeds the parameters to a model that does not take them); its export writes the eval
        # model's values
        self._eval_shadowed = [t.name for t in g.initializer if t.name in self._state._params]
        if self._eval_shadowed:
            warn(self._shadowing("eval"))

    def _shadowing(self, what: str) -> str:
        """Why a training call (``what`` "training") or an evaluation ("eval") is refused: its model holds
        parameters of the state as initializers of its own."""
        if what == "training":
            names, step = self._train_shadowed, ("a training call would neither read the state's values nor "
                                                  "compute their gradients")
        else:
            names, step = self._eval_shadowed, ("an evaluation would not see the trained values; "
                                                "export_model_for_inferencing writes the eval model's own")
        return (f"the {what} model holds parameter(s) {names} of the checkpoint state as initializers of its "
                f"own: {step}, so it is refused, as onnxruntime-training refuses it. Pass the {what} model "
                "generate_artifacts wrote, which takes the parameters as inputs")

    def _check_param_shapes(self, model: onnx.ModelProto, what: str) -> None:
        params = self._state._params
        for v in model.graph.input:
            p = params.get(v.name)
            if p is None:
                continue
            spec = InputSpec.of(v)
            if spec.dtype is not None and spec.dtype != p.dtype:
                raise TypeError(f"parameter {v.name!r}: the checkpoint holds {p.dtype}, the {what} model "
                                f"expects {spec.dtype}")
            if p.data is not None and spec.shape is not None and (
                    len(spec.shape) != p.data.ndim
                    or any(isinstance(d, int) and d != s for d, s in zip(spec.shape, p.data.shape))):
                raise ValueError(f"parameter {v.name!r}: the checkpoint holds shape {list(p.data.shape)}, "
                                 f"the {what} model expects {spec.describe_shape()}")

    # ---------------------------------------------------------------- modes and names
    def train(self, mode: bool = True) -> Module:
        """Switch to training mode (``mode=False``: eval mode); returns self."""
        self.training = bool(mode)
        return self

    def eval(self) -> Module:
        """Switch to eval mode; returns self."""
        return self.train(False)

    def input_names(self) -> list[str]:
        """User input names of the current mode's graph (parameters, buffers and the reset flag hidden)."""
        if self.training:
            return [s.name for s in self._train_inputs]
        return [s.name for s in self._eval_inputs] if self._eval_model is not None else []

    def output_names(self) -> list[str]:
        """User output names of the current mode's graph (loss first)."""
        if self.training:
            return list(self._train_outputs)
        return list(self._eval_outputs) if self._eval_model is not None else []

    # ---------------------------------------------------------------- steps
    @raises_as_onnxruntime
    def __call__(self, *user_inputs: Any) -> Any:
        r"""Run one training step (training mode) or evaluation (eval mode) on positional inputs.

        Returns one array for one output, else a tuple, in :meth:`output_names` order; when every input is
        an ``OrtValue`` (onnxtrain's or onnxruntime's), the outputs are ``OrtValue``\ s of the same class.
        """
        outs: list[Any] = self._run_step(user_inputs, self.training)
        wrap = _ortvalue_class(user_inputs)
        if wrap is not None:
            outs = [wrap.ortvalue_from_numpy(o) for o in outs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _run_step(self, user_inputs: Sequence[Any], training: bool) -> list[np.ndarray]:
        """One training step (``training``) or evaluation on positional inputs, whatever the mode: the
        outputs as arrays. A training step holds the state (one call at a time with ``Optimizer.step`` and
        saves) and lets Ctrl-C stop only after it (all or nothing); an evaluation holds it too, so it never
        reads the parameters halfway through a step."""
        if training:
            with self._state._lock, sigint_deferred():
                return self._train_step(user_inputs)
        with self._state._lock:  # an evaluation reads the parameters a step in another thread writes
            return self._eval_step(user_inputs)

    def _param_feeds(self, names: Sequence[str], refusal: str) -> dict[str, np.ndarray]:
        """The values of parameters ``names``; on a nominal state, NominalStateError(``refusal`` + how to
        load the values)."""
        params = self._state._params
        feeds = {}
        for n in names:
            data = params[n].data
            if data is None:
                raise NominalStateError(f"{refusal} Please load the model parameters first. {LOAD_HINT}")
            feeds[n] = data
        return feeds

    def _train_step(self, user_inputs: Sequence[Any]) -> list[np.ndarray]:
        if self._train_shadowed:
            raise ValueError(self._shadowing("training"))
        feeds = check_user_inputs(self._train_inputs, user_inputs, "the training model")
        if self._same_size:
            check_same_sizes(self._same_size, feeds, "the training model")
        user_feeds = dict(feeds)  # (the outputs must not share memory with them)
        # an empty batch leaves BatchNorm's running statistics as they were
        empty_batch = bool(self._running_stats) and empty_run(feeds)
        feeds.update(self._param_feeds(self._param_order, "Cannot perform TrainStep with a nominal state."))
        params = self._state._params
        overwrite = self._overwrite_plan is not None and not self._accumulate
        if not overwrite:
            for p, buf in self._buffers.items():
                if params[p].grad is None:  # the state was nominal when this Module was built
                    params[p].grad = np.zeros_like(feeds[p])
                feeds[buf] = params[p].grad
            for p in self._unheld_trainable + self._frozen_trained:  # their gradients are dropped
                feeds[p + BUFFER_SUFFIX] = np.zeros_like(feeds[p])
            if self._has_reset:
                feeds[RESET_INPUT] = np.array([not self._accumulate])
        if self._loss_scale_input is not None:
            feeds[self._loss_scale_input] = self._loss_scale_feed()
        wanted = self._train_outputs + [self._accumulated[p] for p in self._trainable]
        wanted += self._running_stats.values()
        plan = self._overwrite_plan if overwrite else self._train_plan
        assert plan is not None
        kw: dict[str, Any] = {}
        if overwrite and getattr(plan, "backend", None) == "onnxruntime":
            # the new gradients go into the old ones' arrays, as the accumulating step's do (onnxruntime's
            # arena would otherwise hold two generations of them: peak RSS of the bench's LeNet 94.0 -> 91.7
            # MiB, of the MLP 103.2 -> 99.0)
            kw["reuse"] = {self._accumulated[p]: params[p].grad for p in self._trainable
                           if params[p].grad is not None}
        dropped = []
        if overwrite and not kw:
            # the old gradients' memory is free for the new ones (the numpy engine's kernels allocate them):
            # on-device AdamW over 192 MiB of weights, peak RSS 1,038 -> 846 MiB
            # (onnxruntime-training 946)
            dropped = drop_unheld_grads([params[p] for p in self._trainable])
        try:
            results = _checked_run(lambda: plan.run(feeds, wanted, **kw), self._train_inputs, feeds,
                                   "the training model", self._train_shared_dims)
        except BaseException:
            for prm in dropped:  # a failed call leaves zeros where it dropped the stale gradients
                prm.grad = np.zeros_like(prm.data) if prm.data is not None else None
            raise
        kw.clear()  # (the old gradients, which replace_grads must see unshared)
        feeds.clear()  # (it references the gradient buffers, which replace_grads must see unshared)
        self._last_step_plan = plan
        n = len(self._train_outputs)
        replace_grads([params[p] for p in self._trainable], results[n:n + len(self._trainable)])
        for stat, new in zip(self._running_stats, results[n + len(self._trainable):]):
            if not empty_batch:
                np.copyto(params[stat].data, new)  # in place: held .data arrays see the new statistics
        self._accumulate = True
        return _own(_unshared(results[:n], params.values()), user_feeds)

    def _loss_scale_feed(self) -> np.ndarray:
        """The scaler's value on a call that starts an accumulation, else the scale already in use."""
        assert self._loss_scaler is not None
        if not self._accumulate or self._grad_loss_scale is None:
            feed = np.asarray(self._loss_scaler.feed(), np.float32).reshape(1)
            if not (np.isfinite(feed[0]) and feed[0] > 0):
                raise ValueError(f"the loss scale must be a positive finite number, got {feed[0]}")
            self._grad_loss_scale = feed
        return self._grad_loss_scale

    def _grad_loss_scale_for_step(self) -> np.ndarray:
        """The scale of the gradients the optimizer is about to use (the scaler's value before any call)."""
        if self._grad_loss_scale is None:
            assert self._loss_scaler is not None
            return np.asarray(self._loss_scaler.feed(), np.float32).reshape(1)
        return self._grad_loss_scale

    def _eval_step(self, user_inputs: Sequence[Any]) -> list[np.ndarray]:
        if self._eval_plan is None:
            raise RuntimeError("Evaluation session not initialized: this Module was created without an eval "
                               "model (Module(train_model, state, eval_model)); switch back with train()")
        if self._eval_shadowed:
            raise ValueError(self._shadowing("eval"))
        feeds = check_user_inputs(self._eval_inputs, user_inputs, "the eval model")
        user_feeds = dict(feeds)
        feeds.update(self._param_feeds(self._eval_params, "Cannot perform EvalStep with a nominal state."))
        plan = self._eval_plan
        outs = _checked_run(lambda: plan.run(feeds, self._eval_outputs), self._eval_inputs, feeds,
                            "the eval model", self._eval_shared_dims)
        return _own(_unshared(outs, self._state._params.values()), user_feeds)

    def lazy_reset_grad(self) -> None:
        """Make the next training call overwrite the gradients instead of adding to them (§3.3)."""
        with self._state._lock:  # a call running in another thread sets the flag back as it ends: after it
            self._accumulate = False

    # ---------------------------------------------------------------- contiguous parameters
    def _selected(self, trainable_only: bool) -> list[str]:
        return list(self._trainable) if trainable_only else list(self._param_order)

    def _param_shape(self, name: str) -> tuple[int, ...]:
        p = self._state._params[name]
        if p.data is not None:
            return p.data.shape
        spec = next(InputSpec.of(v) for v in self._train_model.graph.input if v.name == name)
        if spec.shape is None or not all(isinstance(d, int) for d in spec.shape):
            raise ValueError(f"parameter {name!r} of the nominal state has no static shape in the training "
                             f"model ({spec.describe_shape()})")
        return tuple(int(d) for d in spec.shape)  # type: ignore[arg-type]

    @raises_as_onnxruntime
    def get_parameters_size(self, trainable_only: bool = True) -> int:
        """Number of parameter elements (trainable ones, or all with ``trainable_only=False``)."""
        return sum(math.prod(self._param_shape(n)) for n in self._selected(bool(trainable_only)))

    def _buffer_dtype(self, names: Sequence[str]) -> np.dtype:
        dtypes = {self._state._params[n].dtype for n in names}
        if len(dtypes) > 1:
            raise TypeError(f"parameters of several dtypes {sorted(map(str, dtypes))} cannot share one "
                            "buffer")
        return dtypes.pop() if dtypes else np.dtype(np.float32)

    @raises_as_onnxruntime
    def get_contiguous_parameters(self, trainable_only: bool = False) -> ContiguousBuffer:
        """A new 1-D array of the parameters, flattened row-major in the training model's input order."""
        names = self._selected(bool(trainable_only))
        with self._state._lock:  # one whole step's parameters, never a step in another thread half done
            feeds = self._param_feeds(names, "Cannot copy parameters from a nominal checkpoint state.")
            out = np.empty(self.get_parameters_size(bool(trainable_only)), self._buffer_dtype(names))
            at = 0
            for n in names:
                a = feeds[n]
                out[at:at + a.size] = a.reshape(-1)
                at += a.size
        return out.view(ContiguousBuffer)

    @raises_as_onnxruntime
    def copy_buffer_to_parameters(self, buffer: Any, trainable_only: bool = True) -> None:
        """Copy a 1-D buffer (as :meth:`get_contiguous_parameters` returns) into the parameters.

        On a nominal state all parameters must be given (``trainable_only=False``); the state becomes
        complete. Takes turns with training steps and optimizer updates in other threads.
        """
        with self._state._lock:
            self._copy_buffer_to_parameters(buffer, bool(trainable_only))

    def _copy_buffer_to_parameters(self, buffer: Any, trainable_only: bool) -> None:
        state = self._state
        nominal = state.is_nominal
        if nominal and trainable_only:
            raise NominalStateError("For nominal checkpoint state, all parameters need to be loaded into the "
                                    "model (trainable_only = false).")
        if isinstance(buffer, np.ndarray):
            arr = buffer.view(np.ndarray)  # a ContiguousBuffer's parameters must become plain arrays
        elif hasattr(buffer, "numpy") and callable(buffer.numpy):
            arr = np.asarray(buffer.numpy())
        elif hasattr(buffer, "_ortvalue"):
            arr = np.asarray(buffer._ortvalue.numpy())
        else:
            raise TypeError(f"buffer must be a numpy array or an OrtValue, got {type(buffer).__name__}")
        names = self._selected(trainable_only)
        dtype = self._buffer_dtype(names)
        if arr.dtype != dtype:
            raise TypeError(f"Parameters buffer type mismatch. Expected: {dtype}, Actual: {arr.dtype}")
        expected = self.get_parameters_size(trainable_only)
        if arr.size != expected:
            raise ValueError(f"Parameters buffer size incorrect. Expected: {expected}, Actual: {arr.size}")
        flat = arr.reshape(-1)
        at = 0
        for n in names:
            shape = self._param_shape(n)
            size = math.prod(shape)
            p = state._params[n]
            if p.data is None:
                p.data = flat[at:at + size].reshape(shape).copy()
            else:
                p.data[...] = flat[at:at + size].reshape(shape)
            at += size
        if nominal:  # the state is complete now: gradient buffers for every Module's trainable parameters
            for p in state._params.values():
                if p.requires_grad and p.grad is None and p.data is not None:
                    p.grad = np.zeros_like(p.data)

    # ---------------------------------------------------------------- export
    @raises_as_onnxruntime
    def export_model_for_inferencing(self, inference_model_uri: str | os.PathLike,
                                     graph_output_names: Sequence[str]) -> None:
        """Write the eval model reduced to ``graph_output_names``, the current parameters as initializers."""
        if self._eval_model is None:
            raise RuntimeError("Eval model was not provided. Cannot export a model for inferencing.")
        if self._state.is_nominal:
            raise NominalStateError(f"Cannot export the model with a nominal state. Please load the model "
                                    f"parameters first. {LOAD_HINT}")
        with self._state._lock:  # the parameters of one whole step
            values = self._param_feeds(self._eval_params, "Cannot export the model with a nominal state.")
            export_for_inference(self._eval_model, values,
                                 inference_model_uri, graph_output_names)

    # ---------------------------------------------------------------- for Optimizer/TrainingSession
    @property
    def state(self) -> CheckpointState:
        return self._state

    @property
    def trainable_parameter_names(self) -> list[str]:
        """Trainable parameters in the training model's input order."""
        return list(self._trainable)

    @property
    def loss_scaler(self) -> LossScaler | None:
        """The loss scaler of a mixed-precision training model (None without loss scaling)."""
        return self._loss_scaler

    @property
    def has_eval_model(self) -> bool:
        return self._eval_model is not None

    def _mode_names(self, training: bool) -> tuple[list[str], list[str]]:
        if training:
            return [s.name for s in self._train_inputs], list(self._train_outputs)
        if self._eval_model is None:
            return [], []
        return [s.name for s in self._eval_inputs], list(self._eval_outputs)


def _checked_run(run: Callable[[], Any], specs: Sequence[InputSpec], feeds: Mapping[str, Any], what: str,
                 shared: list[list[tuple[str, int]]] | None = None) -> Any:
    """``run()``, told apart where inputs sharing a symbolic dimension (a batch of inputs against one of
    labels) were fed different sizes of it: a failed run raises a ValueError naming them, with the engine's
    error as its cause; one that succeeded warns (once per place): either the model reuses a dimension's
    name for another size, or a batch is wrong and the runtime did not notice (onnxruntime's loss kernels
    do not all check). ``shared``: :func:`~onnxtrain.engine.feed_sizes.shared_dim_slots` of ``specs`` (None:
    not known), which tells at once most runs that have nothing to tell apart."""
    try:
        out = run()
    except Exception as e:
        msg = shared_dim_mismatch(specs, feeds, what) if shared is None or shared else None
        if msg is not None:
            raise ValueError(msg) from e
        raise
    msg = None
    if shared is None or shared and not sizes_agree(shared, feeds):
        msg = shared_dim_mismatch(specs, feeds, what)
    if msg is not None:
        warn(f"{msg}: the run went through; if the model's dimension names are right, the inputs do not fit "
             "each other")
    return out
