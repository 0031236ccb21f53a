"""What the legacy sessions that cut a model over MPI ranks share (pipeline stages, split layers).

:class:`CutModelSession` keeps the legacy ``TrainingSession`` surface for a rank that holds a part of the
model: the session options and backend, the model's interface (its inputs, the learning rate, its outputs),
the feed checks, the optimizer attribute checks and the introspection methods. The subclasses
(:mod:`onnxtrain.session_pipeline`, :mod:`onnxtrain.session_horizontal`) build their graphs and run them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff.builder import upgrade_opset
from onnxtrain.capi.feeds import empty_run
from onnxtrain.capi.options import RunOptions
from onnxtrain.engine.kernels.half import is_half
from onnxtrain.errors import InvalidFeed, InvalidFeedType
from onnxtrain.graph_transforms.accumulation import GROUP_OUTPUT
from onnxtrain.graph_transforms.clipping import norm_dtype
from onnxtrain.graph_transforms.flags import FLAG_SHAPE, flag_array
from onnxtrain.graph_transforms.mixed_precision import ALL_FINITE, MixedPrecisionInfo
from onnxtrain.inference import NodeArg, check_feed_shape, node_arg, warn_unread_model_config
from onnxtrain.ir.builder import FLOAT_TYPES, NameGen, loadable_model, value_types
from onnxtrain.ir.graphs import chain_shared_batch_norms, node_reads, path_to, untie_batch_norm_statistics
from onnxtrain.ir.types import value_info_shape, widens_exactly
from onnxtrain.optim.base import WeightSlot
from onnxtrain.parallel import (
    BucketReducer,
    Communicator,
    check_world_options,
    get_communicator,
    launch_hint,
    world,
)
from onnxtrain.parallel.fingerprint import array_digest, canonical, digest
from onnxtrain.parallel.stage_graphs import NORM as GLOBAL_NORM
from onnxtrain.parameters import TrainingParameters
from onnxtrain.session import TrainingSession, serialized
from onnxtrain.session_exchange import ReplicaExchange
from onnxtrain.session_loading import load_with_options
from onnxtrain.training_graph import (
    TRAINING_MODE,
    check_learning_rate_not_loss_scale,
    dropout_mode,
    update_clips,
    warn_idle_max_norm_clip,
)
from onnxtrain.user_warning import warn


class CutModelSession(ReplicaExchange, TrainingSession):
    """A legacy training session whose rank holds a part of the model (see the module docstring)."""

    what = "this parallelism"  # names the mode in errors

    def _training_model(self, path_or_bytes: Any) -> onnx.ModelProto:
        """The model a cut session trains: loaded, at the opset the autodiff needs (a caller's proto copied,
        not edited), each BatchNormalization with running statistics of its own, as the one-process
        session's graphs have them."""
        model = load_with_options(path_or_bytes, self._sess_options)
        warn_unread_model_config(model)
        model = loadable_model(model)
        model = upgrade_opset(model)
        if model is path_or_bytes:
            model, mine = onnx.ModelProto(), model
            model.CopyFrom(mine)
        chain_shared_batch_norms(model, NameGen.for_model(model))
        untie_batch_norm_statistics(model, NameGen.for_model(model))
        return model

    def _setup(self, refused: Mapping[str, Any]) -> None:
        """Check the options ``refused`` (name → default) and those every cut session needs; the defaults
        of what the subclasses build."""
        p = self._params
        if world().size > 1:  # MPI first: a rank raising below then aborts the job instead of leaving the
            get_communicator()  # others waiting for it in MPI_Init
        # (onnxruntime 1.2-1.3's names of a loss scaling the model computes itself: one process only; without
        # mixed precision they do nothing, and _warn_idle_options says so as one process does)
        own_scaling = ({"scaled_loss_output_name": "", "loss_scale_input_name": ""}
                       if p.use_mixed_precision else {})
        bad = [k for k, d in {**refused, **own_scaling}.items() if getattr(p, k) != d]
        if bad:
            raise NotImplementedError(
                f"TrainingParameters option(s) {', '.join(bad)} do not combine with {self.what} yet"
            )
        self._warn_idle_options()
        if p.use_memory_efficient_gradient:
            warn(f"TrainingParameters.use_memory_efficient_gradient has no effect with {self.what} (its "
                 "stages keep LayerNormalization's input)")
        if not p.training_optimizer_name:
            raise ValueError(f"{self.what} needs an optimizer (training_optimizer_name)")
        if not p.loss_output_name:
            raise ValueError(
                "TrainingParameters.loss_output_name is empty: name the loss tensor of the model"
            )
        self._dp = None
        self._zero = None
        self.loss_scale_input_name = None
        self._mp = None
        self._plans: dict[Any, Any] = {}
        self._random_state: dict[Any, dict[Any, Any]] = {}
        self._data = None
        self.data_parallel_size, self.data_parallel_rank = 1, 0
        self._bn_stats: dict[str, str] = {}  # training-mode BatchNormalizations' running statistics → outputs

    def _replicas(self, p: TrainingParameters, parts: int, option: str) -> int:
        """How many data-parallel replicas of ``parts`` ranks the MPI world holds (``data_parallel_size``
        recomputed with a warning when it does not fit, as the legacy session did)."""
        size = world().size
        if size < parts or size % parts:
            raise ValueError(
                f"{option}={parts} needs a multiple of {parts} MPI ranks (times the data-parallel replicas), "
                f"but there are {size}; launch with: {launch_hint(parts)}"
            )
        check_world_options(p, world())
        replicas = size // parts
        if p.data_parallel_size != replicas:
            warn(
                f"data_parallel_size={p.data_parallel_size} times {option}={parts} is not the world size "
                f"{size}: using data_parallel_size={replicas}"
            )
        self.data_parallel_size = replicas
        return replicas

    def _groups(self, comm: Communicator, part: int, replica: int, what: str) -> None:
        """``self._comm``: the ranks of this rank's replica (ordered by ``part``); ``self._data``: the ranks
        holding the same part in every replica (None with one replica)."""
        self.data_parallel_rank = replica
        self._reducer: BucketReducer | None = None
        # the half gradients _take_means left as float32 sums (name → type) and their count of terms
        self._wide_sums: tuple[dict[str, np.dtype], int] = ({}, 1)
        many = self.data_parallel_size > 1
        self._comm = comm.split(replica, part, f"forming the {what}") if many else comm
        self._data = comm.split(part, replica, "forming the data-parallel groups") if many else None

    def _replicas_average(self, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``grads`` averaged over the data-parallel replicas (each holds the same part of the model). Half
        gradients that :meth:`_take_means` left as float32 sums are scaled after the sum over the replicas by
        1/(count·replicas) and cast once, as one process's accumulation buffer is."""
        half, count = self._wide_sums
        self._wide_sums = ({}, 1)
        if self._data is None or not grads:
            return grads
        if self._reducer is None:
            self._reducer = BucketReducer(
                self._data, [g.shape for g in grads.values()],
                [half.get(k, g.dtype) for k, g in grads.items()],
            )
        d = self.data_parallel_size
        return dict(zip(grads, self._reducer.reduce(list(grads.values()), 1.0 / d, 1.0 / (count * d))))

    def _interface(self, model: onnx.ModelProto, gradients: Sequence[str] = ()) -> None:
        """The whole model's inputs (and the learning rate) and outputs, as one process's session has;
        ``gradients``: the trained weights whose gradients are outputs too (``<w>_grad``, and under mixed
        precision ``<half twin>_grad``)."""
        p, g = self._params, model.graph
        inits = {t.name: t for t in g.initializer}
        self._model = model
        self._dropout_default = dropout_mode(model)  # a run feeding no training_mode: the model's own mode
        self._user_inputs = [v.name for v in g.input if v.name not in inits]
        self._inputs = [node_arg(v) for v in g.input if v.name not in inits]
        self._inputs.append(NodeArg(p.lr_params_feed_name, "tensor(float)", [1]))
        self._overridable = []
        self._outputs = [node_arg(o) for o in g.output]
        # a loss the model does not list as an output is fetched by name only, as in one process's session
        # (TrainingSession._build: onnxruntime-training 1.16.3 keeps it out of get_outputs() and run(None))
        self._unlisted_outputs = {p.loss_output_name} - {o.name for o in g.output}
        if p.enable_grad_norm_clip or self._mp is not None:  # as one process's (loss-scaled under mixed
            # precision): the norm of the whole model's gradients, computed by the update runs
            self._outputs.append(NodeArg(GLOBAL_NORM, "tensor(float)", []))
        if self._mp is not None:
            self._outputs.append(NodeArg(ALL_FINITE, "tensor(bool)", FLAG_SHAPE))
        self._grad_outputs = {f"{w}_grad" for w in gradients}  # computed by the run's backward
        self._grad_sources: dict[str, str] = {}  # each gradient output → the one it is read from
        for w in gradients:
            t = inits[w]
            self._outputs.append(node_arg(helper.make_tensor_value_info(f"{w}_grad", t.data_type, t.dims)))
            self._grad_sources[f"{w}_grad"] = f"{w}_grad"
            twin = self._twin_of(w)
            if twin is not None:  # a half twin's: its master's, cast
                half = helper.make_tensor_value_info(f"{twin}_grad", self._mp.dtype, t.dims)
                self._outputs.append(node_arg(half))
                self._grad_sources[f"{twin}_grad"] = f"{w}_grad"
        self._output_names = [o.name for o in self._outputs]
        self._dtypes = {
            v.name: helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)
            for v in g.input
            if v.name not in inits and v.type.HasField("tensor_type")
        }
        # the whole batch's declared shapes, checked as one process's session checks them: on every rank,
        # whichever of its inputs its part reads
        self._input_shapes = {v.name: shape for v in g.input
                              if v.name not in inits and (shape := value_info_shape(v.type)) is not None}

    def _forward_for(self, key: Any, plan: Any, model: onnx.ModelProto, feeds: Mapping[str, Any]) -> Any:
        """``plan``, the forward ``model`` of this rank's part, or when the run leaves out model inputs that
        it reads (a forward-only run without the labels), a plan of ``model`` without the outputs that read
        them (cached under ``key`` and the inputs left out)."""
        user = set(self._user_inputs)
        missing = frozenset(n for n in plan.all_input_names if n in user and n not in feeds)
        if not missing:
            return plan
        cache = self.__dict__.setdefault("_partial_plans", {})
        if (key, missing) not in cache:
            cache[key, missing] = self._new_plan(forward_without(model, missing), None, keep_binding=False)
        return cache[key, missing]

    def _plan_feeds(self, plan: Any, sources: Sequence[Mapping[str, Any]], training: bool) -> dict[str, Any]:
        """The inputs of ``plan``: each from the first of ``sources`` that has it, else this rank's state,
        else the Dropout switch ``training``."""
        out: dict[str, Any] = {}
        for n in plan.all_input_names:
            source = next((src for src in sources if n in src), None)
            if source is not None:
                out[n] = source[n]
            elif n in self._store:
                out[n] = self._store[n]
            elif n == TRAINING_MODE:
                out[n] = np.asarray(training)
        return out

    # ---- running -------------------------------------------------------------------------
    @serialized
    def _run(
        self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], ro: RunOptions
    ) -> list[np.ndarray]:
        """Forward, backward and update (or a micro-step's forward and backward, or with
        ``only_execute_path_to_fetches`` a forward pass); a collective: every rank calls it with the same
        feeds (a replica's ranks, with data parallelism)."""
        names = self._output_list(output_names)
        # as the single-process session: a run updates unless it asks for the forward's outputs alone or is
        # a micro-step; ``training_mode`` (run options, or fed) switches Dropout
        micro = self._is_micro_step(names, ro)
        # gradients fetched on the fetches' path alone: forward and backward, nothing added up or updated
        sources = self._grad_sources
        inspect = ro.only_execute_path_to_fetches and not micro and any(n in sources for n in names)
        forward_only = ro.only_execute_path_to_fetches and not micro and not inspect
        # a forward-only run needs only the inputs its fetches and the tensors passed between ranks read
        feeds = self._checked(input_feed, self._inputs_read(names) if forward_only else None)
        self._check_loss_scale(feeds)
        dropout = bool(np.asarray(feeds.pop(TRAINING_MODE, ro.training_mode and self._dropout_default)))
        if forward_only:
            values = self._forward_only(feeds, dropout)
        else:
            lr = self._params.lr_params_feed_name
            if not micro and not inspect and lr not in feeds:
                raise ValueError(f"missing input {lr!r} (the learning rate)")
            values = self._train_step(feeds, dropout, update=not (micro or inspect), accumulate=not inspect)
        got = self._gathered(values, [*names, *(sources[n] for n in names if n in sources)])
        for out, src in sources.items():  # a half twin's gradient: its master's whole one, cast
            if out != src and out in names and src in got:
                got[out] = got[src].astype(helper.tensor_dtype_to_np_dtype(self._mp.dtype))
        if GROUP_OUTPUT in names:
            got[GROUP_OUTPUT] = flag_array(True)  # its value means nothing: it marks a micro-step
        missing = [n for n in names if n not in got]
        if missing:
            raise ValueError(f"output(s) {missing} are not computed on this run (a forward or a micro-step)")
        return [got[n] for n in names]

    def _twin_of(self, weight: str) -> str | None:
        """The half twin of a trained weight of the whole model, under mixed precision."""
        return self._mp.twins.get(weight) if self._mp is not None else None

    def _forward_only(self, feeds: dict[str, np.ndarray], dropout: bool) -> dict[str, np.ndarray]:
        """The model's forward alone on this rank's part: the values the run may return."""
        raise NotImplementedError

    def _train_step(
        self, feeds: dict[str, np.ndarray], dropout: bool, update: bool, accumulate: bool = True
    ) -> dict[str, np.ndarray]:
        """Forward and backward on this rank's part, its gradients added up (unless not ``accumulate``),
        then (``update``) the optimizer: the values the run may return (with the run's own gradients, the
        means over its micro-batches, when they are outputs)."""
        raise NotImplementedError

    def _gathered(self, values: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        """The run's outputs from this rank's ``values`` (every rank holds them all unless overridden)."""
        return values

    # ---- gradient accumulation over runs ------------------------------------------------------------
    def _setup_accumulation(self) -> None:
        """With ``gradient_accumulation_steps`` > 1, the group output a legacy caller fetches to mark a
        micro-step; and the sums of the micro-steps' gradients (none yet)."""
        if self._params.gradient_accumulation_steps > 1:
            self._outputs.append(NodeArg(GROUP_OUTPUT, "tensor(bool)", FLAG_SHAPE))
            self._output_names.append(GROUP_OUTPUT)
        self._summed = GradientSums()
        self._micro_step = 0

    def _is_micro_step(self, names: Sequence[str], ro: RunOptions) -> bool:
        """Whether a training run only adds its gradients (no update): counted by the session
        (``gradient_accumulation_mode = "auto"``), or marked by the caller fetching the group output with
        ``only_execute_path_to_fetches`` ("legacy"), as one process's session decides."""
        p = self._params
        steps = p.gradient_accumulation_steps
        if steps == 1:
            return False
        if p.gradient_accumulation_mode == "auto":
            return not ro.only_execute_path_to_fetches and self._micro_step + 1 < steps
        return bool(ro.only_execute_path_to_fetches) and GROUP_OUTPUT in names

    def _add_gradient(self, name: str, g: np.ndarray) -> None:
        """Add ``g`` to the running sum of ``name``'s gradient, in the order one process's buffer adds."""
        self._summed.add(name, g)

    def _take_means(self, count: int) -> dict[str, np.ndarray]:
        """The means of the accumulation that ends, over the ``count`` gradients its sums hold; the next one
        starts from nothing."""
        sums, self._summed, self._micro_step = self._summed, GradientSums(), 0
        if self._data is not None and self._mode != "adasum":  # averaged over the replicas next: the half
            self._wide_sums = (sums.half_types(), count)  # gradients stay float32 sums until then
            return sums.means(count, wide=True)
        return sums.means(count)

    def _run_update(self, plan: Any, outputs: Mapping[str, str], given: Mapping[str, Any]) -> None:
        """Run an update graph on this rank's state and ``given`` (gradients, learning rate, norm); the new
        state (``outputs``: state name → output) replaces the old, written into it where the plan can."""
        feeds = {n: self._store[n] if n in self._store else given[n] for n in plan.all_input_names}
        items = list(outputs.items())
        out = plan.run(feeds, [o for _, o in items], donate=[s for s, _ in items if s in feeds])
        for (state, _), v in zip(items, out):
            self._store[state] = v

    def _inputs_read(self, names: Sequence[str]) -> list[str]:
        """The model's inputs that the outputs ``names`` and the tensors the ranks pass on (``_part.sends``)
        read, in the model's order: the same on every rank, which all run the forward."""
        reads, key = self.__dict__.setdefault("_reads", {}), tuple(names)
        if key not in reads:
            _, read = path_to(self._model.graph.node, [*names, *(t for ts in self._part.sends for t in ts)])
            reads[key] = [n for n in self._user_inputs if n in read or n in names]
        return reads[key]

    def _checked(self, input_feed: Mapping[str, Any], required: Sequence[str] | None = None
                 ) -> dict[str, np.ndarray]:
        """The feeds as arrays, checked by name, dtype, rank and fixed dimensions as one process's session
        checks them (``required``: the inputs that must be given; default all the model's)."""
        allowed = set(self._user_inputs) | {self._params.lr_params_feed_name, TRAINING_MODE}
        shapes = getattr(self, "_input_shapes", {})
        out: dict[str, np.ndarray] = {}
        for name, v in input_feed.items():
            if name not in allowed:
                raise InvalidFeed(f"unknown input {name!r}; the model's inputs are {self._user_inputs}")
            a = np.asarray(v.numpy() if hasattr(v, "numpy") and not isinstance(v, np.ndarray) else v)
            want = np.dtype(bool) if name == TRAINING_MODE else self._dtypes.get(name)
            if want is not None and a.dtype != want:
                raise InvalidFeedType(f"input {name!r}: expected dtype {want}, got {a.dtype}")
            if name in shapes:
                check_feed_shape(name, a, shapes[name])
            out[name] = a
        missing = [n for n in (self._user_inputs if required is None else required) if n not in out]
        if missing:
            raise InvalidFeed(f"missing input(s) {missing}; the model's inputs are {self._user_inputs}")
        return out

    def _original(self, name: str) -> str:
        """The model's name of a weight this rank holds under another (a split weight's share)."""
        return name

    def _check_attribute_maps(self) -> None:
        """Refuse optimizer maps at fault for any weight the model trains, on every rank (as one process
        refuses the whole model: a rank that took the maps would go on to run alone), before anything is
        built or written (the stage dumps)."""
        p, opt = self._params, self._opt
        originals = list(self._model_trained)
        for w in originals:
            for label, m in (
                ("optimizer_attributes_map", p.optimizer_attributes_map),
                ("optimizer_int_attributes_map", p.optimizer_int_attributes_map),
            ):
                if m and w not in m:
                    raise ValueError(
                        f"{label} has no entry for trained weight {w!r} (give every trained weight an entry, "
                        "possibly {})"
                    )
        opt.check_attrs(originals, p.optimizer_attributes_map, p.optimizer_int_attributes_map)
        # a bound nothing clips by is named, as one process's session names it
        warn_idle_max_norm_clip(p, opt, originals, update_clips(p, self._mode == "adasum"))

    def _check_learning_rate(self, model: onnx.ModelProto, trainable: list[str],
                             passed: Sequence[str] = ()) -> None:
        """Refuse, on every rank and before anything is built, a learning-rate feed name that one process's
        session refuses: a value of the model, or one its graphs define otherwise (the global gradient norm
        the update graphs read, a trained weight's gradient, the loss's seed gradient, optimizer state;
        training_graph._check_learning_rate_clash). A stage's graphs hold its own weights' names only, so
        the stage holding the weight alone refused it, and the other ranks waited for it. ``passed``: the
        tensors a pipeline's stages pass on, whose gradients (of the float ones) its stage graphs take and
        return as ``<t>_grad`` (the stage that sent ``t`` took the learning-rate feed as t's gradient)."""
        from onnxtrain.training_graph import _check_learning_rate_name

        p = self._params
        name = p.lr_params_feed_name
        _check_learning_rate_name(model.graph, name)
        if self._mp is not None:  # (a horizontal split checks it once its rank's model has the input)
            check_learning_rate_not_loss_scale(name, self._mp.loss_scale)
        defined = {GLOBAL_NORM, f"{p.loss_output_name}_grad", *(f"{w}_grad" for w in trainable),
                   *(sp.name for sp in self._whole_state_specs(model, trainable))}
        if p.use_mixed_precision:
            defined.add(ALL_FINITE)
        if p.gradient_accumulation_steps > 1:
            defined.add(GROUP_OUTPUT)
        if name in defined:
            raise ValueError(f"lr_params_feed_name {name!r} names a value of the training graph the session "
                             "builds (a gradient, the global gradient norm or optimizer state); name the "
                             "learning-rate feed otherwise (TrainingParameters.lr_params_feed_name)")
        sent = next((t for t in passed if f"{t}_grad" == name), None)
        if sent is not None and (
                value_types(model).get(sent, onnx.TypeProto()).tensor_type.elem_type in FLOAT_TYPES):
            raise ValueError(f"lr_params_feed_name {name!r} names the gradient of {sent!r}, which the "
                             "pipeline's stages pass on (their graphs exchange its gradient under that "
                             "name); name the learning-rate feed otherwise (TrainingParameters."
                             "lr_params_feed_name)")

    def _check_initial_state(self, model: onnx.ModelProto, trainable: list[str], shapes: bool = True) -> None:
        """Refuse, on every rank and before anything is built, an initial optimizer state that one process's
        session refuses for any weight the model trains: a key the optimizer keeps nothing under and, with
        ``shapes`` (a session holding whole weights, whose state is given whole), a value of another shape,
        or of a type that does not cast to the state's without loss. A rank applies the state of the weights
        it holds only, so another rank would go on alone (a horizontally split session's load_state also
        skips names it does not hold)."""
        initial = self._params.optimizer_initial_state()
        if not initial:
            return
        specs = {(sp.weight or "shared_optimizer_state", sp.key): sp
                 for sp in self._whole_state_specs(model, trainable)}
        for w, d in initial.items():
            if w != "shared_optimizer_state" and w not in trainable:
                continue  # (one process warns about it and goes on)
            for key, v in d.items():
                sp = specs.get((w, key))
                if sp is None:
                    raise ValueError(f"set_optimizer_initial_state: no optimizer state {key!r} for {w!r}")
                if not shapes:
                    continue
                arr, kept = np.asarray(v), sp.initial
                if arr.shape != kept.shape:
                    raise ValueError(
                        f"state {sp.name!r}: expected shape {list(kept.shape)}, got {list(arr.shape)}")
                if arr.dtype != kept.dtype and not widens_exactly(arr.dtype, kept.dtype):
                    raise TypeError(f"state {sp.name!r}: expected dtype {kept.dtype}, got {arr.dtype}")

    def _whole_state_specs(self, model: onnx.ModelProto, trainable: list[str]) -> list:
        """The optimizer state one process's session keeps for ``trainable`` (the model's whole weights)."""
        inits = {t.name: t for t in model.graph.initializer}
        slots = [WeightSlot(w, "", tuple(inits[w].dims), inits[w].data_type) for w in trainable]
        return self._opt.state(slots)

    def _trained(self) -> list[str]:
        """The trained weights this rank holds (by the names it holds them under)."""
        raise NotImplementedError

    def _rank_norm_dtype(self) -> np.dtype:
        """The dtype this rank's update graph takes the global norm in: float64 when a weight it trains is
        float64, as its graph declares the norm input (``clipping.norm_type``)."""
        return norm_dtype(self._store[w] for w in self._trained() if w in self._store)

    def _state_names(self) -> list[str]:
        return sorted([*self._trained(), *(sp.name for sp in self._specs), *self._bn_stats])

    def _keep_running_stats(self, values: Mapping[str, np.ndarray], stats: Mapping[str, str],
                            fed: Mapping[str, Any]) -> None:
        """Write the new running statistics ``stats`` (state name → output) a training run returned in
        ``values`` into the state, as one process's session does after each of its micro-steps; a run
        ``fed`` an empty tensor (an empty micro-batch) leaves them as they were, as torch does."""
        if empty_run(fed):
            return
        for stat, out in stats.items():
            self._store[stat] = values[out]

    def _mixed_precision(self) -> MixedPrecisionInfo | None:
        return self._mp

    def _all_optimizer_state_names(self) -> set[str]:
        return {sp.name for sp in self._specs}

    @serialized
    def get_model_state(
        self, include_mixed_precision_weights: bool = False
    ) -> dict[str, dict[str, np.ndarray]]:
        from onnxtrain.graph_transforms.mixed_precision import half_copies

        out = {"full_precision": {w: self._store[w].copy() for w in self._trained()}}
        if include_mixed_precision_weights:
            mp = self._mp
            out["mixed_precision"] = {} if mp is None else half_copies(out["full_precision"], mp.dtype)
        return out

    def is_output_fp32_node(self, output_name: str) -> bool:
        if output_name not in {o for n in self._model.graph.node for o in n.output}:
            raise ValueError(f"{output_name!r} is not produced by any node of the training graph")
        t = value_types(self._model).get(output_name)
        return t is not None and t.HasField("tensor_type") and t.tensor_type.elem_type == TensorProto.FLOAT

    @property
    def peak_bytes(self) -> int:
        return max((getattr(pl, "peak_bytes", 0) for pl in self._plans.values()), default=0)


class GradientSums:
    """Running sums of gradients by name, as one process's accumulation buffers keep them: float16 and
    bfloat16 gradients are summed in float32 (spec §8.3) and their means cast back to the gradient's type."""

    __slots__ = ("_sums", "_types")

    def __init__(self) -> None:
        self._sums: dict[str, np.ndarray] = {}
        self._types: dict[str, np.dtype] = {}  # the gradient's own type, where the sum is wider

    def __bool__(self) -> bool:
        return bool(self._sums)

    def add(self, name: str, g: np.ndarray) -> None:
        """Add ``g`` to the sum of ``name`` in place (the first: a copy of ``g``, widened if half)."""
        total = self._sums.get(name)
        if total is not None:
            np.add(total, g, out=total)
        elif is_half(g.dtype):
            self._types[name] = g.dtype
            self._sums[name] = g.astype(np.float32)
        else:
            self._sums[name] = np.array(g, copy=True)

    def means(self, count: int, wide: bool = False) -> dict[str, np.ndarray]:
        """The sums over ``count`` terms as means, times 1/count as one process's graph scales its buffers, in
        each gradient's own type. ``wide``: the half gradients' float32 sums as they are (the caller scales
        and casts them, after summing them over replicas)."""
        out = {}
        for name, total in self._sums.items():
            half = self._types.get(name)
            if half is not None and wide:
                out[name] = total
                continue
            mean = total * total.dtype.type(1.0 / count) if count > 1 else total
            out[name] = mean if half is None else mean.astype(half)
        return out

    def half_types(self) -> dict[str, np.dtype]:
        """The half-precision gradients' own types, by name (their sums are float32)."""
        return dict(self._types)


def squared_sum(arrays: Iterable[np.ndarray]) -> float:
    """Σ x² over every value of ``arrays``, in float64 (a share of a global gradient norm)."""
    total = 0.0
    for a in arrays:
        v = a.reshape(-1).astype(np.float64)
        total += float(np.dot(v, v))
    return total


# options every rank of a cut (pipeline or horizontal) session must set alike, besides each mode's own
SHARED_OPTIONS = (
    "gradient_accumulation_steps",
    "loss_output_name",
    "training_optimizer_name",
    "enable_grad_norm_clip",
    "deepspeed_zero_stage",
    "enable_adasum",
    "use_mixed_precision",
    "set_gradients_as_graph_outputs",  # its outputs are gathered over the ranks
    "lr_params_feed_name",
    "optimizer_attributes_map",
    "optimizer_int_attributes_map",
    "use_fp16_moments",
    "mixed_precision_dtype",
    "gradient_accumulation_mode",
    "weights_to_train",  # which weights train decides what a horizontal split cuts and a stage updates
    "weights_not_to_train",
    "immutable_weights",
)


def model_fingerprint(
    model: onnx.ModelProto, p: TrainingParameters, options: Sequence[str]
) -> dict[str, Any]:
    """What every rank must hold identically: the graph, the initializers and ``options`` (digests)."""
    graph = onnx.GraphProto()
    graph.CopyFrom(model.graph)
    del graph.initializer[:]
    return {
        "graph (nodes, inputs, outputs)": digest(graph.SerializeToString(deterministic=True)),
        "initializers": {t.name: array_digest(numpy_helper.to_array(t)) for t in model.graph.initializer},
        # a difference names the option; dicts and sets compare whatever their order
        "training parameters": {k: canonical(getattr(p, k)) for k in options},
    }


def forward_without(model: onnx.ModelProto, missing: Iterable[str]) -> onnx.ModelProto:
    """A forward ``model`` (a stage's or a piece's) cut down to the outputs that do not read the inputs
    ``missing``, with only the nodes, inputs and initializers those outputs need."""
    g = model.graph
    tainted = set(missing)
    for n in g.node:
        if any(i in tainted for i in node_reads(n)):
            tainted.update(o for o in n.output if o)
    outputs = [o for o in g.output if o.name not in tainted]
    nodes, read = path_to(g.node, [o.name for o in outputs])
    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept = out.graph
    del kept.node[:]
    kept.node.extend(nodes)
    inputs = [i for i in g.input if i.name in read]
    del kept.input[:]
    kept.input.extend(inputs)
    del kept.output[:]
    kept.output.extend(outputs)
    initializers = [t for t in g.initializer if t.name in read]
    del kept.initializer[:]
    kept.initializer.extend(initializers)
    return out
