"""The legacy ``TrainingSession`` with ``pipeline_parallel_size > 1``: one stage of the model per MPI rank.

``TrainingSession(model, params)`` returns a :class:`PipelineTrainingSession` when the parameters ask for
stages; launch the script with ``mpiexec -n <stages × replicas>``. The rank ``stage · D + replica`` keeps
the nodes of its stage (:mod:`onnxtrain.parallel.pipeline`), their trained weights and their optimizer
state, and runs three plain ONNX graphs of its own:

* ``forward``: the stage's inputs → the tensors the next stage reads (and the stage's user outputs);
  ``forward_train`` returns the activations its backward reads as well;
* ``backward``: seeded by the gradients of the tensors the stage sent, it reads those activations
  (:mod:`onnxtrain.autodiff.split`) → its weights' gradients and those of the tensors it received; the last
  stage's backward runs its forward too, from the loss;
* ``update``: the optimizer over its weights, with the gradient norm of the whole model as an input.

A ``run()`` cuts the batch into ``num_pipeline_micro_batches`` micro-batches (along ``sliced_axes``, default
axis 0, for the inputs in ``sliced_tensor_names``, default all), runs every micro-batch forward through the
stages, then backward in the same order (GPipe's schedule; each stage keeps a micro-batch's activations
until its backward), averages the gradients over the micro-batches and the data-parallel replicas, sums
those of weights several stages read, sums the squared gradient norms over the stages and updates. The
weights move as one process's do with ``gradient_accumulation_steps = micro-batches × replicas`` on the
same micro-batches. Every rank returns the outputs of its pipeline's last micro-batch.
With replicas, ``deepspeed_zero_stage=1`` shards each stage's optimizer state over the stage's replicas
(each updates its ZeRO pieces, :mod:`onnxtrain.parallel.zero`, then the group all-gathers the weights), and
``enable_adasum`` makes each replica update with its own gradients (its pipeline's norm) and the stage's
replicas combine the weight deltas by Adasum (:mod:`onnxtrain.parallel.adasum`), as the data-parallel
session does.
With ``gradient_accumulation_steps = N`` the gradients add up over N runs as well, and the N-th run updates
with the mean over all N × micro-batches (micro-steps counted by the session, or marked by the caller as in
one process's session).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from onnxtrain.errors import raises_as_onnxruntime
from onnxtrain.graph_transforms.flags import flag_array
from onnxtrain.graph_transforms.mixed_precision import (
    ALL_FINITE,
    mixed_precision,
    mixed_precision_info,
)
from onnxtrain.ir.io import save_dump
from onnxtrain.optim import get_optimizer
from onnxtrain.parallel import exchange_mode, get_communicator
from onnxtrain.parallel.fingerprint import check_same_on_all_ranks
from onnxtrain.parallel.pipeline import parse_cut_info, partition
from onnxtrain.parallel.stage_graphs import NORM, build_stage_graphs
from onnxtrain.parallel.zero import gather_zero_state
from onnxtrain.session import all_or_nothing, described_as, dumped_graph, requested_dumps, serialized
from onnxtrain.session_cut import (
    SHARED_OPTIONS,
    CutModelSession,
    GradientSums,
    model_fingerprint,
    squared_sum,
)
from onnxtrain.session_stages import (
    MicroBatching,
    counts_in_norm,
    gather_stage_outputs,
    sum_tied_gradients,
    tied_weights,
)
from onnxtrain.training_graph import dropout_mode, select_trainable

# options a pipelined session cannot honour yet: name → its default
_REFUSED = {"horizontal_parallel_size": 1}
_OPTIONS = (
    "pipeline_parallel_size",
    "pipeline_cut_info_string",
    "num_pipeline_micro_batches",
    "sliced_tensor_names",  # how each rank cuts its feeds into micro-batches
    "sliced_axes",
    "sliced_schema",
    *SHARED_OPTIONS,
)


class PipelineTrainingSession(MicroBatching, CutModelSession):
    """One pipeline stage of a legacy training session (see the module docstring)."""

    what = "pipeline_parallel_size > 1"

    def _build(self, path_or_bytes: str | bytes | os.PathLike | onnx.ModelProto) -> None:
        self._setup(_REFUSED)
        p = self._params
        model = self._training_model(path_or_bytes)
        if p.use_mixed_precision:  # the whole model first: its casts of the weights run where they are read
            model = mixed_precision(model, p.loss_output_name, p.mixed_precision_dtype)
            self._mp = mixed_precision_info(model)
            outputs = [o for o in model.graph.output if o.name != self._mp.scaled_loss]  # not a user output
            del model.graph.output[:]
            model.graph.output.extend(outputs)
        self._part = partition(
            model, parse_cut_info(p.pipeline_cut_info_string, p.pipeline_parallel_size), p.loss_output_name
        )
        replicas = self._replicas(p, p.pipeline_parallel_size, "pipeline_parallel_size")
        self._mode = _exchange_mode(p, replicas)
        self.loss_scale_input_name = self._mp.loss_scale if self._mp is not None else None
        world_comm = get_communicator()
        check_same_on_all_ranks(world_comm, model_fingerprint(model, p, _OPTIONS), "model and pipeline setup")
        # rank = stage · D + replica, as the legacy layout (data-parallel index fastest)
        replica, stage = world_comm.rank % replicas, world_comm.rank // replicas
        self._groups(world_comm, stage, replica, "pipelines")
        self._stage = stage
        self._opt = get_optimizer(p.training_optimizer_name, p.use_fp16_moments)
        trainable = select_trainable(model, p)
        self._model_trained = list(trainable)
        self._check_attribute_maps()  # (before the stage is built and its dumps written)
        self._check_initial_state(model, trainable)
        self._check_learning_rate(model, trainable, [t for sends in self._part.sends for t in sends])
        self._shared = tied_weights(model, self._part.runs, trainable)
        self._shapes = {t.name: tuple(t.dims) for t in model.graph.initializer if t.name in self._shared}
        self._build_stage(model, trainable)
        zero_graph = self._setup_zero(self._sg.graphs["backward"])
        if zero_graph is not None:
            self._sg.graphs["zero_update"] = zero_graph
        self._interface(model, trainable if p.set_gradients_as_graph_outputs else ())
        self._setup_accumulation()

    # ---- construction ------------------------------------------------------------------
    def _build_stage(self, model: onnx.ModelProto, trainable: list[str]) -> None:
        p = self._params
        self._setup_micro_batches(model, self.loss_scale_input_name)
        sg = self._sg = build_stage_graphs(
            model, self._part, self._stage, trainable, p, self._opt, self._mp, self._micro_input,
            adasum=self._mode == "adasum",
        )
        self._store: dict[str, np.ndarray] = dict(sg.initial)
        self._bn_stats = sg.bn_stats
        self._specs = sg.specs
        self._apply_initial_optimizer_state(p.optimizer_initial_state())
        stage_graph = {"transformed": "stage", "gradient": "backward", "training": "backward"}
        for where, path, kind, missing_folder in requested_dumps(p, self._sess_options):
            root, ext = os.path.splitext(path)
            # the stage's state, its Dropouts' shared training_mode and half scatters as the session's dumps
            dump = dumped_graph(sg.graphs[stage_graph[kind]], self._store, dropout_mode(model))
            with described_as(dump, model):  # (the user's model's producer and description, as 1.16.3's)
                save_dump(dump, f"{root}.stage{self._stage}{ext or '.onnx'}", where,
                          missing_folder=missing_folder)
        self._plans: dict[str, Any] = {}
        self._random_state: dict[Any, dict[Any, Any]] = {}

    def _get_plan(self, kind: str) -> Any:
        if kind not in self._plans:
            outputs = self._update_outputs_of(kind)
            upd = outputs is not None
            updates = {o: s for s, o in outputs.items()} if upd else None
            self._plans[kind] = self._new_plan(self._sg.graphs[kind], updates, keep_binding=upd)
        return self._plans[kind]

    def _update_outputs_of(self, kind: str) -> dict[str, str] | None:
        """An update graph's outputs (state name → output); None for the other graphs."""
        return {"update": self._sg.update_outputs, "zero_update": self._zero_updates}.get(kind)

    def _update_plan(self, kind: str) -> tuple[Any, dict[str, str]]:
        return self._get_plan(kind), self._update_outputs_of(kind)

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (0 = the first)."""
        return self._stage

    def model_trained_weights(self) -> list[str]:
        """The trained weights of the whole model, every stage's (``get_model_state()`` holds this stage's):
        the names a checkpoint of ``gather_state()`` trains (``onnxtrain.train.state``)."""
        return list(self._model_trained)

    # ---- running ------------------------------------------------------------------------
    def _forward_only(self, feeds: dict[str, np.ndarray], dropout: bool) -> dict[str, np.ndarray]:
        return self._forward(feeds, dropout)

    def _gathered(self, mine: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        """The outputs ``names`` of the whole pipeline: each stage gives those it computed."""
        return gather_stage_outputs(self._comm, mine, names, self._grad_outputs)

    def _stage_feeds(
        self,
        kind: str,
        feeds: dict[str, np.ndarray],
        received: dict[str, np.ndarray],
        training: bool,
        extra: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, Any]:
        return self._plan_feeds(self._get_plan(kind), (feeds, received, extra or {}), training)

    def _forward(
        self,
        feeds: dict[str, np.ndarray],
        training: bool,
        tag: int = 0,
        pending: list | None = None,
        kind: str = "forward",
    ) -> dict[str, Any]:
        """This stage's forward on one (micro-)batch: receive from the stage before, run, send to the stage
        after. Returns the tensors received (under ``"received"``), the activations the backward graph reads
        (``"saved"``, with ``kind="forward_train"``) and this stage's user outputs."""
        s = self._stage
        received = self._comm.recv_object(s - 1, tag, f"stage {s} receiving its inputs") if s > 0 else {}
        plan = self._get_plan(kind)
        if kind == "forward":  # a forward-only run may leave out inputs its fetches do not read
            plan = self._forward_for(kind, plan, self._sg.graphs[kind], feeds)
        names = list(plan.output_names)
        fed = self._plan_feeds(plan, (feeds, received), training)
        out = dict(zip(names, plan.run(fed, names)))
        if s < self._part.stages - 1:
            send = {t: out[t] if t in out else received[t] for t in self._sg.sends}
            req = self._comm.isend_object(send, s + 1, tag, f"stage {s} sending its outputs")
            if pending is None:
                req.wait()
            else:
                pending.append(req)
        saved = {n: out[n] for n in self._sg.saved} if kind == "forward_train" else {}
        if kind == "forward_train":
            self._keep_running_stats(out, self._sg.bn_stats, fed)
        return {"received": received, "saved": saved, **{n: out[n] for n in self._sg.outputs if n in out}}

    def _train_step(
        self, feeds: dict[str, np.ndarray], dropout: bool, update: bool, accumulate: bool = True
    ) -> dict[str, np.ndarray]:
        s, last, m = self._stage, self._stage == self._part.stages - 1, self._micro
        micro = self._micro_feeds(feeds, m)
        pending: list = []
        kept: list[dict[str, np.ndarray]] = []  # per micro-batch: the tensors received, and outputs
        outputs: dict[str, np.ndarray] = {}
        mine = GradientSums()  # the run's own gradients, when they are outputs
        grads = [f"{w}_grad" for w in self._sg.trainable]
        rgrads = [f"{r}_grad" for r in self._sg.diff_received]
        if not last:
            for k in range(m):
                kept.append(self._forward(micro[k], dropout, 2 * k, pending, "forward_train"))
        for k in range(m):
            if last:
                received = (
                    self._comm.recv_object(s - 1, 2 * k, f"stage {s} receiving its inputs") if s > 0 else {}
                )
                seeds: dict[str, np.ndarray] = {}
                wanted = [*self._sg.outputs, *grads, *rgrads, *self._sg.bn_stats.values()]
            else:
                received = kept[k]["received"]
                seeds = self._comm.recv_object(s + 1, 2 * k + 1, f"stage {s} receiving its output gradients")
                wanted = [*grads, *rgrads]
            extra = {f"{t}_grad": seeds[t] for t in self._sg.seeded}
            if not last:
                extra.update(kept[k].pop("saved"))  # freed once this micro-batch's backward has run
            fed = self._stage_feeds("backward", micro[k], received, dropout, extra) if wanted else {}
            # a first stage without weights has nothing to compute or pass back
            res = dict(zip(wanted, self._get_plan("backward").run(fed, wanted))) if wanted else {}
            if last:
                self._keep_running_stats(res, self._sg.bn_stats, fed)
            for gname in grads:  # summed over the micro-batches, and over the runs of an accumulation
                if accumulate:
                    self._add_gradient(gname, res[gname])
                if gname in self._grad_outputs:  # and over this run's micro-batches alone, to return
                    mine.add(gname, res[gname])
            if s > 0:
                back = {r: res[f"{r}_grad"] for r in self._sg.diff_received}
                for t in self._sg.sends:  # passed through this stage: its gradient goes on back
                    if t in seeds and t in self._part.received(s):
                        back[t] = back[t] + seeds[t] if t in back else seeds[t]
                pending.append(
                    self._comm.isend_object(back, s - 1, 2 * k + 1, f"stage {s} sending its input gradients")
                )
            outputs = (
                {n: res[n] for n in self._sg.outputs} if last else {n: kept[k][n] for n in self._sg.outputs}
            )
        for r in pending:
            r.wait()
        outputs.update(mine.means(m))
        if not accumulate:
            return outputs
        self._micro_step += 1
        if update:  # the means over the micro-batches of the accumulation's runs
            count = self._micro * self._params.gradient_accumulation_steps
            outputs.update(self._update(self._take_means(count), feeds))
        return outputs

    def _update(self, means: dict[str, np.ndarray], feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Average the gradients' means over the replicas, take the global norm over all stages, run the
        optimizer. Returns ``global_gradient_norm`` with clipping or mixed precision, and
        ``all_gradients_finite`` under mixed precision (the same on every stage: from the norm)."""
        p = self._params
        # Adasum: each replica updates with its own gradients (and its own pipeline's norm)
        eff = means if self._mode == "adasum" else self._replicas_average(means)
        if self._shared:
            sum_tied_gradients(self._comm, eff, self._shapes)
        norm = None
        if p.enable_grad_norm_clip or self._mp is not None:
            stage = self._stage
            counted = [v for g, v in eff.items() if counts_in_norm(g[: -len("_grad")], self._shared, stage)]
            local = squared_sum(counted)
            norm = np.asarray(
                np.sqrt(self._comm.allreduce_scalar(local, "pipeline gradient norm")), self._rank_norm_dtype()
            )
        finite = {} if self._mp is None else {ALL_FINITE: flag_array(np.isfinite(norm))}
        if norm is not None:  # the output global_gradient_norm: the whole model's, as one process's
            finite[NORM] = norm
        if not self._sg.trainable and self._mode != "adasum":  # Adasum: the replica's checks still run
            return finite
        lr = np.asarray(feeds[p.lr_params_feed_name], np.float32).reshape(1)
        given: dict[str, Any] = {**feeds, p.lr_params_feed_name: lr, **eff}
        if norm is not None:
            given[NORM] = norm
        if self._mode == "zero1":
            self._zero_update(given)
            return finite
        if self._mode == "adasum":
            self._adasum_update(given, finite)
        else:
            self._run_update(*self._update_plan("update"), given)
        return finite

    # ---- state --------------------------------------------------------------------------
    @serialized
    def gather_state(self) -> dict[str, np.ndarray]:
        """Every stage's weights and optimizer state, on every rank (a collective), e.g. for rank 0 to write a
        complete checkpoint that :meth:`load_state` of any stage accepts. Under ZeRO each stage's optimizer
        state is first reassembled over its replicas, under the unpartitioned names."""
        mine = self.get_state()
        if self._zero is not None:
            mine = gather_zero_state(self._data, self._zero, mine, self._zero_full_names())
        state: dict[str, np.ndarray] = {}
        for part in self._comm.allgather_object(mine, "gathering the pipeline's state"):
            for k, v in part.items():
                state.setdefault(k, v)
        return dict(sorted(state.items()))

    @raises_as_onnxruntime
    @serialized
    @all_or_nothing
    def load_state(self, state: Mapping[str, Any], strict: bool = False) -> None:
        """Copy this stage's names of ``state`` (from ``get_state()`` or ``gather_state()``) into the session;
        names of other stages are skipped, and so are the half twins (``<w>_fp16``) under mixed precision,
        once their shapes are checked. ``strict``: this stage's names (not the twins) must all be there."""
        known = set(self._state_names())
        twins = self._twin_masters()
        zero_names = self._zero_full_names() if self._zero is not None else {}
        covered: set[str] = set()  # this rank's names loaded from unpartitioned ZeRO state
        for name, value in state.items():
            if self._is_twin(name, value, twins):  # this stage's half twins: derived from the masters
                continue
            if name in known:
                self._assign(name, value)
            elif name in zero_names:  # ZeRO: the whole state of a weight, sliced to this replica's pieces
                arr = np.asarray(value)
                for local, pc, elementwise in zero_names[name]:
                    full = elementwise and arr.shape == self._zero.shapes[pc.weight]
                    self._assign(local, self._zero.piece_view(pc, arr) if full else arr)
                    covered.add(local)
        if strict:
            missing = sorted(known - set(state) - covered)
            if missing:
                raise KeyError(
                    f"load_state(strict=True): missing state tensor(s) {missing} of stage {self._stage}"
                )

    def get_partition_info_map(self) -> dict[str, dict[str, list[int]]]:
        z = self._zero
        if z is None:
            return {}
        return {w: {k: list(v) for k, v in d.items()} for w, d in z.partition_info.items()}

    def _all_optimizer_state_names(self) -> set[str]:
        """This stage's optimizer state names, whichever replica holds them under ZeRO."""
        return {sp.name for sp in self._specs} | getattr(self, "_full_state_names", set())

    def _trained(self) -> list[str]:
        return self._sg.trainable

    def _apply_initial_optimizer_state(self, initial: dict[str, dict[str, np.ndarray]]) -> None:
        names = {sp.name for sp in self._specs}
        for w, d in initial.items():
            if w != "shared_optimizer_state" and w not in self._sg.trainable:
                continue  # another stage's weight
            for key, v in d.items():
                name = key if w == "shared_optimizer_state" else f"{key}_{w}"
                if name not in names:
                    raise ValueError(f"set_optimizer_initial_state: no optimizer state {key!r} for {w!r}")
                self._assign(name, v)


def _exchange_mode(p: Any, replicas: int) -> str | None:
    """How a stage's replicas combine their updates (:func:`onnxtrain.parallel.exchange_mode`, as for the
    data-parallel session)."""
    if p.deepspeed_zero_stage not in (0, 1):
        raise NotImplementedError(f"deepspeed_zero_stage={p.deepspeed_zero_stage}: only stages 0 and 1 exist")
    return exchange_mode(p, replicas, "data-parallel replica")
