"""A legacy session's optimizer step over flat buffers.

The legacy update graph gives each trained weight its own nodes (and its own step count), so a model with
many small weights (biases, norms) pays a dozen kernel calls per weight per step. Adam and SGD compute every
element with the same operations on the same scalars, so the weights of one dtype and one set of optimizer
attributes, laid end to end, update as one "weight" with the same bits, provided their step counts agree
(they do, unless a loaded state gave them different ones: that step runs the per-weight graph instead).

:class:`FlatLegacyUpdate` holds that graph's plan and the buffers: the weights and moments of a merged group
live in one array each, the session's state holding views of it, so the gradients graph reads them in place
and the update writes them in place; the group's gradients are gathered into one buffer (or written there
directly by the onnxruntime backend). Weights of :data:`SINGLE_MIN` values or more keep their own arrays and
nodes. A clipped update computes the global norm from the weights' own gradients (views of the group's
buffer), with the per-weight graph's nodes: the same bits. Under gradient accumulation the step that
updates reads the averaged sums, gathered. One process only, without mixed precision (whose finite check and
skipped steps the per-weight graph handles); session config entry ``onnxtrain.flat_update = "0"`` turns it
off (as for the on-device ``Optimizer``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import helper

from onnxtrain.flat_settings import SINGLE_MIN, flat_update_enabled
from onnxtrain.graph_transforms.clipping import global_norm
from onnxtrain.ir.builder import NameGen, NodeWriter
from onnxtrain.ir.types import onnx_elem_type
from onnxtrain.optim.base import WeightSlot, fattr, iattr
from onnxtrain.training_graph import build_update_graph

if TYPE_CHECKING:
    from onnxtrain.engine.interface import GraphInterface
    from onnxtrain.session import TrainingSession

FLAT_OPTIMIZERS = ("AdamOptimizer", "SGDOptimizer")  # per-element updates (Lamb's norms are per weight)


@dataclass
class _Group:
    """Weights of one dtype and attribute set: ``merged`` ones are one flat "weight" of the flat graph,
    named ``name``; otherwise ``name`` is the one weight itself."""

    name: str
    weights: list[str]
    shapes: list[tuple[int, ...]]
    dtype: np.dtype
    merged: bool
    # state key (Moment_1, Update_Count, ...) → the members' state names, in member order
    state: dict[str, list[str]] = field(default_factory=dict)
    flat_state: dict[str, str] = field(default_factory=dict)  # state key → the flat graph's input
    flat: np.ndarray | None = None  # a merged group's weights, gradients and elementwise state
    grad: np.ndarray | None = None
    buffers: dict[str, np.ndarray] = field(default_factory=dict)  # state key → array
    views: dict[str, np.ndarray] = field(default_factory=dict)  # state name or weight → its view

    @property
    def size(self) -> int:
        return sum(int(np.prod(s)) for s in self.shapes)


class FlatLegacyUpdate:
    """The flat update graph's plan and the merged groups' buffers; :meth:`step` runs one update."""

    def __init__(self, model: onnx.ModelProto, plan: GraphInterface, groups: list[_Group],
                 outputs: dict[str, str], elementwise: set[str], counts: set[str], lr: str) -> None:
        self.model = model  # the flat update graph
        self.plan = plan
        self.groups = groups
        self.outputs = outputs  # flat graph input (weight or state) → its new value's output
        self.elementwise = elementwise  # state keys holding a value per element (the moments)
        self.counts = counts  # state keys of one value per weight (Update_Count)
        self.lr = lr
        graph_inputs = {v.name for v in model.graph.input}
        # a clipped update's norm reads every weight's gradient: the merged ones are fed as views too
        self.per_weight_grads = any(f"{w}_grad" in graph_inputs for grp in groups if grp.merged
                                    for w in grp.weights)
        # the onnxruntime backend's new step counts go into arrays kept here (a Split makes them: they cannot
        # be written into the inputs), so that every output of a run has its array (see :meth:`step`)
        self.count_arrays: dict[str, np.ndarray] | None = None

    @classmethod
    def build(cls, session: TrainingSession, min_merged: int = 2) -> FlatLegacyUpdate | None:
        """The flat update of the session's step, or None when the step does not qualify (module
        docstring) or no group would merge ``min_merged`` weights (the graphs are then not built)."""
        p, opt, g = session._params, session._opt, session._graphs
        if (opt is None or opt.name not in FLAT_OPTIMIZERS or session._dp is not None
                or g.mixed_precision is not None or not flat_update_enabled(session._sess_options)):
            return None
        clip = session._clips
        store = session._store
        types = {w: onnx_elem_type(store[w].dtype) for w in g.trainable}
        floats = [k for k in sorted(opt.FLOAT_ATTRS) if clip or k != "max_norm_clip"]  # a group shares these
        by_key: dict[tuple, _Group] = {}
        groups: list[_Group] = []
        for w in g.trainable:
            arr = store[w]
            slot = _slot(p, w, f"{w}_grad", arr.shape, types[w])
            key = (arr.dtype, slot.elem_type, tuple(fattr(slot, opt, k) for k in floats),
                   tuple(iattr(slot, opt, k) for k in sorted(opt.INT_ATTRS)))
            grp = None if arr.size >= SINGLE_MIN else by_key.get(key)
            if grp is None:
                grp = _Group(w, [], [], arr.dtype, False)
                groups.append(grp)
                if arr.size < SINGLE_MIN:
                    by_key[key] = grp
            grp.weights.append(w)
            grp.shapes.append(tuple(arr.shape))
        if max((len(grp.weights) for grp in groups), default=0) < max(min_merged, 2):
            return None
        full = g.full.graph
        names = NameGen({v.name for v in full.input} | {o for n in full.node for o in n.output})
        specs = {(sp.weight, sp.key): sp for sp in session._specs}
        slots = []
        for i, grp in enumerate(groups):
            grp.merged = len(grp.weights) > 1
            if grp.merged:
                grp.name = names(f"onnxtrain_flat_{grp.dtype.name}_{i}")
            first = grp.weights[0]
            shape = (grp.size,) if grp.merged else grp.shapes[0]
            slots.append(_slot(p, first, f"{grp.name}_grad", shape, types[first]))
            slots[-1].name = grp.name
        norm = names("onnxtrain_flat_global_norm") if clip else None
        model, upd, extras, flat_specs = build_update_graph(g.update_graph, slots, p, opt, clip=clip,
                                                            norm_input=norm)
        if extras:
            return None  # (the norm is an input: nothing else to output)
        if norm is not None:
            _with_norm(model, norm, [(w, types[w], store[w].shape) for w in g.trainable])
        elementwise, counts = set(), set()
        for sp in flat_specs:
            grp = next(x for x in groups if x.name == sp.weight)
            members = [specs.get((w, sp.key)) for w in grp.weights]
            if any(m is None for m in members):
                return None
            grp.state[sp.key] = [m.name for m in members]
            grp.flat_state[sp.key] = sp.name
            (elementwise if sp.elementwise else counts).add(sp.key)
            if sp.elementwise and grp.merged:
                grp.buffers[sp.key] = np.empty(grp.size, sp.initial.dtype)
        lr = p.lr_params_feed_name
        scalars = {lr} | {grp.flat_state[k] for grp in groups for k in counts}
        plan = session._new_plan(model, {o: x for x, o in upd.items()}, keep_binding=True, follower=True,
                                 scalar_inputs=scalars)
        flat = cls(model, plan, groups, upd, elementwise, counts, lr)
        if session._backend != "numpy":
            flat.count_arrays = {upd[grp.flat_state[k]]: np.empty_like(store[grp.state[k][0]])
                                 for grp in groups for k in counts}
        for grp in groups:  # the state moves into the buffers now, before any plan binds its arrays (the
            # store is the step graphs' initial_state itself: no other dict keeps the old arrays alive)
            if grp.merged:
                flat._gather(grp, store)
        return flat

    def grad_targets(self) -> dict[str, np.ndarray]:
        """Gradient name → the view of its merged group's gradient buffer: the arrays the gradients graph
        may write them into (the onnxruntime backend's ``reuse``)."""
        out = {}
        for grp in self.groups:
            if grp.merged:
                self._allocate(grp)
                out.update((f"{w}_grad", grp.views[f"{w}_grad"]) for w in grp.weights)
        return out

    def applies(self, store: dict[str, np.ndarray]) -> bool:
        """Whether the merged groups' members have equal step counts in ``store``."""
        for grp in self.groups:
            if grp.merged:
                for key in self.counts:
                    first, *rest = (store[n] for n in grp.state[key])
                    if not all(_same_count(first, x) for x in rest):
                        return False
        return True

    def step(self, store: dict[str, np.ndarray], grads: dict[str, np.ndarray], lr: Any) -> None:
        """One update of every weight in ``store`` with gradients ``grads`` (name → array) and learning rate
        feed ``lr``; the caller has checked :meth:`applies`. The merged groups' entries leave ``grads`` once
        gathered (the update then reads the group's buffer)."""
        feeds: dict[str, Any] = {self.lr: lr}
        donate: list[str] = []
        for grp in self.groups:
            if grp.merged:
                self._gather(grp, store)
                parts = [grads.pop(f"{w}_grad") for w in grp.weights]
                if any(a is not grp.views[f"{w}_grad"] for a, w in zip(parts, grp.weights)):
                    np.concatenate(parts, axis=None, out=grp.grad)
                del parts  # (a caller holding no other reference frees them before the update runs)
                if self.per_weight_grads:  # (the norm's: read as the per-weight graph reads them)
                    feeds.update((f"{w}_grad", grp.views[f"{w}_grad"]) for w in grp.weights)
                feeds[grp.name] = grp.flat
                feeds[f"{grp.name}_grad"] = grp.grad
                for key, names in grp.state.items():
                    kept = grp.buffers[key] if key in self.elementwise else store[names[0]]
                    feeds[grp.flat_state[key]] = kept
            else:
                w = grp.name
                feeds[w] = store[w]
                feeds[f"{w}_grad"] = grads[f"{w}_grad"]
                for key, names in grp.state.items():
                    feeds[grp.flat_state[key]] = store[names[0]]
            donate += [grp.name, *(grp.flat_state[k] for k in self.elementwise)]
        names = list(self.outputs)
        kw = {"reuse": self.count_arrays} if self.count_arrays is not None else {}
        results = dict(zip(names, self.plan.run(feeds, [self.outputs[n] for n in names], donate=donate,
                                                 **kw)))
        for grp in self.groups:
            if not grp.merged:
                store[grp.name] = results[grp.name]
                for key, states in grp.state.items():
                    if key in self.elementwise:
                        store[states[0]] = results[grp.flat_state[key]]
                    else:
                        _count_into(store, states, results[grp.flat_state[key]])
                continue
            _into(grp.flat, results[grp.name])
            for key, states in grp.state.items():
                new = results[grp.flat_state[key]]
                if key in self.elementwise:
                    _into(grp.buffers[key], new)
                else:  # a step count: each member its own array
                    _count_into(store, states, new)

    def _allocate(self, grp: _Group) -> None:
        if grp.flat is not None:
            return
        grp.flat = np.empty(grp.size, grp.dtype)
        grp.grad = np.empty(grp.size, grp.dtype)
        at = 0
        for i, (w, shape) in enumerate(zip(grp.weights, grp.shapes)):
            n = int(np.prod(shape))
            grp.views[w] = grp.flat[at:at + n].reshape(shape)
            grp.views[f"{w}_grad"] = grp.grad[at:at + n].reshape(shape)
            for key in self.elementwise:
                grp.views[grp.state[key][i]] = grp.buffers[key][at:at + n].reshape(shape)
            at += n

    def _gather(self, grp: _Group, store: dict[str, np.ndarray]) -> None:
        """Make the store's weights and moments of ``grp`` the views of its buffers where they are not (when
        built, after a load): their values copied in."""
        self._allocate(grp)
        names = grp.weights + [s for key in self.elementwise for s in grp.state[key]]
        for n in names:
            view, old = grp.views[n], store[n]
            if old is not view:
                np.copyto(view, old)
                store[n] = view


def _same_count(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two step counts are equal (integer arrays: their bytes, cheaper than ``np.array_equal``)."""
    if a.dtype.kind not in "iu" or b.dtype != a.dtype:
        return bool(np.array_equal(a, b))
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def _count_into(store: dict[str, np.ndarray], states: list[str], new: np.ndarray) -> None:
    """The new step count ``new`` made each member's of ``states``: written into a member's array when the
    session owns it whole (the array the next step feeds again: onnxruntime keeps it bound), else a copy."""
    for s in states:
        cur = store[s]
        if cur is new:
            continue
        if (type(cur) is np.ndarray and cur.base is None and cur.flags.writeable and cur.shape == new.shape
                and cur.dtype == new.dtype):
            np.copyto(cur, new)
        else:
            store[s] = new.copy()


def _into(target: np.ndarray, value: np.ndarray) -> None:
    """``value`` written into ``target`` unless the plan wrote it there already."""
    if value is not target:
        np.copyto(target, value.reshape(target.shape))


def _slot(p: Any, w: str, grad: str, shape: tuple[int, ...], elem_type: int) -> WeightSlot:
    """Weight ``w``'s update slot with its optimizer attribute maps' entries."""
    return WeightSlot(w, grad, tuple(shape), elem_type, dict(p.optimizer_attributes_map.get(w, {})),
                      dict(p.optimizer_int_attributes_map.get(w, {})))


def _with_norm(model: onnx.ModelProto, norm: str, grads: list[tuple[str, int, tuple[int, ...]]]) -> None:
    """Make ``model``'s input ``norm`` (in place) computed as the per-weight update graph computes the global
    gradient norm: over the gradients ``<w>_grad`` of ``grads`` (weight, type, shape), one by one in that
    order (the same nodes, so the same bits), each an input of the model."""
    g = model.graph
    have = {v.name for v in g.input}
    inputs = [v for v in g.input if v.name != norm]
    if any(norm in n.input for n in g.node):  # (else an update that does not clip: SGD's)
        nodes = _norm_nodes(model, norm, grads)
        inputs += [helper.make_tensor_value_info(f"{wt}_grad", et, list(shape)) for wt, et, shape in grads
                   if f"{wt}_grad" not in have]
        rest = list(g.node)
        g.ClearField("node")
        g.node.extend([*nodes, *rest])
    g.ClearField("input")
    g.input.extend(inputs)


def _norm_nodes(model: onnx.ModelProto, norm: str,
                grads: list[tuple[str, int, tuple[int, ...]]]) -> list[onnx.NodeProto]:
    """The nodes computing the global norm named ``norm`` over the gradients of ``grads``."""
    nodes: list[onnx.NodeProto] = []
    names = NameGen.for_model(model)
    names.taken.discard(norm)
    names.taken.update(f"{wt}_grad" for wt, _, _ in grads)
    w = NodeWriter(names, nodes, prefix="")
    made = global_norm(w, [f"{wt}_grad" for wt, _, _ in grads], out_name=norm,
                       grad_types=[et for _, et, _ in grads])
    if made != norm:
        raise AssertionError(f"flat update: the norm was named {made!r}, not {norm!r}")
    return nodes
