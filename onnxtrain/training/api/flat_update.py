"""The Optimizer's update over flat buffers, for optimizer models that onnxtrain generated.

onnxtrain's AdamW and SGD blocks give every parameter the same elementwise program over the same scalars, so
the model they generate for one "parameter" that holds all trainable parameters of a dtype end to end computes
each element with the same operations in the same order as the per-parameter model: the same bits, in one
run of a dozen array passes instead of a dozen passes per parameter. An Optimizer whose model is exactly what
its recorded block and hyperparameters generate (``onnxtrain.optimizer``, ``onnxtrain.hyperparameters``),
without gradient clipping or loss scaling (their global norm would sum in another order), runs that flat
model instead. Weights and moments then live in one buffer per dtype: ``Parameter.data`` becomes a view of
it, except an array that something besides the state holds, which keeps its identity and has its values
copied in before each step and out after it (an array taken earlier sees the updates). Gradients are
gathered into one buffer per dtype each step (one pass over them), except when the Module's training runs on
the onnxruntime backend (``grads_in_place``): there ``Parameter.grad`` becomes a view of that buffer too,
which onnxruntime writes each step's gradients into (the Module binds them as its outputs), so the update
reads them where they were computed. A ``.grad`` array that something else holds keeps its identity and has
its values copied in before each step.

Session config entry ``onnxtrain.flat_update = "0"`` runs the optimizer model as it is.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

from onnxtrain.engine.interface import GraphInterface
from onnxtrain.flat_settings import SINGLE_MIN
from onnxtrain.ir.builder import model_opset
from onnxtrain.training.api.checkpoint_state import _Param, data_unheld, grad_unheld
from onnxtrain.training.onnxblock.model_accessor import BlockError

_META_ALGORITHM, _META_HYPER = "onnxtrain.optimizer", "onnxtrain.hyperparameters"


def _block_of(model: onnx.ModelProto) -> Any:
    """The onnxblock optimizer the model's metadata names, with its recorded hyperparameters; None when the
    metadata names none of onnxtrain's per-element blocks, or records clipping."""
    from onnxtrain.training.onnxblock import optim  # here: the blocks import the artifacts package

    meta = {p.key: p.value for p in model.metadata_props}
    try:
        hp = json.loads(meta.get(_META_HYPER, ""))
    except ValueError:
        return None
    if not isinstance(hp, dict) or hp.get("clip_grad_max_norm") is not None:
        return None
    label = meta.get(_META_ALGORITHM)
    try:
        if label == "AdamW" and set(hp) == {"bias_correction", "betas", "eps", "weight_decay",
                                            "clip_grad_max_norm"}:
            return optim.AdamW(bias_correction=hp["bias_correction"], betas=tuple(hp["betas"]),
                               eps=hp["eps"], weight_decay=hp["weight_decay"])
        if label == "SGD" and set(hp) == {"clip_grad_max_norm"}:
            return optim.SGD()
    except (TypeError, ValueError):
        return None
    return None


@dataclass
class _Group:
    """Trainable parameters of one dtype, laid end to end in one "parameter" of the flat model; a ``single``
    one (a large parameter) is that parameter as it is, fed its own arrays (no gathering)."""

    name: str  # the flat model's parameter
    dtype: np.dtype
    params: list[str]
    shapes: list[tuple[int, ...]]
    size: int
    single: bool = False
    flat: np.ndarray | None = None  # the weights (None until the first step)
    grad: np.ndarray | None = None
    moments: dict[str, np.ndarray] = field(default_factory=dict)
    views: list[tuple[str, np.ndarray]] = field(default_factory=list)  # parameter → its view of ``flat``
    moment_views: list[tuple[str, str, np.ndarray]] = field(default_factory=list)  # (parameter, key, view)
    grad_views: list[tuple[str, np.ndarray]] = field(default_factory=list)  # parameter → its view of ``grad``
    held: set[str] = field(default_factory=set)  # parameters whose own arrays are copied in and out
    grads_held: set[str] = field(default_factory=set)  # parameters whose own .grad arrays are copied in

    def allocate(self, keys: Sequence[str]) -> None:
        self.flat = np.empty(self.size, self.dtype)
        self.grad = np.empty(self.size, self.dtype)
        self.moments = {k: np.empty(self.size, self.dtype) for k in keys}
        at = 0
        for p, shape in zip(self.params, self.shapes):
            n = int(np.prod(shape))
            self.views.append((p, self.flat[at:at + n].reshape(shape)))
            self.grad_views.append((p, self.grad[at:at + n].reshape(shape)))
            self.moment_views += [(p, k, m[at:at + n].reshape(shape)) for k, m in self.moments.items()]
            at += n


class FlatUpdate:
    """The flat model's plan and buffers; :meth:`step` is one optimizer step over the state's arrays."""

    def __init__(self, plan: GraphInterface, groups: list[_Group], keys: list[str], updated: list[str],
                 release_bindings: Callable[[], None], grads_in_place: bool = False) -> None:
        self.plan = plan
        self.grads_in_place = grads_in_place  # .grad a view of the flat gradients (see the module's doc)
        self.groups = groups
        self.keys = keys  # the moments the model reads
        self.updated = updated  # ... and those it returns new values of
        self._release_bindings = release_bindings
        self.outputs = [f"{g.name}{suffix}.out" for g in groups
                        for suffix in ["", *(f".{k}" for k in updated)]]
        # each group's feed names: its gradient's, its moments' (in ``keys`` order) and the donated ones
        self._names = [(f"{g.name}_grad", [f"{g.name}.{k}" for k in keys],
                        [g.name, *(f"{g.name}.{k}" for k in updated)]) for g in groups]
        self._kept_updated = [k in updated for k in keys]

    @classmethod
    def build(cls, model: onnx.ModelProto, params: list[tuple[str, onnx.TypeProto]], keys: list[str],
              compile_model: Callable[[onnx.ModelProto, dict[str, str]], GraphInterface],
              release_bindings: Callable[[], None], grads_in_place: bool = False) -> FlatUpdate | None:
        """The flat update of the optimizer ``model`` over ``params`` (parameter, input type, in the model's
        input order) with moments ``keys``, when the model is exactly what its recorded block generates for
        them; else None. ``compile_model(model, updates)`` compiles the flat model (``updates``: output →
        the input it replaces); ``grads_in_place``: the gradients are made views of the flat buffer."""
        from onnxtrain.training.optimizer_model import build_optimizer_model

        block = _block_of(model)
        opset = model_opset(model)  # (0: none imported)
        if block is None or not opset or sorted(block.state_names) != sorted(keys):
            return None
        try:
            same = build_optimizer_model(block, params, opset)
        except (BlockError, TypeError, ValueError):  # not a model this block makes (a type it refuses)
            return None
        if (same.graph.SerializeToString(deterministic=True)
                != model.graph.SerializeToString(deterministic=True)):
            return None
        ordered: list[_Group] = []
        merged: dict[np.dtype, _Group] = {}  # dtype → the group of its smaller parameters
        for p, tp in params:
            tt = tp.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim]
            if any(d < 0 for d in dims):
                return None
            dt = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
            n = int(np.prod(dims))
            if n >= SINGLE_MIN:
                g = _Group(f"flat_{dt.name}_{len(ordered)}", dt, [], [], 0, single=True)
                ordered.append(g)
            else:
                g = merged.get(dt)
                if g is None:
                    g = merged[dt] = _Group(f"flat_{dt.name}", dt, [], [], 0)
                    ordered.append(g)
            g.params.append(p)
            g.shapes.append(tuple(dims))
            g.size += n
        if len(ordered) == len(params):
            return None  # nothing to merge: the model as it is
        for g in ordered:
            g.single = g.single or len(g.params) == 1
        types = [(g.name, helper.make_tensor_type_proto(helper.np_dtype_to_tensor_dtype(g.dtype),
                                                        list(g.shapes[0]) if g.single else [g.size]))
                 for g in ordered]
        flat = build_optimizer_model(block, types, opset)
        have = {o.name for o in flat.graph.output}
        state_keys = list(block.state_names)
        updated = [k for k in state_keys if f"{ordered[0].name}.{k}.out" in have]  # SGD's moment: none
        updates = {f"{x}.out": x for g in ordered for x in [g.name, *(f"{g.name}.{k}" for k in updated)]}
        if not set(updates) <= have:
            return None
        return cls(compile_model(flat, updates), ordered, state_keys, updated, release_bindings,
                   grads_in_place)

    def step(self, lr: np.ndarray, count: np.ndarray, params: dict[str, _Param],
             moments: dict[str, dict[str, np.ndarray]],
             reduce: Callable[[list[np.ndarray]], Any] | None = None) -> None:
        """One update of every parameter of the groups (each with a value and moments allocated) with the
        learning rate ``lr`` and step ``count`` feeds; ``reduce`` (data parallel) returns the average over
        the ranks of the flat gradients it is given (new arrays: a single group's are the state's)."""
        feeds: dict[str, Any] = {"learning_rate": lr, "step": count}
        donate = []
        targets: list[np.ndarray] = []  # the arrays the outputs are the new values of, in order
        grads: list[np.ndarray] = []
        for g, (grad_name, moment_names, donated) in zip(self.groups, self._names):
            if g.single:  # the state's own arrays (a donated weight must own its memory)
                prm = params[g.params[0]]
                flat = prm.data
                grad = prm.grad if prm.grad is not None else np.zeros_like(prm.data)
                slot = moments[g.params[0]]
                kept = [slot[k] for k in self.keys]
            else:
                self._gather(g, params, moments)
                if self.grads_in_place:
                    grad = g.grad
                else:
                    parts = [params[p].grad for p in g.params]
                    if any(x is None for x in parts):
                        parts = [x if x is not None else np.zeros(s, g.dtype)
                                 for x, s in zip(parts, g.shapes)]
                    grad = np.concatenate(parts, axis=None, out=g.grad)
                flat = g.flat
                kept = [g.moments[k] for k in self.keys]
            feeds[g.name] = flat
            feeds[grad_name] = grad
            feeds.update(zip(moment_names, kept))
            donate += donated
            targets.append(flat)
            targets += [m for m, up in zip(kept, self._kept_updated) if up]
            grads.append(grad)
        if reduce is not None:
            feeds.update(zip((names[0] for names in self._names), reduce(grads)))
        results = self.plan.run(feeds, self.outputs, donate=donate)
        feeds.clear()
        for target, value in zip(targets, results):
            if value is not target:  # not written in place: the arrays keep their identity
                np.copyto(target, value)
        for g in self.groups:
            if g.held:
                for p, view in g.views:
                    if p in g.held:
                        np.copyto(params[p].data, view)

    def _gather(self, g: _Group, params: dict[str, _Param],
                moments: dict[str, dict[str, np.ndarray]]) -> None:
        """Make the group's views the state's arrays where they are not (the first step, a load since):
        values copied in, a parameter's array replaced by its view unless something else holds it; with
        ``grads_in_place`` the same for the gradients (a held one is copied in at each step)."""
        if g.flat is None:
            g.allocate(self.keys)
        released = False
        for p, view in g.views:
            prm = params[p]
            if prm.data is view:
                continue
            if p not in g.held and not released:  # the training plans' kept bindings: not a caller's hold
                self._release_bindings()
                released = True
            np.copyto(view, prm.data)
            if data_unheld(prm):
                prm.data = view
                g.held.discard(p)
            else:
                g.held.add(p)
        for p, k, view in g.moment_views:
            slot = moments[p]
            if slot[k] is not view:
                np.copyto(view, slot[k])
                slot[k] = view
        if not self.grads_in_place:
            return
        for p, view in g.grad_views:
            prm = params[p]
            if prm.grad is view:
                continue
            if prm.grad is None:
                view[...] = 0
                prm.grad = prm.grad_home = view
                continue
            if p not in g.grads_held and not released:
                self._release_bindings()
                released = True
            np.copyto(view, prm.grad)
            if grad_unheld(prm):
                prm.grad = prm.grad_home = view
                g.grads_held.discard(p)
            else:
                g.grads_held.add(p)
