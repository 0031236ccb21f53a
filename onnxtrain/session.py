"""The legacy ``TrainingSession``: one ``run()`` = forward + backward + optimizer update.

Weights, optimizer state, accumulation buffers and BatchNormalization running statistics live in
the session's store (numpy arrays keyed by their legacy names); the step graphs take them as
inputs and return the new values, which are swapped into the store without copying.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxtrain.capi.options import RunOptions, SessionOptions
from onnxtrain.engine.backends import backend_of, make_plan
from onnxtrain.engine.backends import resolve_providers as backend_providers
from onnxtrain.engine.plan import Plan, load_model
from onnxtrain.graph_transforms import accumulation
from onnxtrain.graph_transforms.accumulation import GROUP_OUTPUT
from onnxtrain.graph_transforms.mixed_precision import half_copies
from onnxtrain.inference import FeedChecker, InferenceSession, NodeArg, node_arg, write_chrome_trace
from onnxtrain.ir.io import save_model_atomic
from onnxtrain.optim import WeightSlot, get_optimizer
from onnxtrain.parallel import BucketReducer
from onnxtrain.parallel import resolve as resolve_parallel
from onnxtrain.parallel.adasum import adasum_reduce
from onnxtrain.parallel.fingerprint import array_digest, check_same_on_all_ranks, digest
from onnxtrain.parallel.zero import ZeroLayout
from onnxtrain.parameters import TrainingParameters
from onnxtrain.training_graph import TRAINING_MODE, StepGraphs, build_step_graphs, build_update_graph


class TrainingSession(InferenceSession):
    """Train an ONNX model whose graph computes its loss, with onnxruntime's legacy API.

    Example::

        p = TrainingParameters()
        p.loss_output_name = "loss"
        p.training_optimizer_name = "SGDOptimizer"
        sess = TrainingSession(model_bytes, p)
        loss, = sess.run(["loss"], {"x": x, "y": y, "Learning_Rate": np.array([0.1], np.float32)})
    """

    def __init__(
        self,
        path_or_bytes: str | bytes | os.PathLike | onnx.ModelProto,
        parameters: TrainingParameters,
        sess_options: SessionOptions | None = None,
        providers: Sequence[Any] | None = None,
        provider_options: Sequence[dict] | None = None,
    ):
        if not isinstance(path_or_bytes, (str, bytes, bytearray, os.PathLike, onnx.ModelProto)):
            raise TypeError(
                f"path_or_bytes must be a path or the serialized model, got {type(path_or_bytes).__name__}"
            )
        if not isinstance(parameters, TrainingParameters):
            raise TypeError(f"parameters must be a TrainingParameters, got {type(parameters).__name__}")
        p = parameters
        pending = p.unsupported_options()
        if pending:
            raise NotImplementedError(
                f"TrainingParameters option(s) {', '.join(pending)} are not implemented yet"
            )
        self._dp = resolve_parallel(p)
        if p.gradient_accumulation_mode not in ("legacy", "auto"):
            raise ValueError(
                f"gradient_accumulation_mode must be 'legacy' or 'auto', got {p.gradient_accumulation_mode!r}"
            )
        self._params = p
        self._sess_options = sess_options or SessionOptions()
        self._backend = backend_of(self._sess_options)  # config entry onnxtrain.backend
        self._providers, self._provider_options = backend_providers(
            self._backend, providers, provider_options
        )
        self._start_ns = time.time_ns()
        self._fallback = True
        model = load_model(path_or_bytes)
        self._opt = get_optimizer(p.training_optimizer_name) if p.training_optimizer_name else None
        adasum = self._dp is not None and self._dp.mode == "adasum"
        g = build_step_graphs(model, p, self._opt, force_clip=adasum)
        self._graphs = g
        self._check_attribute_maps()
        mp = g.mixed_precision
        if mp is not None and self._dp is not None:
            raise NotImplementedError(
                "use_mixed_precision together with data parallelism (world_size > 1) is not implemented yet"
            )
        self.loss_scale_input_name = mp.loss_scale if mp is not None else None
        self._store: dict[str, np.ndarray] = dict(g.initial_state)
        self._specs = list(g.state_specs)
        self._zero: ZeroLayout | None = None
        self._extra_models: dict[str, onnx.ModelProto] = {}
        if self._dp is not None:
            check_same_on_all_ranks(self._dp.comm, _fingerprint(model, g, p), "model and training setup")
            if self._opt is not None:
                self._setup_data_parallel()
        self._apply_initial_optimizer_state(p.optimizer_initial_state())
        for path, m in (
            (p.model_after_graph_transforms_path, g.transformed),
            (p.model_with_gradient_graph_path, g.gradient),
            (p.model_with_training_graph_path, g.full),
        ):
            if path:
                save_model_atomic(m, path)
        self._model = g.full
        self._plans: dict[str, Plan] = {}
        self._plan = self._get_plan("full")
        self._plan.profiling = bool(self._sess_options.enable_profiling)
        self._state_inputs = [i.name for i in g.full.graph.input if i.name in self._store]
        lr = p.lr_params_feed_name
        feed_names = set(g.user_inputs) | ({lr} if self._opt else set())
        if self.loss_scale_input_name:
            feed_names.add(self.loss_scale_input_name)
        self._inputs = [node_arg(v) for v in g.full.graph.input if v.name in feed_names]
        self._overridable = [NodeArg(TRAINING_MODE, "tensor(bool)", [])] if g.has_training_mode else []
        self._outputs = [
            node_arg(v) for v in g.full.graph.output if v.name in set(g.user_outputs) | set(g.extra_outputs)
        ]
        self._output_names = [o.name for o in self._outputs]
        self._check = FeedChecker(self._plan, [TRAINING_MODE] if g.has_training_mode else [])
        self._check.required = [n for n in self._check.required if n in feed_names]
        self._check.allowed = feed_names | ({TRAINING_MODE} if g.has_training_mode else set())
        self._micro_step = 0

    # ---- construction helpers ---------------------------------------------------------
    def _check_attribute_maps(self) -> None:
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
            opt.check_attrs(w, fmap.get(w, {}), imap.get(w, {}))
        for label, m in (("optimizer_attributes_map", fmap), ("optimizer_int_attributes_map", imap)):
            for w in m:
                if w not in self._graphs.trainable:
                    raise ValueError(
                        f"{label}: {w!r} is not a trained weight; trained: {self._graphs.trainable}"
                    )

    def _apply_initial_optimizer_state(self, initial: dict[str, dict[str, np.ndarray]]) -> None:
        z = self._zero
        for w, d in initial.items():
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

    def _setup_data_parallel(self) -> None:
        """Buffers, layout and graphs for the gradient exchange (``self._dp.mode``)."""
        g, p, dp = self._graphs, self._params, self._dp
        steps = p.gradient_accumulation_steps
        gupd = g.updates["gradients"]
        self._grad_outputs = [
            gupd[accumulation.buffer_name(f"{w}_grad")] if steps > 1 else f"{w}_grad" for w in g.trainable
        ]
        self._grad_scale = 1.0 / (steps * dp.size)  # the legacy's 1/(N·D): gradients are averaged
        weights = [self._store[w] for w in g.trainable]
        if dp.mode == "allreduce":
            self._reducer = BucketReducer(dp.comm, [a.shape for a in weights], [a.dtype for a in weights])
        elif dp.mode == "zero1":
            dtypes = {a.dtype for a in weights}
            if len(dtypes) != 1:
                raise NotImplementedError(
                    f"deepspeed_zero_stage=1 needs trained weights of one dtype, got "
                    f"{sorted(map(str, dtypes))}"
                )
            dt = dtypes.pop()
            z = self._zero = ZeroLayout({w: self._store[w].shape for w in g.trainable}, dp.size, dp.rank)
            elem = helper.np_dtype_to_tensor_dtype(dt)
            slots = [
                WeightSlot(
                    pc.name,
                    f"{pc.name}_grad",
                    pc.shape,
                    elem,
                    dict(p.optimizer_attributes_map.get(pc.weight, {})),
                    dict(p.optimizer_int_attributes_map.get(pc.weight, {})),
                )
                for pc in z.pieces
            ]
            norm = next((e for e in g.extra_outputs if e.startswith("global_gradient_norm")), None)
            self._norm_name = norm
            model, upd, _, specs = build_update_graph(
                g.gradient, slots, p, self._opt, clip=norm is not None, norm_input=norm
            )
            self._extra_models["zero_update"] = model
            self._zero_updates = upd
            for sp in self._specs:  # the full state is replaced by the state of this rank's pieces
                del self._store[sp.name]
            self._specs = specs
            for sp in specs:
                self._store[sp.name] = sp.initial.copy()
            self._zgrad = np.zeros(z.padded, dt)
            self._zown = np.zeros(z.per_rank, dt)

    def _get_plan(self, kind: str) -> Plan:
        if kind not in self._plans:
            model = {
                "full": self._graphs.full,
                "accumulate": self._graphs.accumulate,
                "forward": self._graphs.forward,
                "gradients": self._graphs.gradients_graph,
                "update": self._graphs.update_graph,
                **self._extra_models,
            }[kind]
            self._plans[kind] = make_plan(
                model, self._backend, self._providers, self._sess_options, self._provider_options
            )
        return self._plans[kind]

    # ---- running ----------------------------------------------------------------------
    def run(
        self,
        output_names: Sequence[str] | None,
        input_feed: Mapping[str, Any],
        run_options: RunOptions | None = None,
    ) -> list[np.ndarray]:
        """Forward, backward and (when due) the optimizer update; returns the requested outputs."""
        ro = run_options or RunOptions()
        names = list(output_names) if output_names else list(self._output_names)
        for n in names:
            if n not in self._output_names:
                raise ValueError(f"unknown output {n!r}; the session's outputs are {self._output_names}")
        kind = self._kind(names, ro)
        feeds = self._check(input_feed, self._graphs.user_inputs if kind != "full" else None)
        if self._graphs.has_training_mode and TRAINING_MODE not in feeds:
            feeds[TRAINING_MODE] = np.asarray(bool(ro.training_mode))
        if kind == "full" and self._dp is not None and self._opt is not None:
            return self._run_data_parallel(names, feeds)
        plan = self._get_plan(kind)
        if output_names is None:  # "all outputs" of this kind of run (a micro-step has no norm yet)
            names = [n for n in names if n in plan.output_info]
        else:
            missing = [n for n in names if n not in plan.output_info]
            if missing:
                raise ValueError(
                    f"output(s) {missing} are not computed on a gradient-accumulation micro-step"
                )
        plan_inputs = plan.all_input_names
        feeds = {n: feeds[n] for n in plan_inputs if n in feeds}  # e.g. no learning rate when not updating
        for s in plan_inputs:
            if s in self._store:
                feeds[s] = self._store[s]
        upd_items = [] if kind == "forward" else list(self._graphs.updates[kind].items())
        results = plan.run(feeds, names + [o for _, o in upd_items])
        for (state, _), v in zip(upd_items, results[len(names) :]):
            self._store[state] = v
        if kind == "full" and self._graphs.buffers:
            for b in self._graphs.buffers:
                self._store[b] = np.zeros_like(self._store[b])
        self._micro_step = 0 if kind == "full" else self._micro_step + (kind == "accumulate")
        if self._sess_options.enable_profiling and plan is not self._plan:
            self._plan.profile.extend(plan.profile)
        return results[: len(names)]

    def _run_data_parallel(self, names: list[str], feeds: dict[str, Any]) -> list[np.ndarray]:
        """One optimizer step across ranks: local gradients → exchange (allreduce/Adasum/ZeRO) → update."""
        g, store, dp = self._graphs, self._store, self._dp
        gp = self._get_plan("gradients")
        bn_items = [(s, o) for s, o in g.updates["gradients"].items() if s in g.bn_stats]
        local_names = [n for n in names if n in gp.output_info]
        gfeeds = {n: feeds[n] for n in gp.all_input_names if n in feeds}
        for s in gp.all_input_names:
            if s in store:
                gfeeds[s] = store[s]
        res = gp.run(gfeeds, local_names + self._grad_outputs + [o for _, o in bn_items])
        got = dict(zip(local_names, res))
        grads = res[len(local_names) : len(local_names) + len(self._grad_outputs)]
        for (stat, _), v in zip(bn_items, res[len(local_names) + len(grads) :]):
            store[stat] = v
        lr = self._params.lr_params_feed_name
        if dp.mode == "zero1":
            got.update(self._zero_step(grads, feeds[lr]))
        else:
            up = self._get_plan("update")
            items = list(g.updates["update"].items())
            if dp.mode == "allreduce":
                eff = self._reducer.reduce(grads, self._grad_scale)
            else:  # adasum: the optimizer runs on the local (accumulation-averaged) gradients
                n = self._params.gradient_accumulation_steps
                eff = grads if n == 1 else [gr * gr.dtype.type(1.0 / n) for gr in grads]
            ufeeds = {lr: feeds[lr], **{f"{w}_grad": v for w, v in zip(g.trainable, eff)}}
            for s in up.all_input_names:
                if s in store:
                    ufeeds[s] = store[s]
            extra = [n for n in names if n not in got and n in up.output_info]
            out = up.run(ufeeds, extra + [o for _, o in items])
            got.update(zip(extra, out))
            new = dict(zip([s for s, _ in items], out[len(extra) :]))
            if dp.mode == "adasum":
                old = [store[w] for w in g.trainable]
                deltas = adasum_reduce(dp.comm, [new[w] - o for w, o in zip(g.trainable, old)])
                for w, o, d in zip(g.trainable, old, deltas):
                    new[w] = o + d
            store.update(new)
        for b in g.buffers:
            store[b] = np.zeros_like(store[b])
        self._micro_step = 0
        missing = [n for n in names if n not in got]
        if missing:
            raise ValueError(f"output(s) {missing} are not available in a data-parallel step")
        return [got[n] for n in names]

    def _zero_step(self, grads: list[np.ndarray], lr: np.ndarray) -> dict[str, np.ndarray]:
        """ZeRO stage 1: reduce-scatter, norm over owned pieces summed across ranks, update, allgather."""
        g, store, z, comm = self._graphs, self._store, self._zero, self._dp.comm
        z.flatten_into(dict(zip(g.trainable, grads)), self._zgrad, self._grad_scale)
        own = comm.reduce_scatter_(
            self._zgrad, self._zown, f"ZeRO gradient reduce-scatter ({self._zgrad.nbytes} bytes)"
        )
        own64 = own.astype(np.float64)
        norm = np.asarray(
            np.sqrt(comm.allreduce_scalar(float(np.dot(own64, own64)), "ZeRO gradient norm")), own.dtype
        )
        wflat = np.zeros(z.padded, own.dtype)
        if z.pieces:
            up = self._get_plan("zero_update")
            feeds: dict[str, Any] = {self._params.lr_params_feed_name: lr}
            if self._norm_name:
                feeds[self._norm_name] = norm.astype(np.float32)
            for pc in z.pieces:
                feeds[pc.name] = z.piece_view(pc, store[pc.weight])
                feeds[f"{pc.name}_grad"] = own[z.local_slice(pc)].reshape(pc.shape)
            for s in up.all_input_names:
                if s in store:
                    feeds[s] = store[s]
            items = list(self._zero_updates.items())
            new = dict(zip([s for s, _ in items], up.run(feeds, [o for _, o in items])))
            for pc in z.pieces:
                wflat[pc.offset : pc.offset + pc.stop - pc.start] = new.pop(pc.name).reshape(-1)
            store.update(new)  # optimizer state of the owned pieces
        comm.allgather_(wflat, f"ZeRO weight allgather ({wflat.nbytes} bytes)")
        store.update(z.unflatten(wflat))
        return {self._norm_name: norm.astype(np.float32)} if self._norm_name else {}

    def _kind(self, names: list[str], ro: RunOptions) -> str:
        g = self._graphs
        if ro.only_execute_path_to_fetches and all(n in g.user_outputs for n in names):
            return "forward"
        if g.accumulate is not None:
            if self._params.gradient_accumulation_mode == "auto":
                return (
                    "full"
                    if self._micro_step + 1 >= self._params.gradient_accumulation_steps
                    else "accumulate"
                )
            if ro.only_execute_path_to_fetches and GROUP_OUTPUT in names:
                return "accumulate"
        return "full"

    def end_profiling(self) -> str:
        if not self._sess_options.enable_profiling:
            return ""
        return write_chrome_trace(self._plan, self._sess_options.profile_file_prefix, self._start_ns)

    # ---- state ------------------------------------------------------------------------
    def _state_names(self) -> list[str]:
        g = self._graphs
        return sorted([*g.trainable, *(s.name for s in self._specs), *g.bn_stats])

    def get_state(self) -> dict[str, np.ndarray]:
        """Trained weights, optimizer state and BatchNormalization running statistics, by name (copies)."""
        return {n: self._store[n].copy() for n in self._state_names()}

    def _assign(self, name: str, value: Any) -> None:
        cur = self._store[name]
        arr = np.asarray(value)
        if arr.shape != cur.shape:
            raise ValueError(f"state {name!r}: expected shape {list(cur.shape)}, got {list(arr.shape)}")
        if arr.dtype != cur.dtype:
            raise TypeError(f"state {name!r}: expected dtype {cur.dtype}, got {arr.dtype}")
        self._store[name] = arr.copy()

    def _zero_full_names(self) -> dict[str, list[tuple[str, Any, bool]]]:
        """ZeRO: unpartitioned state name → [(this rank's state name, piece, elementwise)]."""
        out: dict[str, list[tuple[str, Any, bool]]] = {}
        for sp in self._specs:
            pc = self._zero.piece_of.get(sp.weight) if self._zero is not None else None
            if pc is not None:
                out.setdefault(f"{sp.key}_{pc.weight}", []).append(
                    (sp.name, pc, sp.initial.shape == pc.shape)
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
        mine = []
        for full, parts in self._zero_full_names().items():
            for name, pc, elementwise in parts:
                mine.append((full, pc.weight, pc.start, pc.stop, elementwise, state.pop(name)))
        gathered: dict[str, np.ndarray] = {}
        for part in self._dp.comm.allgather_object(mine, "gathering the ZeRO optimizer state"):
            for full, w, a, b, elementwise, v in part:
                if not elementwise:
                    gathered.setdefault(full, v)
                    continue
                buf = gathered.setdefault(full, np.zeros(z.shapes[w], v.dtype))
                buf.reshape(-1)[a:b] = v.reshape(-1)
        state.update(gathered)
        return dict(sorted(state.items()))

    def load_state(self, state: Mapping[str, Any], strict: bool = False) -> None:
        """Copy ``state`` (as from ``get_state()``) into the session; shapes and dtypes must match.

        Under ZeRO stage 1, unpartitioned optimizer state (as from ``gather_state()``) is sliced to this
        rank's pieces, and absent names are tolerated.
        """
        known = set(self._state_names())
        zero_names = self._zero_full_names() if self._zero is not None else {}
        for name, value in state.items():
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
        if strict and self._zero is None:
            missing = sorted(known - set(state))
            if missing:
                raise KeyError(f"load_state(strict=True): missing state tensor(s) {missing}")

    def _all_optimizer_state_names(self) -> set[str]:
        """Names the optimizer state of every trained weight has, whichever rank holds it."""
        if self._opt is None:
            return set()
        slots = [WeightSlot(w, "", (), 1) for w in self._graphs.trainable]
        return {sp.name for sp in self._opt.state(slots)}

    def get_model_state(
        self, include_mixed_precision_weights: bool = False
    ) -> dict[str, dict[str, np.ndarray]]:
        out = {"full_precision": {w: self._store[w].copy() for w in self._graphs.trainable}}
        if include_mixed_precision_weights:
            mp = self._graphs.mixed_precision
            out["mixed_precision"] = {} if mp is None else half_copies(out["full_precision"], mp.dtype)
        return out

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
        raise ValueError(f"{output_name!r} is not produced by any node of the training graph")


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
    "legacy_cpu_adam",
    "gradient_accumulation_mode",
)


def _fingerprint(model: onnx.ModelProto, g: StepGraphs, p: TrainingParameters) -> dict[str, Any]:
    """What every data-parallel rank must hold identically, field by field (cheap digests of the values)."""
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
        "training parameters": {k: repr(getattr(p, k)) for k in _FINGERPRINT_OPTIONS},
    }
