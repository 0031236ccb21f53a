"""The legacy ``TrainingSession`` with ``horizontal_parallel_size > 1``: Megatron's split MLP and attention
blocks over MPI.

``TrainingSession(model, params)`` returns a :class:`HorizontalTrainingSession` when the parameters ask for
``horizontal_parallel_size = H``; launch the script with ``mpiexec -n H`` (or ``H·D`` for D data-parallel
replicas, rank = replica · H + share), every rank of a replica with the same feeds.
Each rank keeps its share of every split block's weights (:mod:`onnxtrain.parallel.megatron`; its heads of
each attention block by :mod:`onnxtrain.parallel.megatron_attention`) and the other weights whole. The model
is cut around each block into pieces of plain ONNX graphs (:mod:`onnxtrain.parallel.stage_graphs`), run in
turn in one process: forward, the ranks summing a block's output (``MegatronG``); backward from the loss, the
ranks summing the gradient at a block's input (``MegatronF``). The gradient norm sums the shares' squares over
the ranks; one update graph moves every weight of the rank. The weights move as one process's do, within
float32 rounding of the split sums.
With ``gradient_accumulation_steps = N`` the rank adds up its gradients over N runs and updates with their
mean on the N-th, as one process does: the session counts the runs (``gradient_accumulation_mode =
"auto"``), or a run fetching ``Group_Accumulated_Gradients`` with ``only_execute_path_to_fetches`` is a
micro-step ("legacy"). A state gathered in between holds the weights, not the partial sums.
With replicas, ``deepspeed_zero_stage=1`` shards each rank's optimizer state over the replicas holding the
same share, and ``enable_adasum`` combines the replicas' weight deltas by Adasum, the dot products of a split
weight summed over its shares (:mod:`onnxtrain.session_exchange`).
Under mixed precision the pass rewrites each rank's split model (its casts read the shares); half partial
sums cross the ranks in float32.
With ``pipeline_parallel_size = P`` as well, the model is cut into stages at the pipeline's cuts and each
stage's blocks split over H ranks: ``mpiexec -n H·D·P``, rank = stage · H·D + replica · H + share (the
legacy's layout). A rank runs its stage's pieces, receives the stage before's tensors and sends the next
stage its own, per micro-batch (``num_pipeline_micro_batches``, GPipe's schedule, as the pipelined session
runs); the gradient norm and a weight read in several stages sum over the stages.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import helper

from onnxtrain.engine.seeds import unseeded_generator
from onnxtrain.errors import raises_as_onnxruntime
from onnxtrain.graph_transforms.flags import flag_array
from onnxtrain.graph_transforms.mixed_precision import (
    ALL_FINITE,
    half_copies,
    mixed_precision,
    mixed_precision_info,
)
from onnxtrain.inference import NodeArg
from onnxtrain.ir.graphs import RANDOM_OPS, subgraphs, walk_graphs
from onnxtrain.optim import WeightSlot, get_optimizer
from onnxtrain.parallel import exchange_mode, get_communicator
from onnxtrain.parallel.fingerprint import check_same_on_all_ranks
from onnxtrain.parallel.megatron import find_mlp_blocks, join_shares, shard_blocks, share_name, take_share
from onnxtrain.parallel.megatron_attention import find_attention_blocks
from onnxtrain.parallel.pipeline import merge_cuts, parse_cut_info, partition
from onnxtrain.parallel.stage_graphs import (
    NORM,
    StageGraphs,
    build_stage_graphs,
    layer_activations,
)
from onnxtrain.parallel.zero import gather_zero_state
from onnxtrain.parameters import PIPELINE
from onnxtrain.session import all_or_nothing, serialized
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
from onnxtrain.training_graph import (
    build_update_graph,
    check_learning_rate_not_loss_scale,
    select_trainable,
    update_clips,
)
from onnxtrain.user_warning import warn

SHARE_SEED_STEP = 7_919  # a random node inside a split block: rank r's seed is the agreed one + r × this
# options a horizontally split session refuses without pipeline stages (they would do nothing): name → its
# default
_REFUSED = {k: d for k, d in PIPELINE.items() if k != "pipeline_parallel_size"}
_OPTIONS = ("horizontal_parallel_size", *PIPELINE, *SHARED_OPTIONS)


class HorizontalTrainingSession(MicroBatching, CutModelSession):
    """One rank's share of a horizontally split legacy training session (see the module docstring)."""

    what = "horizontal_parallel_size > 1"

    def _build(self, path_or_bytes: str | bytes | os.PathLike | onnx.ModelProto) -> None:
        p = self._params
        h, stages = p.horizontal_parallel_size, p.pipeline_parallel_size
        dumps = [k for k in ("model_after_graph_transforms_path", "model_with_gradient_graph_path",
                             "model_with_training_graph_path") if getattr(p, k)]
        if self._sess_options.optimized_model_filepath:
            dumps.append("SessionOptions.optimized_model_filepath")
        if dumps:
            warn(f"{', '.join(dumps)}: a horizontally split session writes no graph there (each rank runs "
                 "pieces of its share)")
        if stages > 1:
            self.what = "horizontal_parallel_size > 1 with pipeline_parallel_size > 1"
        self._setup(_REFUSED if stages == 1 else {})
        sizes = "horizontal_parallel_size" + ("" if stages == 1 else " × pipeline_parallel_size")
        replicas = self._replicas(p, h * stages, sizes)
        self._mode = exchange_mode(p, replicas, "data-parallel replica")
        model = self._training_model(path_or_bytes)
        world_comm = get_communicator()
        check_same_on_all_ranks(
            world_comm, model_fingerprint(model, p, _OPTIONS), "model and horizontal setup"
        )
        # rank = stage · H·D + replica · H + share, as the legacy layout (the horizontal index fastest)
        rank = world_comm.rank
        self._split_groups(world_comm, rank % h, rank // h % replicas, rank // (h * replicas), stages)
        self._opt = get_optimizer(p.training_optimizer_name, p.use_fp16_moments)
        trainable = select_trainable(model, p)
        self._model_trained = list(trainable)
        self._check_attribute_maps()  # (before the stage is built and its dumps written)
        self._check_initial_state(model, trainable, shapes=False)  # (its shapes: the shares' or whole)
        self._check_learning_rate(model, trainable)
        blocks: list = find_mlp_blocks(model, trainable, h)
        taken = {k for b in blocks for k in (*b.entries, b.second)}
        blocks = sorted(
            [*blocks, *find_attention_blocks(model, trainable, h, taken)], key=lambda b: min(b.entries)
        )
        if not blocks:
            warn(
                f"horizontal_parallel_size={h}: no MLP or attention block of the model splits over {h} "
                "ranks (see the README); every rank computes the whole model"
            )
        self._blocks = blocks
        sharded, cuts, self._split = shard_blocks(model, blocks, self._comm.rank, h)
        self._shares = {sw.share: w for w, sw in self._split.items()}  # share's name → the weight's
        self._check_learning_rate_shares(h)
        if p.use_mixed_precision:  # on the rank's model: its casts read the shares
            sharded = mixed_precision(sharded, p.loss_output_name, p.mixed_precision_dtype)
            self._mp = mixed_precision_info(sharded)
            check_learning_rate_not_loss_scale(p.lr_params_feed_name, self._mp.loss_scale)
            self.loss_scale_input_name = self._mp.loss_scale
            outputs = [o for o in sharded.graph.output if o.name != self._mp.scaled_loss]  # not a user output
            del sharded.graph.output[:]
            sharded.graph.output.extend(outputs)
        part = self._cut(sharded, cuts, blocks)
        self._seed_random_nodes(sharded, part.stage_of)
        self._setup_micro_batches(model, self.loss_scale_input_name)
        every = [self._split[w].share if w in self._split else w for w in trainable]
        layers = layer_activations(sharded, p)  # once for all the pieces
        self._pieces: dict[int, StageGraphs] = {
            s: build_stage_graphs(
                sharded, part, s, every, p, self._opt, self._mp, self._micro_input, False, layers
            )
            for s in range(self._first, self._end + 1)
        }
        self._store: dict[str, np.ndarray] = {}
        for sg in self._pieces.values():
            self._store.update(sg.initial)
            self._bn_stats.update(sg.bn_stats)
        self._trainable = [w for w in every if w in self._store]  # those of this rank's stage
        self._tied: dict[str, tuple[int, ...]] = {}
        if stages > 1:
            self._tied = tied_weights(sharded, lambda k: {self._piece_stage[s] for s in part.runs(k)}, every)
            inits = {t.name: t for t in sharded.graph.initializer}
            self._tied_shapes = {w: tuple(inits[w].dims) for w in self._tied}
        self._build_update(sharded)
        self._apply_initial_optimizer_state(p.optimizer_initial_state())
        self._zero_graph = self._setup_zero(sharded)
        self._interface(model, trainable if p.set_gradients_as_graph_outputs else ())
        if self._mp is not None:  # the rank's model reads the loss scale
            self._user_inputs.append(self._mp.loss_scale)
            self._inputs.append(NodeArg(self._mp.loss_scale, "tensor(float)", [1]))
            self._dtypes[self._mp.loss_scale] = np.dtype(np.float32)
        self._setup_accumulation()

    # ---- construction ----------------------------------------------------------------
    def _check_learning_rate_shares(self, size: int) -> None:
        """Refuse, on every rank, a learning-rate feed name that names any rank's share of a split weight
        (``W1_column_rank_1``) or a value the rank derives from it (its gradient, moments, step count, update
        output, half copy: a name holding the share's name as a ``_``-separated part). Such names exist on
        one rank only: the rank holding that share refused it, or took the feed in the share's state's
        place, while the others went on alone (the check before the split knows the model's names only)."""
        name = self._params.lr_params_feed_name
        for w, sw in self._split.items():
            for r in range(size):
                share = share_name(w, sw.row, r)
                if re.search(rf"(^|_){re.escape(share)}(_|$)", name):
                    raise ValueError(
                        f"lr_params_feed_name {name!r} names rank {r}'s share of the split weight {w!r} "
                        f"({share!r}) or a value derived from it; name the learning-rate feed otherwise "
                        "(TrainingParameters.lr_params_feed_name)"
                    )

    def _split_groups(self, comm: Any, share: int, replica: int, stage: int, stages: int) -> None:
        """``self._comm``: the ranks splitting this rank's blocks (ordered by share); ``self._data``: those
        holding the same share of the same stage in every replica (None with one replica); ``self._pipe``:
        the stages of this rank's share and replica (None with one stage); ``self._replica``: every rank of
        this rank's replica (with stages and replicas; else None: ``self._comm`` holds them)."""
        h, d = self._params.horizontal_parallel_size, self.data_parallel_size
        self.data_parallel_rank = replica
        self._reducer = None
        self._wide_sums = ({}, 1)  # (as SessionCut._groups)
        self._stage, self._stages = stage, stages
        split = comm.split
        self._comm = comm if comm.size == h else split(stage * d + replica, share, "forming the split groups")
        self._data = None if d == 1 else split(stage * h + share, replica, "forming the data-parallel groups")
        self._pipe = None if stages == 1 else split(replica * h + share, stage, "forming the pipelines")
        many = stages > 1 and d > 1
        self._replica = split(replica, stage * h + share, "forming the replicas") if many else None

    def _cut(self, sharded: onnx.ModelProto, cuts: list, blocks: list) -> Any:
        """Cut the rank's model around its split blocks (and at the pipeline's cuts): the partition into
        pieces, and what each piece does (``_g_sum``: after the piece, the ranks sum its block's output;
        ``_f_sum``: before its backward, the gradient of the next block's input; ``_in_block``), its stage
        and this rank's pieces (``_first`` to ``_end``)."""
        p = self._params
        stage_cuts = parse_cut_info(p.pipeline_cut_info_string, self._stages) if self._stages > 1 else []
        merged = merge_cuts(sharded, stage_cuts, cuts)
        try:
            part = partition(sharded, [mc.edges for mc in merged], p.loss_output_name)
        except ValueError as e:  # the blocks side by side, or the loss inside one
            names = ", ".join(b.columns[0][0] for b in blocks)
            if self._stages == 1:
                raise NotImplementedError(
                    f"horizontal parallelism splits blocks that follow one another, with the loss after the "
                    f"last: {names} do not ({e})"
                ) from None
            raise ValueError(
                f"the model cut at pipeline_cut_info_string {p.pipeline_cut_info_string!r} and around the "
                f"split blocks ({names}): {e}"
            ) from None
        self._g_sum: dict[int, str] = {}
        self._f_sum: dict[int, str] = {}
        self._in_block: set[int] = set()
        self._piece_stage = [0]
        for c, mc in enumerate(merged):  # cut c follows piece c
            if mc.block_cut is not None and mc.block_cut % 2 == 0:
                self._f_sum[c] = mc.edges[0].tensor
                self._in_block.add(c + 1)
            elif mc.block_cut is not None:
                self._g_sum[c] = mc.edges[0].tensor
            self._piece_stage.append(self._piece_stage[-1] + mc.ends_stage)
        mine = [s for s, z in enumerate(self._piece_stage) if z == self._stage]
        self._first, self._end = mine[0], mine[-1]
        self._part = part
        return part

    def _seed_random_nodes(self, model: onnx.ModelProto, piece_of: list[int]) -> None:
        """Random nodes outside the split blocks (a Dropout between them) run on every rank of a replica,
        which must draw the same values: each unseeded one gets a seed the replica's ranks agree on (from
        the first rank's seed sequence, so :func:`onnxtrain.set_seed` still fixes them), each replica
        its own. Inside a block (odd pieces) each rank draws for its own share: the seed plus
        ``SHARE_SEED_STEP`` × the rank's share, as Megatron's model-parallel generator does. A random node
        in a body (an If's branch, a Loop's body) is seeded as its outermost node's piece says."""
        nodes = [
            (k, m)
            for k, n in enumerate(model.graph.node)
            for m in (n, *(b for g in subgraphs(n) for sub in walk_graphs(g) for b in sub.node))
            if m.op_type in RANDOM_OPS
        ]
        if not nodes:
            return
        mine = int(unseeded_generator({}).integers(2**31 - 1)) + 1_000_003 * self.data_parallel_rank
        base = self._comm.allgather_object(mine, "agreeing on the random nodes' seeds")[0]
        for j, (k, n) in enumerate(nodes):
            given = next((a for a in n.attribute if a.name == "seed"), None)
            inside = piece_of[k] in self._in_block
            if given is not None and not inside:
                continue  # the user's seed: alike on every rank already
            seed = helper.get_attribute_value(given) if given is not None else base + j
            if inside:
                seed += SHARE_SEED_STEP * self._comm.rank
                if given is not None:
                    n.attribute.remove(given)
            value = int(seed) % (2**31 - 1) if n.op_type == "Dropout" else float(seed)
            n.attribute.append(helper.make_attribute("seed", value))

    def _build_update(self, sharded: onnx.ModelProto) -> None:
        p = self._params
        inits = {t.name: t for t in sharded.graph.initializer}
        slots = [
            WeightSlot(
                w,
                f"{w}_grad",
                tuple(self._store[w].shape),
                inits[w].data_type,
                dict(p.optimizer_attributes_map.get(self._original(w), {})),
                dict(p.optimizer_int_attributes_map.get(self._original(w), {})),
            )
            for w in self._trainable
        ]
        clip = update_clips(p, self._mode == "adasum")
        # mixed precision always reads the norm: whether every gradient is finite comes from it
        norm = NORM if clip or self._mp is not None else None
        self._update_graph, self._update_outputs, _, self._specs = build_update_graph(
            sharded, slots, p, self._opt, clip=clip, norm_input=norm, mp=self._mp
        )
        for sp in self._specs:
            self._store[sp.name] = sp.initial.copy()
        self._spec_of = {sp.name: sp for sp in self._specs}

    def _original(self, name: str) -> str:
        return self._shares.get(name, name)

    def get_model_state(
        self, include_mixed_precision_weights: bool = False
    ) -> dict[str, dict[str, np.ndarray]]:
        """The rank's weights under the model's names (spec §5.3): a split weight's entry holds its share."""
        out = super().get_model_state(include_mixed_precision_weights)
        return {kind: {self._original(w): v for w, v in d.items()} for kind, d in out.items()}

    def get_optimizer_state(self) -> dict[str, dict[str, np.ndarray]]:
        """The rank's optimizer state under the model's weight names (spec §5.4): a split weight's moments
        are its share's."""
        return {self._original(w): d for w, d in super().get_optimizer_state().items()}

    def _trained(self) -> list[str]:
        return self._trainable

    def _plan(self, piece: int, kind: str) -> Any:
        key = (piece, kind)
        if key not in self._plans:
            if piece < 0:
                updates = {o: s for s, o in self._update_outputs_of(kind).items()}
                model = self._update_graph if kind == "update" else self._zero_graph
            else:
                updates, model = None, self._pieces[piece].graphs[kind]
            self._plans[key] = self._new_plan(model, updates, keep_binding=piece < 0)
        return self._plans[key]

    def _update_outputs_of(self, kind: str) -> dict[str, str]:
        """An update graph's outputs (state name → output): "update" or, under ZeRO, "zero_update"."""
        return self._update_outputs if kind == "update" else self._zero_updates

    def _update_plan(self, kind: str) -> tuple[Any, dict[str, str]]:
        return self._plan(-1, kind), self._update_outputs_of(kind)

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (0 = the first; 0 without pipeline stages)."""
        return self._stage

    def model_trained_weights(self) -> list[str]:
        """The trained weights of the whole model under one process's names, every stage's
        (``get_model_state()`` holds this rank's shares): those a checkpoint of ``gather_state()`` trains."""
        return list(self._model_trained)

    # ---- running -------------------------------------------------------------------------
    def _forward_only(self, feeds: dict[str, np.ndarray], dropout: bool) -> dict[str, np.ndarray]:
        return self._forward(feeds, dropout, "forward")[0]

    def _feeds(self, piece: int, kind: str, values: Mapping[str, Any], dropout: bool) -> dict[str, Any]:
        return self._plan_feeds(self._plan(piece, kind), (values,), dropout)

    def _forward(
        self,
        feeds: dict[str, np.ndarray],
        dropout: bool,
        kind: str,
        tag: int = 0,
        pending: list | None = None,
    ) -> tuple[dict[str, np.ndarray], dict[int, dict[str, np.ndarray]]]:
        """This rank's pieces forward on one (micro-)batch (for ``kind="forward_train"``, all but the model's
        last piece, whose backward runs its forward), a G sum after each block; with stages, the tensors of
        the stage before received first and those of the next sent last (``pending`` collects the send, else
        it is waited for). Returns the values computed and, per piece, the activations its backward reads."""
        values: dict[str, np.ndarray] = dict(feeds)
        z, last = self._stage, len(self._piece_stage) - 1
        if z > 0:
            values.update(self._pipe.recv_object(z - 1, tag, f"stage {z} receiving its inputs"))
        saved: dict[int, dict[str, np.ndarray]] = {}
        for s in range(self._first, self._end + 1 if kind == "forward" or self._end < last else last):
            plan = self._plan(s, kind)
            if kind == "forward":  # a forward-only run may leave out inputs its fetches do not read
                plan = self._forward_for((s, kind), plan, self._pieces[s].graphs[kind], values)
            names = list(plan.output_names)
            fed = self._plan_feeds(plan, (values,), dropout)
            out = dict(zip(names, plan.run(fed, names)))
            saved[s] = {n: out[n] for n in self._pieces[s].saved if n in out}  # later pieces may read them
            if kind == "forward_train":
                self._keep_running_stats(out, self._pieces[s].bn_stats, fed)
            values.update(out)
            if s in self._g_sum:  # after a block: its output is the ranks' sum
                t = self._g_sum[s]
                values[t] = self._rank_sum(values[t], f"MegatronG: the sum of {t!r}")
        if z < self._stages - 1:
            sent = {t: values[t] for t in self._part.sends[self._end]}
            req = self._pipe.isend_object(sent, z + 1, tag, f"stage {z} sending its outputs")
            if pending is None:
                req.wait()
            else:
                pending.append(req)
        return values, saved

    def _backward(
        self,
        values: dict[str, np.ndarray],
        saved: dict[int, dict[str, np.ndarray]],
        dropout: bool,
        tag: int = 1,
        pending: list | None = None,
    ) -> dict[str, np.ndarray]:
        """This rank's pieces backward on one (micro-)batch, seeded by the gradients the next stage sends
        (none in the last stage, whose last piece runs from the loss and writes the user outputs into
        ``values``), an F sum before each block's input is passed back; the gradients of the tensors the
        stage received go back to the stage before. Returns the gradients of this rank's trained weights."""
        z, last = self._stage, len(self._piece_stage) - 1
        grads: dict[str, np.ndarray] = {}  # tensor → its gradient so far (weights included)
        if z < self._stages - 1:
            grads.update(self._pipe.recv_object(z + 1, tag, f"stage {z} receiving its output gradients"))
        for s in range(self._end, self._first - 1, -1):
            sg = self._pieces[s]
            t = self._f_sum.get(s)
            if t is not None and t in grads:  # a block's input: its gradient is the ranks' sum
                grads[t] = self._rank_sum(grads[t], f"MegatronF: the gradient of {t!r}")
            given = {**values, **saved.get(s, {})}
            for t in sg.seeded:
                given[f"{t}_grad"] = grads[t] if t in grads else np.zeros_like(values[t])
            wanted = [
                *(sg.outputs if s == last else ()),
                *(f"{x}_grad" for x in (*sg.trainable, *sg.diff_received)),
                *(sg.bn_stats.values() if s == last else ()),
            ]
            if not wanted:  # a piece with no weight and nothing to pass back (the Identity before a block)
                continue
            plan = self._plan(s, "backward")
            fed = self._feeds(s, "backward", given, dropout)
            res = dict(zip(wanted, plan.run(fed, wanted)))
            if s == last:
                values.update({n: res[n] for n in sg.outputs})
                self._keep_running_stats(res, sg.bn_stats, fed)
            for x in (*sg.trainable, *sg.diff_received):
                g = res[f"{x}_grad"]
                grads[x] = grads[x] + g if x in grads else g
        if z > 0:
            back = {t: grads[t] for t in self._part.sends[self._first - 1] if t in grads}
            req = self._pipe.isend_object(back, z - 1, tag, f"stage {z} sending its input gradients")
            if pending is None:
                req.wait()
            else:
                pending.append(req)
        return {w: grads[w] for w in self._trainable}

    def _train_step(
        self, feeds: dict[str, np.ndarray], dropout: bool, update: bool, accumulate: bool = True
    ) -> dict[str, np.ndarray]:
        m, n = self._micro, self._params.gradient_accumulation_steps
        summed = m > 1 or n > 1  # the gradients go through the accumulation's sums
        micro = self._micro_feeds(feeds, m)
        pending: list = []
        kept = [self._forward(micro[k], dropout, "forward_train", 2 * k, pending) for k in range(m)]
        own = GradientSums()  # the run's gradients over its micro-batches, when they are outputs
        for k, (values, saved) in enumerate(kept):
            grads = self._backward(values, saved, dropout, 2 * k + 1, pending)
            kept[k] = (values, {})  # the micro-batch's activations are freed
            for w, g in grads.items() if summed else ():
                if accumulate:
                    self._add_gradient(w, g)
                if self._grad_outputs and m > 1:
                    own.add(w, g)
        for r in pending:
            r.wait()
        values = kept[-1][0]  # the outputs of the run's last micro-batch
        if self._grad_outputs:  # the run's own gradients: their mean over its micro-batches
            values.update(self._whole_gradients(own.means(m) if m > 1 else grads))
        if not accumulate:
            return values
        if summed:
            self._micro_step += 1
            if not update:
                return values
            grads = self._take_means(m * n)
        values.update(self._update(grads, values))
        return values

    def _gathered(self, values: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        """The run's outputs: with stages, from the stages that computed them."""
        if self._pipe is None:
            return values
        return gather_stage_outputs(self._pipe, values, names, self._grad_outputs)

    def _rank_sum(self, a: np.ndarray, what: str) -> np.ndarray:
        """``a`` summed over the ranks splitting the blocks; a half-precision array is summed in float32 (MPI
        has no half type), then rounded back."""
        if a.dtype in (np.float32, np.float64):
            return self._comm.allreduce_(np.array(a), what)
        return self._comm.allreduce_(a.astype(np.float32), what).astype(a.dtype)

    def _update(self, grads: dict[str, np.ndarray], feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Run the optimizer on the rank's gradients (``feeds``: the run's, with the learning rate and the
        loss scale); returns ``global_gradient_norm`` with clipping or mixed precision and
        ``all_gradients_finite`` under mixed precision (the same on every rank: from the global norm)."""
        p = self._params
        if self._mode != "adasum":  # Adasum: each replica updates with its own gradients
            grads = self._replicas_average(grads)
        named = {f"{w}_grad": g for w, g in grads.items()}
        if self._tied:
            sum_tied_gradients(self._pipe, named, self._tied_shapes)
        lr = p.lr_params_feed_name
        given: dict[str, Any] = {lr: np.asarray(feeds[lr], np.float32).reshape(1), **named}
        if self._mp is not None:
            given[self._mp.loss_scale] = feeds[self._mp.loss_scale]
        finite: dict[str, np.ndarray] = {}
        if p.enable_grad_norm_clip or self._mp is not None:
            counted = {w: named[f"{w}_grad"] for w in grads if counts_in_norm(w, self._tied, self._stage)}
            whole = squared_sum(g for w, g in counted.items() if w not in self._shares)  # alike over a split
            split = self._comm.allreduce_scalar(
                squared_sum(g for w, g in counted.items() if w in self._shares),
                "the gradient norm of the split weights",
            )
            total = whole + split
            if self._pipe is not None:
                total = self._pipe.allreduce_scalar(total, "the gradient norm over the stages")
            given[NORM] = np.asarray(np.sqrt(total), self._rank_norm_dtype())
            finite[NORM] = given[NORM]  # the output global_gradient_norm: the whole model's, as one process's
            if self._mp is not None:
                finite[ALL_FINITE] = flag_array(np.isfinite(given[NORM]))
        if not self._trainable and self._mode != "adasum":  # Adasum: the replica's checks still run
            return finite
        if self._mode == "zero1":
            self._zero_update(given)
        elif self._mode == "adasum":
            self._adasum_update(given, finite, self._shares, self._replica)
        else:
            self._run_update(*self._update_plan("update"), given)
        return finite

    # ---- state ---------------------------------------------------------------------------
    def _full_name(self, name: str) -> tuple[str, str | None]:
        """A state name with the full weight's name, and that weight when ``name`` belongs to a share."""
        sp = self._spec_of.get(name)
        w = sp.weight if sp is not None else name
        orig = self._shares.get(w)
        if orig is None:
            return name, None
        return (orig if sp is None else f"{sp.key}_{orig}"), orig

    def _whole_gradients(self, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The run's gradients as outputs (``<w>_grad`` under the whole model's names), a split weight's put
        together from every rank's share. A collective."""
        split = {w: g for w, g in grads.items() if w in self._shares}
        parts = self._comm.allgather_object(split, "gathering the split gradients")
        out: dict[str, np.ndarray] = {}
        for w, g in grads.items():
            orig = self._shares.get(w)
            if orig is None:
                out[f"{w}_grad"] = g
                continue
            sw = self._split[orig]
            shares = [part[share_name(orig, sw.row, r)] for r, part in enumerate(parts)]
            out[f"{orig}_grad"] = join_shares(shares, sw.axis, sw.segments)
        return out

    def _twin_of(self, weight: str) -> str | None:
        if self._mp is None:
            return None
        share = self._split[weight].share if weight in self._split else weight
        twin = self._mp.twins.get(share)
        return None if twin is None else twin.replace(share, weight)

    @serialized
    def gather_state(self) -> dict[str, np.ndarray]:
        """The state of the whole model under one process's names: each split weight (and its optimizer
        state) put together from every rank's share, the optimizer state under ZeRO first reassembled over
        the replicas, every stage's; under mixed precision, with the whole weights' half twins. A
        collective."""
        twins = self._twin_masters()  # the shares' twins are not the whole weights'
        mine = {k: v for k, v in self.get_state().items() if k not in twins}
        if self._zero is not None:
            mine = gather_zero_state(self._data, self._zero, mine, self._zero_full_names())
        parts = self._comm.allgather_object(mine, "gathering the split weights")
        out: dict[str, np.ndarray] = {}
        for name, value in mine.items():
            full, orig = self._full_name(name)
            if orig is None or value.shape != self._store[self._split[orig].share].shape:
                out[full] = value
                continue
            sw = self._split[orig]
            shares = [
                part[name.replace(sw.share, share_name(orig, sw.row, r))]
                for r, part in enumerate(parts)
            ]
            out[full] = join_shares(shares, sw.axis, sw.segments)
        if twins:
            whole = {self._original(w): twin.replace(w, self._original(w)) for twin, w in twins.items()}
            copies = half_copies({w: out[w] for w in whole}, self._mp.dtype)
            out.update({twin: copies[w] for w, twin in whole.items()})
        if self._pipe is not None:  # every stage's
            for part in self._pipe.allgather_object(out, "gathering the stages' state"):
                for k, v in part.items():
                    out.setdefault(k, v)
        return dict(sorted(out.items()))

    @raises_as_onnxruntime
    @serialized
    @all_or_nothing
    def load_state(self, state: Mapping[str, Any], strict: bool = False) -> None:
        """This rank's names of ``state``, or the whole model's (as from ``gather_state()``), whose split
        weights and optimizer state are cut to this rank's share (and under ZeRO, to this replica's pieces).
        ``strict``: every state tensor this rank holds must be given."""
        size, rank = self._comm.size, self._comm.rank
        zero_names = self._zero_full_names() if self._zero is not None else {}
        held = set(self._state_names())
        loaded: set[str] = set()
        for name in sorted(held | set(self._spec_of)):  # the optimizer state also unpartitioned by ZeRO
            full, orig = self._full_name(name)
            if name in state:
                value = np.asarray(state[name])
            elif full in state:
                value = np.asarray(state[full])
                shape = self._store[name].shape if name in self._store else self._spec_of[name].initial.shape
                if orig is not None and value.shape != shape:
                    sw = self._split[orig]
                    whole = list(shape)
                    whole[sw.axis] = sum(sw.segments) if sw.segments else shape[sw.axis] * size
                    if list(value.shape) != whole:  # (take_share would cut any array long enough)
                        raise ValueError(f"state {full!r}: expected shape {whole} (or this rank's share's, "
                                         f"{list(shape)}), got {list(value.shape)}")
                    value = take_share(value, sw.axis, rank, size, sw.segments)
            else:
                continue
            if name in held:
                self._assign(name, value)
                loaded.add(name)
            for local, pc, elementwise in zero_names.get(name, ()):  # ZeRO: this replica's pieces of it
                whole = elementwise and value.shape == self._zero.shapes[pc.weight]
                self._assign(local, self._zero.piece_view(pc, value) if whole else value)
                loaded.add(local)
        if strict:
            missing = sorted(held - loaded)
            if missing:
                raise KeyError(f"load_state(strict=True): missing state tensor(s) {missing}")

    def get_partition_info_map(self) -> dict[str, dict[str, list[int]]]:
        """For each split weight of this rank's stage, trained or frozen: its full shape and
        ``megatron_row_partition`` (0 columns, 1 rows); under ZeRO, each weight's pieces as well (under this
        rank's names)."""
        inits = {t.name: t for t in self._model.graph.initializer}
        held = {t.name for sg in self._pieces.values() for t in sg.graphs["stage"].graph.initializer}
        out = {
            w: {"original_dim": list(inits[w].dims), "megatron_row_partition": [sw.row]}
            for w, sw in self._split.items()
            if sw.share in held
        }
        if self._zero is not None:
            for w, d in self._zero.partition_info.items():
                out.setdefault(w, {}).update({k: list(v) for k, v in d.items()})
        return out

    def _apply_initial_optimizer_state(self, initial: dict[str, dict[str, np.ndarray]]) -> None:
        state = {}
        for w, d in initial.items():
            for key, v in d.items():
                state[key if w == "shared_optimizer_state" else f"{key}_{w}"] = v
        self.load_state(state)
