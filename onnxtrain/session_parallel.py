"""Data parallelism of the legacy session over MPI: gradient exchange (allreduce, Adasum), ZeRO stage 1.

``DataParallelSteps`` holds the session methods that only a run under ``mpiexec`` with several ranks uses;
:class:`onnxtrain.session.TrainingSession` mixes it in. The exchange itself lives in
:mod:`onnxtrain.parallel`; this module composes it with the session's step graphs and state store.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from onnxtrain.capi.feeds import empty_run
from onnxtrain.graph_transforms import accumulation
from onnxtrain.graph_transforms.clipping import norm_dtype
from onnxtrain.graph_transforms.flags import flag_array
from onnxtrain.graph_transforms.mixed_precision import ALL_FINITE
from onnxtrain.parallel import BucketReducer
from onnxtrain.parallel.adasum import ALL_DELTAS_FINITE, adasum_step, every_rank_finite
from onnxtrain.parallel.buckets import scale_into, wire_dtype
from onnxtrain.parallel.fingerprint import array_digest, canonical, check_same_scalars, digest
from onnxtrain.parallel.zero import gather_zero_state, zero_update_slots
from onnxtrain.parameters import TrainingParameters
from onnxtrain.training_graph import StepGraphs, build_update_graph


class DataParallelSteps:
    """The data-parallel part of ``TrainingSession`` (state: ``_dp``, ``_zero``, ``_store``, ``_graphs``)."""

    def _setup_data_parallel(self) -> None:
        """Buffers, layout and graphs for the gradient exchange (``self._dp.mode``)."""
        g, p, dp = self._graphs, self._params, self._dp
        steps = p.gradient_accumulation_steps
        g.split()  # the two halves, and their entries in g.updates
        gupd = g.updates["gradients"]
        self._grad_outputs = [
            gupd[accumulation.buffer_name(f"{w}_grad")] if steps > 1 else f"{w}_grad" for w in g.trainable
        ]
        self._grad_scale = 1.0 / (steps * dp.size)  # the legacy's 1/(N·D): gradients are averaged
        weights = [self._store[w] for w in g.trainable]
        # the global norm's dtype, as the step graph computes it (float64 when a trained weight is)
        self._norm_dtype = norm_dtype(weights)
        if dp.mode == "allreduce":
            self._reducer = BucketReducer(dp.comm, [a.shape for a in weights], [a.dtype for a in weights])
        elif dp.mode == "zero1":
            z, dt, slots = zero_update_slots({w: self._store[w] for w in g.trainable}, dp.size, dp.rank, p)
            self._zero = z
            norm = next((e for e in g.extra_outputs if e.startswith("global_gradient_norm")), None)
            self._norm_name = norm
            mp = g.mixed_precision  # its update always reads the norm: the all-finite flag comes from it
            model, upd, extras, specs = build_update_graph(
                g.gradient, slots, p, self._opt, clip=p.enable_grad_norm_clip if mp else norm is not None,
                norm_input=norm, mp=mp,
            )
            self._zero_extras = extras  # the mixed-precision update's all_gradients_finite
            self._extra_models["zero_update"] = model
            self._zero_updates = upd
            for sp in self._specs:  # the full state is replaced by the state of this rank's pieces
                del self._store[sp.name]
            self._specs = specs
            for sp in specs:
                self._store[sp.name] = sp.initial.copy()
            # half-precision gradients are summed in float32, scaled after the sum (in float32: one process)
            self._zgrad = np.zeros(z.padded, wire_dtype(dt))
            self._zown = np.zeros(z.per_rank, wire_dtype(dt))
            self._zdtype = np.dtype(dt)

    def _run_data_parallel(self, names: list[str], feeds: dict[str, Any]) -> list[np.ndarray]:
        """One optimizer step across ranks: local gradients → exchange (allreduce/Adasum/ZeRO) → update."""
        g, store, dp = self._graphs, self._store, self._dp
        gp = self._get_plan("gradients")
        bn_items = [(s, o) for s, o in g.updates["gradients"].items() if s in g.bn_stats]
        local_names = [n for n in names if n in gp.output_info]
        res = gp.run(self._feeds_of(gp, feeds), local_names + self._grad_outputs + [o for _, o in bn_items])
        got = dict(zip(local_names, res))
        # (the sums of half gradients are float32: they reach the weight's type in the exchange's scaling,
        # rounded once, as one process's mean of its float32 buffers)
        grads = res[len(local_names) : len(local_names) + len(self._grad_outputs)]
        for (stat, _), v in zip(bn_items, res[len(local_names) + len(grads) :]):
            if not empty_run(feeds):  # this rank's part of the batch is empty: its statistics stay
                store[stat] = v
        if dp.mode == "zero1":
            scale = self.loss_scale_input_name
            lr = feeds[self._params.lr_params_feed_name]
            got.update(self._zero_step(grads, feeds, lr, feeds[scale] if scale else None))
        else:
            self._exchange_and_update(grads, feeds, [n for n in names if n not in got], got)
        for b in g.buffers:
            store[b] = np.zeros_like(store[b])
        self._micro_step = 0
        missing = [n for n in names if n not in got]
        if missing:
            raise ValueError(f"output(s) {missing} are not available in a data-parallel step")
        return [got[n] for n in names]

    def _exchange_and_update(self, grads: list[np.ndarray], feeds: dict[str, Any], wanted: list[str],
                             got: dict[str, np.ndarray]) -> None:
        """Allreduce: reduce the gradients, then update; Adasum: update locally, then combine the deltas.
        The update graph's outputs among ``wanted`` go into ``got``."""
        g, store, dp = self._graphs, self._store, self._dp
        up = self._get_plan("update")
        items = list(g.updates["update"].items())
        if dp.mode == "allreduce":
            self._check_same_update_feeds(feeds)
            eff = self._reducer.reduce(grads, self._grad_scale)
        else:  # adasum: the optimizer runs on the local (accumulation-averaged) gradients
            n = self._params.gradient_accumulation_steps
            eff = [gr.astype(store[w].dtype, copy=False) if n == 1
                   else scale_into(gr, 1.0 / n, np.empty(gr.shape, store[w].dtype))
                   for gr, w in zip(grads, g.trainable)]
        # the learning rate and a mixed-precision update's loss scale from the caller's feeds
        ufeeds = self._feeds_of(up, feeds, {f"{w}_grad": v for w, v in zip(g.trainable, eff)})
        extra = [n for n in wanted if n in up.output_info]
        local_flag = dp.mode == "adasum" and ALL_FINITE in up.output_info  # mixed precision
        if local_flag and ALL_FINITE not in extra:
            extra.append(ALL_FINITE)
        out = up.run(ufeeds, extra + [o for _, o in items])
        got.update(zip(extra, out))
        new = dict(zip([s for s, _ in items], out[len(extra) :]))
        if dp.mode == "adasum":
            new = self._adasum_combine(new, got, local_flag)
        store.update(new)

    def _check_same_update_feeds(self, feeds: dict[str, Any]) -> None:
        """ValueError on every rank when the ranks fed different learning rates (or loss scales) to an
        allreduce or ZeRO step: under allreduce each rank updates its own replica with the averaged
        gradients and its own feeds, so the replicas would drift apart without a word; under ZeRO each rank
        updates its share of the weights with its own, and gradients of different loss scales are summed.
        (Adasum's ranks may differ: their deltas are combined.) One allgather of two values a step."""
        wanted = (self._params.lr_params_feed_name, self.loss_scale_input_name)
        values = {f"input {n!r}": np.asarray(feeds[n], np.float64).reshape(-1)[0]
                  for n in wanted if n and n in feeds}
        check_same_scalars(self._dp.comm, values, "checking the ranks' learning rates")

    def _adasum_combine(self, new: dict[str, np.ndarray], got: dict[str, np.ndarray],
                        mixed_precision: bool) -> dict[str, np.ndarray]:
        """This rank's locally updated state ``new`` with the weights replaced by the old weights plus the
        Adasum of every rank's delta. Under mixed precision (``got`` holds this rank's all-finite flag) the
        update is applied only when every rank's gradients were finite, else every rank keeps its weights
        and optimizer state (an empty dict), and the combined deltas reach the weights only when they are
        finite, as the legacy graph's ``adasum_all_deltas_finite`` gated them."""
        g, store, dp = self._graphs, self._store, self._dp
        if mixed_precision:
            every = every_rank_finite(dp.comm, got[ALL_FINITE], "Adasum all-finite check")
            got[ALL_FINITE] = flag_array(every)
            got[ALL_DELTAS_FINITE] = flag_array(False)
            if not got[ALL_FINITE]:
                return {}
        weights, apply = adasum_step(dp.comm, [store[w] for w in g.trainable], [new[w] for w in g.trainable],
                                     mixed_precision)
        if mixed_precision:
            got[ALL_DELTAS_FINITE] = flag_array(apply)
        new.update(zip(g.trainable, weights))
        return new

    def _zero_step(self, grads: list[np.ndarray], feeds: dict[str, Any], lr: np.ndarray,
                   loss_scale: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """ZeRO stage 1: reduce-scatter, norm over owned pieces summed across ranks, update, allgather.
        Under mixed precision every rank finds the same norm, so all skip or apply their pieces alike.
        ``feeds``: the step's, whose learning rate and loss scale every rank must have fed alike."""
        g, store, z, comm = self._graphs, self._store, self._zero, self._dp.comm
        got: dict[str, np.ndarray] = {}
        half = self._zgrad.dtype != self._zdtype
        z.flatten_into(dict(zip(g.trainable, grads)), self._zgrad, 1.0 if half else self._grad_scale)
        own = comm.reduce_scatter_(
            self._zgrad, self._zown, f"ZeRO gradient reduce-scatter ({self._zgrad.nbytes} bytes)"
        )
        if half:  # the float32 sum times the float32 factor, cast to the weights' type (as one process)
            own = (own * np.float32(self._grad_scale)).astype(self._zdtype)
        self._check_same_update_feeds(feeds)  # each owner updates its share with its own feeds
        own64 = own.astype(np.float64)
        total = comm.allreduce_scalar(float(np.dot(own64, own64)), "ZeRO gradient norm")
        norm = np.asarray(np.sqrt(total), self._norm_dtype)  # (not a half type: float16 overflows past 65504)
        wflat = np.zeros(z.padded, own.dtype)
        if z.pieces:
            up = self._get_plan("zero_update")
            feeds: dict[str, Any] = {self._params.lr_params_feed_name: lr}
            if self._norm_name:
                feeds[self._norm_name] = norm.astype(self._norm_dtype)
            scale = self.loss_scale_input_name
            if scale:
                feeds[scale] = loss_scale
            for pc in z.pieces:
                feeds[pc.name] = z.piece_view(pc, store[pc.weight])
                feeds[f"{pc.name}_grad"] = own[z.local_slice(pc)].reshape(pc.shape)
            for s in up.all_input_names:
                if s in store:
                    feeds[s] = store[s]
            items = list(self._zero_updates.items())
            out = up.run(feeds, [o for _, o in items] + self._zero_extras)
            new = dict(zip([s for s, _ in items], out))
            got.update(zip(self._zero_extras, out[len(items):]))
            for pc in z.pieces:
                wflat[pc.offset : pc.offset + pc.stop - pc.start] = new.pop(pc.name).reshape(-1)
            store.update(new)  # optimizer state of the owned pieces
        comm.allgather_(wflat, f"ZeRO weight allgather ({wflat.nbytes} bytes)")
        store.update(z.unflatten(wflat))
        if self._norm_name:
            got[self._norm_name] = norm.astype(self._norm_dtype)
        if self.loss_scale_input_name and not z.pieces:  # a rank that owns nothing still says it
            got[ALL_FINITE] = flag_array(np.isfinite(norm))
        return got

    # ---- the global norm and the finiteness flag on the fetches' path ----------------------------
    def _path_norm_sources(self, names: list[str]) -> list[str]:
        """Under data parallelism with allreduce or ZeRO, when ``names`` (the fetches of a run on the fetches'
        path alone) hold the global gradient norm or the finiteness flag: the gradients the step graph takes
        the norm of (the inputs of its ``ReduceSumSquare`` nodes), for :meth:`_path_checks_across_ranks`;
        else none."""
        dp = self._dp
        if dp is None or self._opt is None or dp.mode == "adasum":
            return []
        norm = self._path_norm_name()
        if norm is None or not (norm in names or ALL_FINITE in names):
            return []
        if not hasattr(self, "_norm_sources"):
            g = self._graphs.full.graph
            producer = {o: n for n in g.node for o in n.output}
            sources: list[str] = []
            stack, seen = [norm], set()
            while stack:
                t = stack.pop()
                n = producer.get(t)
                if n is None or t in seen:
                    continue
                seen.add(t)
                if n.op_type == "ReduceSumSquare":
                    sources.append(n.input[0])
                else:
                    stack.extend(n.input)
            self._norm_sources = sorted(set(sources))
        return self._norm_sources

    def _path_norm_name(self) -> str | None:
        """The step graph's global gradient norm output (None when it has none)."""
        return next((e for e in self._graphs.extra_outputs if e.startswith("global_gradient_norm")), None)

    def _path_checks_across_ranks(self, names: list[str], got: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The outputs ``names`` of a run on the fetches' path (``got``: their local values, and those of
        :meth:`_path_norm_sources`) with the global gradient norm and the finiteness flag of the ranks: with
        allreduce or ZeRO, of their averaged gradients (as the step computes them, after the exchange: the
        same on every rank, one process's on the whole batch); with Adasum, the norm stays the rank's (its
        step clips by its own) and the flag is whether every rank's gradients are finite (as its step
        decides). A collective: every rank fetches the same."""
        dp = self._dp
        norm_name = self._path_norm_name()
        out = dict(got)
        if dp.mode == "adasum":
            if ALL_FINITE in names:
                out[ALL_FINITE] = flag_array(every_rank_finite(dp.comm, bool(got[ALL_FINITE]),
                                                               "all_gradients_finite on the fetches' path"))
        elif norm_name is not None and (norm_name in names or ALL_FINITE in names):
            arrays = [np.asarray(got[s]).reshape(-1) for s in self._norm_sources]
            flat = np.concatenate(arrays).astype(np.float64) if arrays else np.zeros(0)
            dp.comm.allreduce_(flat, f"the global gradient norm on the fetches' path ({flat.nbytes} bytes)")
            flat *= 1.0 / dp.size
            norm = np.asarray(np.sqrt(np.dot(flat, flat)), self._norm_dtype)
            if norm_name in names:
                out[norm_name] = norm
            if ALL_FINITE in names:
                out[ALL_FINITE] = flag_array(np.isfinite(norm))
        return [out[n] for n in names]

    def _zero_full_names(self) -> dict[str, list[tuple[str, Any, bool]]]:
        """ZeRO: unpartitioned state name → [(this rank's state name, piece, elementwise)]."""
        out: dict[str, list[tuple[str, Any, bool]]] = {}
        for sp in self._specs:
            pc = self._zero.piece_of.get(sp.weight) if self._zero is not None else None
            if pc is not None:
                out.setdefault(f"{sp.key}_{pc.weight}", []).append(
                    (sp.name, pc, sp.elementwise)  # (a one-element piece has a counter's shape)
                )
        return out

    def gather_state(self) -> dict[str, np.ndarray]:
        """``get_state()`` with ZeRO-partitioned optimizer state reassembled under the unpartitioned names
        (``Moment_1_<w>``, ...), e.g. for rank 0 to write a complete checkpoint. Under ZeRO this is a
        collective: every rank must call it. Otherwise it equals ``get_state()``."""
        state = self.get_state()
        z = self._zero
        if z is None:
            return state
        return gather_zero_state(self._dp.comm, z, state, self._zero_full_names())


def with_value_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """A copy of ``model`` whose graph also outputs the values ``names`` (typed by shape inference)."""
    from onnxtrain.ir.builder import value_types

    types = value_types(model)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    for n in names:
        if n in have:
            continue
        out = m.graph.output.add()
        out.name = n
        tp = types.get(n)
        if tp is not None:
            out.type.CopyFrom(tp)
        else:
            out.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    return m


_FINGERPRINT_OPTIONS = (
    "loss_output_name",
    "training_optimizer_name",
    "lr_params_feed_name",
    "optimizer_attributes_map",
    "optimizer_int_attributes_map",
    "gradient_accumulation_steps",
    "enable_grad_norm_clip",
    "deepspeed_zero_stage",
    "enable_adasum",
    "use_mixed_precision",
    "use_fp16_moments",
    "use_memory_efficient_gradient",
    "mixed_precision_dtype",
    "legacy_cpu_adam",
    "gradient_accumulation_mode",
)


def fingerprint(model: onnx.ModelProto, g: StepGraphs, p: TrainingParameters) -> dict[str, Any]:
    """What every data-parallel rank must hold identically, field by field (cheap digests of the values)."""
    own_states = p.deepspeed_zero_stage or p.enable_adasum
    graph = onnx.GraphProto()
    graph.CopyFrom(model.graph)
    del graph.initializer[:]
    inits = {t.name: t for t in model.graph.initializer}
    trained = set(g.trainable)
    return {
        "graph (nodes, inputs, outputs)": digest(graph.SerializeToString(deterministic=True)),
        "trained weights (dtype, shape)": {
            w: (str(g.initial_state[w].dtype), list(g.initial_state[w].shape)) for w in g.trainable
        },
        "initial values of the trained weights": {w: array_digest(g.initial_state[w]) for w in g.trainable},
        "frozen initializers": {
            n: array_digest(numpy_helper.to_array(t)) for n, t in inits.items() if n not in trained
        },
        "training parameters": {k: canonical(getattr(p, k)) for k in _FINGERPRINT_OPTIONS},
        # one state for all ranks under plain allreduce; ZeRO's ranks may each be given their own part, and
        # Adasum's ranks keep optimizer states of their own
        "initial optimizer state (set_optimizer_initial_state)": {} if own_states else {
            w: {k: array_digest(v) for k, v in d.items()} for w, d in p.optimizer_initial_state().items()
        },
    }
