"""The legacy session's graphs: forward model → gradient graph → step graph (accumulate, clip, update).

Trained weights, optimizer state, accumulation buffers and BatchNormalization running statistics
become graph inputs; their new values are graph outputs. The session keeps them in its store.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.autodiff.builder import GradientError, blocked_by, fake_quant_inputs, upgrade_opset
from onnxtrain.autodiff.exporter_checks import export_hint, warn_folded_constants
from onnxtrain.autodiff.registry import find_rule, has_no_gradient
from onnxtrain.autodiff.stable_rewrites import stable_log_sigmoids
from onnxtrain.engine.feed_sizes import same_size_dims
from onnxtrain.engine.interface import holds_values, without_values
from onnxtrain.graph_transforms import accumulation
from onnxtrain.graph_transforms.clipping import clip_divisor, global_norm, norm_type
from onnxtrain.graph_transforms.flags import FLAG_SHAPE
from onnxtrain.graph_transforms.mixed_precision import (
    ALL_FINITE,
    MixedPrecisionInfo,
    mixed_precision,
    mixed_precision_info,
    mixed_precision_update,
)
from onnxtrain.graph_transforms.recompute import recompute_or_warn
from onnxtrain.ir.builder import FLOAT_TYPES, NameGen, NodeWriter, model_opset, value_types
from onnxtrain.ir.graphs import (
    DEFAULT_DOMAINS,
    body_reads,
    chain_shared_batch_norms,
    constant_arrays,
    is_training_batch_norm,
    last_statistics,
    node_reads,
    rename_in_graph,
    train_batch_norms,
    untie_batch_norm_statistics,
    walk_graphs,
)
from onnxtrain.ir.types import np_dtype, shown_dims
from onnxtrain.optim import Optimizer, StateSpec, WeightSlot
from onnxtrain.optim.base import compute_type
from onnxtrain.parameters import TrainingParameters
from onnxtrain.user_warning import warn
from onnxtrain.version import PRODUCER

BFLOAT16 = np_dtype(TensorProto.BFLOAT16)

TRAINING_MODE = "training_mode"


@dataclass
class StepGraphs:
    """What the session runs, and how its state maps onto graph inputs and outputs."""

    forward: onnx.ModelProto  # user inputs + state → user outputs (evaluation)
    full: onnx.ModelProto  # forward + backward + accumulate + update
    accumulate: onnx.ModelProto | None  # forward + backward + accumulate only (N > 1)
    gradient: onnx.ModelProto  # the gradient graph alone (for the dump)
    transformed: onnx.ModelProto  # the forward model after our rewrites (for the dump)
    trainable: list[str]
    # every state tensor: weights, buffers, optimizer state, BN stats. The session's store is this dict
    # itself (a copy beside it would keep each array a step replaces alive): once the session trains, it holds
    # the trained values, not the initial ones
    initial_state: dict[str, np.ndarray]
    # the optimizer's state tensors; each spec's initial array is initial_state's own (the session trains it
    # in place): read only their shapes and dtypes
    state_specs: list[StateSpec] = field(default_factory=list)
    # plan name → {state name: output}; "gradients" and "update" appear with the halves (see split)
    updates: dict[str, dict[str, str]] = field(default_factory=dict)
    buffers: list[str] = field(default_factory=list)
    bn_stats: dict[str, str] = field(default_factory=dict)  # running-stat initializer → forward output
    user_inputs: list[str] = field(default_factory=list)
    user_outputs: list[str] = field(default_factory=list)
    extra_outputs: list[str] = field(default_factory=list)  # global_gradient_norm, <x>_grad, ...
    has_training_mode: bool = False
    # dims the gradient takes for one size: name → the (input, axis) pairs a run must feed one size of it
    same_size_dims: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    training_mode_default: bool = True  # Dropout's mode when a run feeds none (:func:`dropout_mode`)
    mixed_precision: MixedPrecisionInfo | None = None  # the pass's record when use_mixed_precision
    # builds the step's two halves (see split); the halves, once built
    make_halves: Callable[[], tuple] | None = field(default=None, repr=False)
    _halves: tuple | None = field(default=None, repr=False)

    def split(self) -> tuple[onnx.ModelProto, onnx.ModelProto | None]:
        """The step in two halves, for data parallelism: forward + backward (+ accumulate) with the
        gradients out, and the update alone (None without an optimizer). Built on first use, as a
        single-process session never runs them (peak RSS of the bench's MLP on the onnxruntime backend, 20
        steps: 109.6 -> 108.8 MiB)."""
        if self._halves is None:
            grads_model, grads_upd, update_model, update_upd = self.make_halves()
            self.updates["gradients"], self.updates["update"] = grads_upd, update_upd
            self._halves = (grads_model, update_model)
        return self._halves

    @property
    def gradients_graph(self) -> onnx.ModelProto:
        """Forward + backward (+ accumulate), the gradients as outputs."""
        return self.split()[0]

    @property
    def update_graph(self) -> onnx.ModelProto | None:
        """Weights, reduced gradients, learning rate and state in; new weights and state out."""
        return self.split()[1]


def _consumers(model: onnx.ModelProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    out: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for n in model.graph.node:
        for i, name in _reads(n):
            out.setdefault(name, []).append((n, i))
    return out


def _reads(n: onnx.NodeProto) -> list[tuple[int, str]]:
    """(input slot, name) of each value ``n`` reads; slot -1 for values its bodies read from outside."""
    return [(i, name) for i, name in enumerate(n.input) if name] + [(-1, name) for name in body_reads(n)]


# slots onnxruntime's builder never differentiates although onnxtrain's rule can (spec §12.3): discovery
# skips them, so a constant exponent kept as an initializer is not trained (listed in weights_to_train, it
# is); nor are an inference-mode BatchNormalization's running statistics (never trained: select_trainable),
# nor a Clip's bounds (the dynamo exporter keeps ReLU6's and clamp's as initializers)
_DISCOVERY_STOP = {"Pow": frozenset({1}), "BatchNormalization": frozenset({3, 4}),
                   "Clip": frozenset({1, 2}), "Pad": frozenset({1, 2})}


def discover_trainable(model: onnx.ModelProto, loss: str, immutable: dict[str, list]) -> list[str]:
    """Float initializers that reach the loss through differentiable input slots (spec §2 step 6)."""
    opset = model_opset(model)
    inits = {t.name: t for t in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output if o}
    fake_quant = fake_quant_inputs(model)  # a pair's output passes the gradient to the pair's input
    needed, found, kept = {loss}, set(), set()
    for n in reversed(model.graph.node):
        if not any(o in needed for o in n.output if o):
            continue
        through = fake_quant.get(n.output[0]) if n.op_type == "DequantizeLinear" else None
        if through is None and has_no_gradient(n.op_type, n.domain):
            continue
        rule = None if through else find_rule(n.op_type, opset, n.domain)
        stop = (rule.stopped(n) if rule else frozenset()) | _DISCOVERY_STOP.get(n.op_type, frozenset())
        for i, name in [(0, through)] if through else _reads(n):
            if i in stop:
                continue
            if name in inits:
                t = inits[name]
                if t.data_type not in FLOAT_TYPES:
                    continue
                if any(
                    i == idx
                    and t.data_type == TensorProto.FLOAT
                    and not t.dims
                    and numpy_helper.to_array(t) == np.float32(v)  # as onnxruntime: float32 to float32
                    for idx, v in immutable.get(n.op_type, ())
                ):
                    kept.add(name)
                    continue
                found.add(name)
            elif name in producer:
                needed.add(name)
    if immutable and not kept:
        warn(f"immutable_weights: no entry matches a float32 scalar initializer the loss depends on "
             f"(entries {dict(immutable)}): it keeps nothing from training")
    return sorted(found)


def _graph_values(model: onnx.ModelProto) -> set[str]:
    g = model.graph
    return {v.name for v in g.input} | {o for n in g.node for o in n.output}


def select_trainable(model: onnx.ModelProto, p: TrainingParameters) -> list[str]:
    inits = {t.name: t for t in model.graph.initializer}
    consumers = _consumers(model)
    wanted = p.weights_to_train
    values = _graph_values(model)
    if wanted and all(w not in consumers and (w in inits or w not in values) for w in wanted):
        # onnxruntime's FilterUnusedWeights emptied the set, and an empty set is discovery (spec §2 steps 2
        # and 6): names that a torch export renamed trained every weight there
        warn(f"weights_to_train: {sorted(wanted)} have no consumer (none is read by the model"
             f"{export_hint(model)}): training every float initializer that reaches the loss, as onnxruntime "
             "did when it dropped them all")
        wanted = set()
    if wanted:
        if p.immutable_weights:
            warn("immutable_weights has no effect when weights_to_train is given (only the discovery of "
                 "trainable weights without weights_to_train reads it)")
        # updated by the forward pass; an optimizer step would overwrite the update. (A statistic may be an
        # Identity's output: an exporter's merged initializers, which the session gives each layer apart.)
        stats = sorted(w for w in wanted if any(n.op_type == "BatchNormalization" and i in (3, 4)
                                                 for n, i in consumers.get(w, ())))
        if stats:
            warn(
                f"weights_to_train: {stats} are BatchNormalization running statistics and are not trained"
            )
        for w in sorted(wanted):
            if w in values and w not in inits and w not in stats:
                raise ValueError(f"weights_to_train: {w!r} is a graph input or node output of the model, not "
                                 "an initializer: only initializers are trained")
        # as onnxruntime's FilterUnusedWeights: a name nothing reads (an unused module parameter that the
        # exporter left out) is excluded from training with a warning
        unused = sorted(w for w in wanted if w not in consumers)
        if unused:
            missing = [w for w in unused if w not in inits]
            warn(f"weights_to_train: {unused} have no consumer and are not trained"
                 + (f" ({missing} are not in the model{export_hint(model)})" if missing else ""))
        not_float = sorted(w for w in wanted if w in consumers and w not in stats
                           and inits[w].data_type not in FLOAT_TYPES)
        if not_float:  # (onnxruntime left them out without a word)
            warn(f"weights_to_train: {not_float} are not of a float type and are not trained")
        trainable = sorted(
            w for w in wanted if w in consumers and w not in stats and inits[w].data_type in FLOAT_TYPES
        )
    else:
        trainable = discover_trainable(model, p.loss_output_name, p.immutable_weights)
        warn_folded_constants(model, [w for w in trainable if w not in p.weights_not_to_train])
    absent = sorted(w for w in p.weights_not_to_train if w not in inits)
    if absent:  # onnxruntime erases them from the set it trains: nothing to exclude
        warn(f"weights_not_to_train: {absent} are not initializers of the model; nothing to exclude")
    return [w for w in trainable if w not in p.weights_not_to_train]


def _why_none_reach(model: onnx.ModelProto, p: TrainingParameters) -> str:
    """": 'W' does not reach 'loss' through a differentiable path (...)" for the first float weight
    the session would have found that reaches the loss through ops without a gradient alone, else ""."""
    if p.weights_to_train:
        return ""
    for t in model.graph.initializer:
        if t.data_type in FLOAT_TYPES and t.name not in p.weights_not_to_train:
            blocked = blocked_by(list(model.graph.node), t.name, p.loss_output_name)
            if blocked:
                return f": {t.name!r} does not reach {p.loss_output_name!r}{blocked}"
    return ""


def _shared_mode_dropouts(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, np.ndarray]]:
    """The Dropouts whose training_mode input is a constant (an initializer, overridable or not, or a
    Constant node), with that constant: onnxruntime's legacy session made their modes one shared
    ``training_mode``. A Dropout whose mode is a graph input or a computed value keeps it: the caller's
    feed decides."""
    dropouts = [n for n in model.graph.node if n.op_type == "Dropout" and len(n.input) >= 3 and n.input[2]]
    constant = constant_arrays(model.graph, {n.input[2] for n in dropouts})
    return [(n, constant[n.input[2]]) for n in dropouts if n.input[2] in constant]


def dropout_mode(model: onnx.ModelProto) -> bool:
    """The training mode a run takes when it feeds none: the value of the first shared-mode Dropout's
    training_mode constant (:func:`_shared_mode_dropouts`), which onnxruntime's legacy session copied into
    the shared ``training_mode`` initializer; True when there is none."""
    first = next(iter(_shared_mode_dropouts(model)), None)
    if first is None:
        return True
    value = np.asarray(first[1])
    return bool(value.reshape(-1)[0]) if value.size else True


def _rewire_dropout(model: onnx.ModelProto) -> bool:
    """Point the training_mode input of every shared-mode Dropout at one bool graph input
    ``training_mode``; whether there was one."""
    dropouts = [n for n, _ in _shared_mode_dropouts(model)]
    if not dropouts:
        return False
    for n in dropouts:
        n.input[2] = TRAINING_MODE
    model.graph.input.append(helper.make_tensor_value_info(TRAINING_MODE, TensorProto.BOOL, []))
    return True


def running_stats(nodes: Iterable[onnx.NodeProto], inits: set[str], names: NameGen) -> dict[str, str]:
    """The running mean and variance (among ``inits``) of the training-mode BatchNormalizations among
    ``nodes`` → the outputs holding their new values, which this names (in place) where a node leaves them
    out. Sessions keep them as state and write back the new values of every training run."""
    stats: dict[str, str] = {}
    nodes = list(nodes)
    for n in nodes:
        if not is_training_batch_norm(n):
            continue
        while len(n.output) < 3:
            n.output.append("")
        for k, i in ((1, 3), (2, 4)):
            if n.input[i] in inits:
                if not n.output[k]:
                    n.output[k] = names(f"{n.input[i]}_updated")
                stats[n.input[i]] = last_statistics(nodes, n.output[k], k)  # a layer applied again: its last
    return stats


def _inits_to_inputs(model: onnx.ModelProto, names: list[str],
                     source: onnx.ModelProto | None = None) -> dict[str, np.ndarray]:
    """Turn initializers ``names`` into graph inputs; returns their values, read from ``source``'s tensor of
    the name where ``model``'s holds none (see :func:`without_values`). One the model already lists as an
    input too (IR < 4, torch's ``keep_initializers_as_inputs``) keeps that one declaration."""
    keep, values = [], {}
    declared = {i.name for i in model.graph.input}
    full = {t.name: t for t in source.graph.initializer} if source is not None else {}
    for t in model.graph.initializer:
        if t.name in names:
            src = t if holds_values(t) else full.get(t.name, t)
            values[t.name] = numpy_helper.to_array(src).copy()
            if t.name not in declared:
                model.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            keep.append(t)
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    return values


def state_names(opt: Optimizer | None, weights: list[str], steps: int = 1) -> dict[str, str]:
    """The names of the state tensors a legacy session adds for ``weights`` (the optimizer's, and the
    accumulation buffers with ``steps`` > 1; onnxruntime's names, the keys of ``get_state()``) → what
    each holds, for messages."""
    out: dict[str, str] = {}
    if opt is not None:
        probe = [WeightSlot(wt, f"{wt}_grad", (), TensorProto.FLOAT) for wt in weights]
        for sp in opt.state(probe):
            whose = f" of weight {sp.weight!r}" if sp.weight else ""
            out[sp.name] = f"{opt.name}'s state {sp.key!r}{whose} (a get_state() entry)"
    if steps > 1:
        for wt in weights:
            buf = accumulation.buffer_name(f"{wt}_grad")
            out[buf] = f"the gradient accumulation buffer of weight {wt!r} (an input of the training graph)"
    return out


def _user_names(model: onnx.ModelProto, loss: str, trainable: list[str],
                stats: dict[str, str]) -> dict[str, str]:
    """The names a user feeds, fetches or finds in ``get_state()`` → what each is: the session keeps them."""
    inits = {t.name for t in model.graph.initializer}
    out = {v.name: "input" for v in model.graph.input if v.name not in inits}
    out.update((v.name, "output") for v in model.graph.output)
    out.setdefault(loss, "loss")
    out.update((wt, "trained weight") for wt in trainable)
    out.update((s, "BatchNormalization running statistic") for s in stats)
    return out


def _model_values(model: onnx.ModelProto) -> set[str]:
    """Every value name of ``model``'s graph and of the bodies in it."""
    out: set[str] = set()
    for g in walk_graphs(model.graph):
        out.update(v.name for v in (*g.input, *g.output, *g.value_info))
        out.update(t.name for t in g.initializer)
        for n in g.node:
            out.update(n.input)
            out.update(n.output)
    return out


def _rename_state_clashes(model: onnx.ModelProto, reserved: dict[str, str], user: dict[str, str],
                          names: NameGen) -> dict[str, str]:
    """Give the values of ``model`` (in place) that carry a name of the session's state (``reserved``) a
    name of their own, so the state input does not take their place; returns old → new name. A name the
    user feeds, fetches or reads in the state (``user``) cannot change: that is an error."""
    clashes = sorted(_model_values(model) & set(reserved))
    for name in clashes:
        if name in user:
            kind = user[name]
            hint = " (or leave it out of training: weights_not_to_train)" if kind == "trained weight" else ""
            raise ValueError(f"the model's {kind} {name!r} has the name the session gives {reserved[name]}; "
                             f"rename the {kind}{hint}")
    renamed = {name: names(name) for name in clashes}
    if renamed:
        rename_in_graph(model.graph, renamed)
    return renamed


def _finish(
    graph_nodes: list[onnx.NodeProto],
    base: onnx.ModelProto,
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    name: str,
) -> onnx.ModelProto:
    from onnxtrain.autodiff.builder import _live_nodes

    keep = _fold_output_identities(_live_nodes(graph_nodes, [o.name for o in outputs]), outputs)
    used = set().union(*(n.input for n in keep), *(body_reads(n) for n in keep if n.attribute))
    used.discard("")  # (an omitted input)
    used.update(o.name for o in outputs)
    g = helper.make_graph(
        keep, name, list(inputs), outputs, initializer=[t for t in base.graph.initializer if t.name in used]
    )
    m = helper.make_model(
        g, opset_imports=list(base.opset_import), **PRODUCER, ir_version=base.ir_version
    )
    return m


def _fold_output_identities(
    nodes: list[onnx.NodeProto], outputs: list[onnx.ValueInfoProto]
) -> list[onnx.NodeProto]:
    """Drop each ``Identity`` that only names a graph output (``w_Adam_out = Identity(t)``): the node making
    ``t`` writes the output under its name instead. A runtime that cannot alias a graph output (onnxruntime)
    would otherwise copy every new weight and moment once more per step (MLP: 0.29 ms of a 2.2 ms step)."""
    out_names = {o.name for o in outputs}
    made = set().union(*(n.output for n in nodes))
    made.discard("")
    # a body reads it by that name: kept
    made.difference_update(*(body_reads(n) for n in nodes if n.attribute))
    renamed: dict[str, str] = {}
    drop: set[int] = set()
    for k, n in enumerate(nodes):
        if n.op_type != "Identity" or n.domain not in DEFAULT_DOMAINS or len(n.input) != 1:
            continue
        x, y = n.input[0], n.output[0]
        if y in out_names and x in made and x not in out_names and x not in renamed:
            renamed[x] = y
            drop.add(k)
    if not renamed:
        return nodes
    out = []
    for k, n in enumerate(nodes):
        if k in drop:
            continue
        if not (renamed.keys().isdisjoint(n.input) and renamed.keys().isdisjoint(n.output)):
            m = onnx.NodeProto()
            m.CopyFrom(n)  # the caller's nodes are shared with other graphs: never edit them in place
            for i, v in enumerate(m.input):
                m.input[i] = renamed.get(v, v)
            for i, v in enumerate(m.output):
                m.output[i] = renamed.get(v, v)
            n = m
        out.append(n)
    return out


def update_clips(p: TrainingParameters, adasum: bool = False) -> bool:
    """Whether the optimizer clips by the global gradient norm: ``enable_grad_norm_clip``, or Adasum under
    float16 mixed precision. onnxruntime's Adasum turns clipping on in every optimizer node, but builds a norm
    to clip by only for ``enable_grad_norm_clip`` or float16 mixed precision (its finite check's)."""
    fp16 = p.use_mixed_precision and p.mixed_precision_dtype == "float16"
    return bool(p.enable_grad_norm_clip or (adasum and fp16))


def strip_client_loss_scaling(m: onnx.ModelProto, loss: str, scaled: str,
                              scale_input: str) -> onnx.ValueInfoProto:
    """Remove from ``m`` (in place) the node computing ``scaled`` = ``loss`` · a float graph input and that
    input's declaration; return the declaration. onnxruntime 1.2-1.3's binding differentiated such a
    client-made scaled loss (``scaled_loss_output_name``); the mixed-precision pass rebuilds the same product
    under the same names, so the gradients are unscaled by that input as by the session's own
    ``loss_scale``."""
    g = m.graph
    where = f"TrainingParameters.scaled_loss_output_name {scaled!r}"
    node = next((n for n in g.node if scaled in n.output), None)
    if node is None:
        raise ValueError(f"{where} is not a value the model's nodes compute")
    fed = {v.name: v for v in g.input if v.name not in {t.name for t in g.initializer}}
    others = list(node.input)
    if loss in others:
        others.remove(loss)
    scale = others[0] if len(node.input) == 2 and len(others) == 1 else ""
    declared = fed[scale].type.tensor_type.elem_type if scale in fed else None
    if node.op_type != "Mul" or declared not in (TensorProto.FLOAT, TensorProto.UNDEFINED):
        raise ValueError(f"{where} must be the loss {loss!r} times a float graph input (the loss scale), as "
                         f"onnxruntime's first ort_trainer.py built it; node {node.name!r} ({node.op_type}) "
                         f"computes it from {list(node.input)}")
    if scale_input and scale_input != scale:
        raise ValueError(f"TrainingParameters.loss_scale_input_name {scale_input!r} is not the input node "
                         f"{node.name!r} scales the loss by ({scale!r})")
    readers = [n.name or n.op_type for n in g.node
               if n is not node and (scale in n.input or scaled in n.input)]
    if readers:
        raise ValueError(f"{where}: node(s) {readers} also read {scale!r} or {scaled!r}; only the loss "
                         "scaling may read them")
    decl = onnx.ValueInfoProto()
    decl.CopyFrom(fed[scale])
    g.node.remove(node)
    g.input.remove(fed[scale])
    for vs in (g.output, g.value_info):
        for v in [v for v in vs if v.name == scaled]:
            vs.remove(v)
    return decl


def build_step_graphs(
    model: onnx.ModelProto, p: TrainingParameters, opt: Optimizer | None, adasum: bool = False
) -> StepGraphs:
    """Compose the forward, gradient and step graphs of a legacy training session (``adasum``: its
    data-parallel mode, which may turn clipping on: :func:`update_clips`)."""
    model = upgrade_opset(model)
    loss = p.loss_output_name
    m = model  # read only until the copy below
    if not loss:
        raise ValueError("TrainingParameters.loss_output_name is empty: name the loss tensor of the model")
    values = {v.name for v in m.graph.output} | {o for n in m.graph.node for o in n.output}
    if loss not in values:
        kind = ("an initializer" if any(t.name == loss for t in m.graph.initializer)
                else "a graph input" if any(v.name == loss for v in m.graph.input) else None)
        what = (f"is {kind} of the model, not a value its nodes compute" if kind
                else "is not a value of the model")
        raise ValueError(f"loss_output_name {loss!r} {what}; outputs: {[o.name for o in m.graph.output]}")
    declared = next((v for v in [*m.graph.output, *m.graph.value_info] if v.name == loss), None)
    dims = declared.type.tensor_type.shape.dim if declared is not None else []
    if any(not d.HasField("dim_value") or d.dim_value != 1 for d in dims):
        shape = shown_dims(declared.type.tensor_type.shape)
        warn(f"loss_output_name {loss!r} is declared of shape {shape}, not one value: the gradients are "
             "those of the sum of its values")
    if opt is not None:
        _check_learning_rate_name(m.graph, p.lr_params_feed_name)
    trainable = select_trainable(m, p)
    if opt is not None and not trainable:
        why = _why_none_reach(m, p) or "; check weights_to_train and weights_not_to_train"
        raise ValueError(f"no trainable weight reaches the loss{why}")
    # the copy the graphs are built from, without the values of the trained weights (read from ``model`` once,
    # into the state): a construction held them three times over besides the caller's bytes (192 MiB of
    # weights: 654 -> 462 MiB over the RSS before it). A BatchNormalization's inputs keep theirs (an exporter
    # may have merged a scale with a statistic, which the graph rewrites below copy)
    batch_norm_reads = {i for n in model.graph.node if n.op_type == "BatchNormalization" for i in n.input}
    m = without_values(model, names=set(trainable) - batch_norm_reads)
    if m is model:
        m = onnx.ModelProto()
        m.CopyFrom(model)
    names = NameGen.for_model(m)
    reserved = state_names(opt, trainable, p.gradient_accumulation_steps)
    names.taken.update(reserved)  # no value our passes add takes a name of the session's state
    tm_default = dropout_mode(m)
    has_tm = _rewire_dropout(m)
    chain_shared_batch_norms(m, names)  # a layer applied twice updates its statistics twice
    untie_batch_norm_statistics(m, names)  # an exporter's merged ones: each layer keeps its own
    train_batch_norms(m.graph.node, names)  # as onnxruntime's training graphs: batch statistics
    bn = running_stats(m.graph.node, {t.name for t in m.graph.initializer}, names)
    renamed = _rename_state_clashes(m, reserved, _user_names(model, loss, trainable, bn), names)
    bn = {s: renamed.get(o, o) for s, o in bn.items()}
    state = _inits_to_inputs(m, trainable + sorted(bn), source=model)
    # a copy without the moved weights, whose bytes m's protobuf arena keeps as long as m lives (peak RSS on
    # the onnxruntime backend, 20 steps: the MLP 108.8 -> 107.1 MiB, LeNet 93.0 -> 91.6)
    compact = onnx.ModelProto()
    compact.CopyFrom(m)
    m = compact
    user_inputs = [
        v.name for v in model.graph.input if v.name not in {t.name for t in model.graph.initializer}
    ]
    scaling, scale_decl = {}, None  # the loss scaling the model computes itself (onnxruntime 1.2-1.3's
    if p.use_mixed_precision and p.scaled_loss_output_name:  # clients added it)
        scale_decl = strip_client_loss_scaling(m, loss, p.scaled_loss_output_name, p.loss_scale_input_name)
        scaling = {"loss_scale_name": scale_decl.name, "scaled_loss_name": p.scaled_loss_output_name}
    user_outputs = [o.name for o in m.graph.output]
    if loss not in user_outputs:
        user_outputs.append(loss)
    fwd_model, gloss, mp = m, loss, None
    if p.use_mixed_precision:
        halves = sorted(w for w in trainable if state[w].dtype in (np.float16, BFLOAT16))
        if halves:  # no float32 master to keep: the half steps would be the weights' own (float64 ones stay)
            raise ValueError(f"use_mixed_precision trains float32 master weights; trained weight(s) "
                             f"{halves} are {state[halves[0]].dtype}: train the half model as it is, "
                             "without use_mixed_precision, or export it in float32")
        fwd_model = mixed_precision(m, loss, p.mixed_precision_dtype, **scaling)
        if scale_decl is not None:  # fed as the client declared it (a rank-0 declaration takes [scale] too),
            # so the product's shape is the loss's broadcast with the fed one
            next(v for v in fwd_model.graph.input if v.name == scale_decl.name).CopyFrom(scale_decl)
            for v in fwd_model.graph.output:
                if v.name == p.scaled_loss_output_name:
                    v.type.tensor_type.ClearField("shape")
        mp = mixed_precision_info(fwd_model)
        gloss = mp.scaled_loss  # backpropagation starts from loss · loss_scale
        if opt is not None:
            check_learning_rate_not_loss_scale(p.lr_params_feed_name, mp.loss_scale)
    if p.use_memory_efficient_gradient and not any(n.op_type == "LayerNormalization" for n in m.graph.node):
        warn("TrainingParameters.use_memory_efficient_gradient has no effect: the model has no "
             "LayerNormalization (whose input it lets the backward pass recompute)")
    try:  # a weight the loss does not depend on: an error, as in onnxruntime (not a zero gradient)
        grad = build_gradient_model(
            fwd_model, gloss, trainable, outputs=user_outputs, extra_outputs=list(bn.values()),
            memory_efficient=p.use_memory_efficient_gradient, zero_unreachable=False, feeds_checked=True,
        )
    except GradientError as e:
        if "does not reach" in str(e):
            elem = value_types(fwd_model).get(loss)
            code = elem.tensor_type.elem_type if elem is not None and elem.HasField("tensor_type") else 0
            if code and code not in FLOAT_TYPES:  # (an integer loss carries no gradient)
                raise ValueError(f"loss_output_name {loss!r} is a tensor of "
                                 f"{TensorProto.DataType.Name(code).lower()}, not of floats: no gradient "
                                 "flows back from it") from None
            raise ValueError(f"weights_to_train: {e}" if p.weights_to_train else str(e)) from None
        raise
    same_size = same_size_dims(grad)  # (the session checks them: feeds_checked)
    inits = {t.name for t in model.graph.initializer}
    constants = inits | {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    grad = _legacy_recompute(grad, gloss, p, [*trainable, *bn], renamed, _graph_values(model) | inits,
                             constants)
    grads = {w: f"{w}_grad" for w in trainable}
    types = {v.name: v for v in grad.graph.input}

    def vi(name: str, like: str | None = None, elem: int | None = None, shape: list | None = None):
        if like is not None:
            src = types.get(like) or next((o for o in grad.graph.output if o.name == like), None)
            if src is not None:
                return helper.make_value_info(name, src.type)
        return helper.make_tensor_value_info(name, elem if elem is not None else TensorProto.FLOAT, shape)

    def buffer_info(name: str, weight: str) -> onnx.ValueInfoProto:
        """A sum of ``weight``'s gradients: its shape, in its buffer type (float32 for halves)."""
        info = vi(name, weight)
        tt = info.type.tensor_type
        tt.elem_type = accumulation.buffer_type(tt.elem_type)
        return info

    steps = p.gradient_accumulation_steps
    if steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be >= 1, got {steps}")
    if steps > 1 and opt is None:  # spec §4.4: nothing would read the accumulated gradients
        raise ValueError(
            f"gradient_accumulation_steps={steps} needs an optimizer (training_optimizer_name); without "
            "one, fetch the gradients (set_gradients_as_graph_outputs) and sum them yourself"
        )
    if steps > 1 and accumulation.GROUP_OUTPUT in (_graph_values(model)
                                                   | {t.name for t in model.graph.initializer}):
        raise ValueError(
            f"gradient_accumulation_steps={steps}: the model has a value named "
            f"{accumulation.GROUP_OUTPUT!r}, the name of the session's accumulation output; rename it"
        )
    base_inputs = list(grad.graph.input)
    # the model's outputs keep their order (the loss where the model has it; appended when it has none), as
    # onnxruntime's session kept them; the builder puts the loss first
    by_name = {o.name: o for o in grad.graph.output}
    out_user = [by_name[n] for n in user_outputs if n in by_name]
    out_bn = [vi(o, None, None, None) for o in bn.values()]
    for k, o in enumerate(out_bn):
        src = next((x for x in grad.graph.output if x.name == o.name), None)
        if src is not None:
            out_bn[k] = src

    clip = update_clips(p, adasum)

    # (shapes only: the halves' closures must not keep the initial weights alive once the session trains
    # other arrays, e.g. a flat update's buffers)
    shapes = {wt: tuple(state[wt].shape) for wt in trainable}

    def slots_for(eff: dict[str, str]) -> list[WeightSlot]:
        return [
            WeightSlot(
                wt,
                eff[wt],
                shapes[wt],
                _elem(types, wt),
                dict(p.optimizer_attributes_map.get(wt, {})),
                dict(p.optimizer_int_attributes_map.get(wt, {})),
            )
            for wt in trainable
        ]

    def update_only() -> tuple[onnx.ModelProto, dict[str, str], list[str]]:
        """The update alone: inputs are the weights, their (already reduced) gradients ``<w>_grad``,
        the learning rate and the optimizer state."""
        model, upd, extras, _ = build_update_graph(grad, slots_for(grads), p, opt, clip=clip, mp=mp)
        return model, upd, extras

    def compose(
        update: bool, expose_grads: bool = False
    ) -> tuple[onnx.ModelProto, dict[str, str], list[str]]:
        nodes = list(grad.graph.node)
        gen = NameGen.for_model(grad)
        gen.taken.update(reserved)  # the state inputs declared below keep their names
        w = NodeWriter(gen, nodes, prefix="")  # value and node names stay unique
        inputs = list(base_inputs)
        outputs = list(out_user)
        extras: list[str] = []
        upd: dict[str, str] = {stat: out for stat, out in bn.items()}
        eff = dict(grads)
        if steps > 1:
            accs = []
            for wt, g in grads.items():
                buf = accumulation.buffer_name(g)
                inputs.append(buffer_info(buf, wt))
                acc = accumulation.accumulate(w, g, _elem(types, wt))
                accs.append(acc)
                eff[wt] = acc
                if not update or opt is None:
                    outputs.append(buffer_info(acc, wt))
                    upd[buf] = acc
            first = _elem(types, next(iter(grads))) if grads else TensorProto.FLOAT
            barrier = accumulation.group_barrier(w, accs, accumulation.buffer_type(first))
            outputs.append(helper.make_tensor_value_info(barrier, TensorProto.BOOL, FLAG_SHAPE))
            extras.append(barrier)
        if p.set_gradients_as_graph_outputs:
            for wt, g in grads.items():
                outputs.append(vi(g, wt))
                extras.append(g)
            if mp is not None:  # onnxruntime's name and type: the gradient of the half twin
                for wt, g in grads.items():
                    if wt in mp.twins:
                        half = w.emit("Cast", [g], [w.names(f"{mp.twins[wt]}_grad")], to=mp.dtype)[0]
                        info = vi(g, wt)
                        info.name = half
                        info.type.tensor_type.elem_type = mp.dtype
                        outputs.append(info)
                        extras.append(half)
        if update and opt is not None:
            if steps > 1:
                eff = {wt: accumulation.averaged(w, a, steps, _elem(types, wt)) for wt, a in eff.items()}
            _emit_update(w, slots_for(eff), p, opt, inputs, outputs, extras, upd, clip=clip, mp=mp)
        elif expose_grads and steps == 1:
            for wt, g in grads.items():
                if not p.set_gradients_as_graph_outputs:
                    outputs.append(vi(g, wt))
        outputs += out_bn
        return _finish(w.nodes, grad, inputs, outputs, "training_graph"), upd, extras

    full, full_upd, extras = compose(update=True)
    if opt is not None:
        _check_learning_rate_clash(full.graph, p.lr_params_feed_name)
    acc_model, acc_upd = None, {}
    if steps > 1 and opt is not None:
        acc_model, acc_upd, _ = compose(update=False)

    def halves() -> tuple:
        """The same step in two halves, for data parallelism: gradients out, reduce across ranks, update."""
        grads_model, grads_upd, _ = compose(update=False, expose_grads=True)
        update_model, update_upd, _ = update_only() if opt is not None else (None, {}, [])
        return grads_model, grads_upd, update_model, update_upd

    specs: list[StateSpec] = []
    if opt is not None:
        slots = [WeightSlot(wt, grads[wt], tuple(state[wt].shape), _elem(types, wt)) for wt in trainable]
        specs = opt.state(slots)
    initial = dict(state)
    for sp in specs:
        # the state's own array (a moment's initial value is a broadcast zero, StateSpec); afterwards only a
        # spec's shape and dtype say anything
        initial[sp.name] = sp.initial if sp.initial.flags.writeable else np.zeros(sp.initial.shape,
                                                                                   sp.initial.dtype)
    buffers = [accumulation.buffer_name(g) for g in grads.values()] if steps > 1 else []
    for b, wt in zip(buffers, trainable):
        initial[b] = np.zeros(state[wt].shape, np_dtype(accumulation.buffer_type(_elem(types, wt))))
    # evaluation: the (transformed) forward alone, without the loss scaling
    fwd_outputs = [o for o in grad.graph.output if o.name in user_outputs]
    fwd_inputs = [
        i for i in fwd_model.graph.input if (mp is None or i.name != mp.loss_scale) and i.name not in bn
    ]
    fwd = _finish(
        list(fwd_model.graph.node), fwd_model, fwd_inputs, fwd_outputs, fwd_model.graph.name or "forward"
    )
    fwd = stable_log_sigmoids(fwd)  # the loss computed as the training graph computes it (log σ terms)
    # the running statistics are constants there: a training-mode normalization's output does not read them,
    # and onnxruntime writes their new values into the buffer it is given for them when the graph does not
    # return them (an evaluation run changed the session's statistics on that backend)
    read = {i for n in fwd.graph.node for i in node_reads(n)}
    fwd.graph.initializer.extend(numpy_helper.from_array(state[s], s) for s in sorted(bn) if s in read)
    return StepGraphs(
        forward=fwd,
        full=full,
        accumulate=acc_model,
        gradient=grad,
        transformed=m,
        trainable=trainable,
        initial_state=initial,
        state_specs=specs,
        updates={"full": full_upd, "accumulate": acc_upd},
        make_halves=halves,
        buffers=buffers,
        bn_stats=bn,
        user_inputs=user_inputs,
        user_outputs=user_outputs,
        extra_outputs=extras,
        has_training_mode=has_tm,
        training_mode_default=tm_default,
        mixed_precision=mp,
        same_size_dims=same_size,
    )


def _check_learning_rate_name(graph: onnx.GraphProto, name: str) -> None:
    """The learning-rate feed ``name`` is a name of its own, or a float graph input (the one feed then
    serves both): not empty, an initializer or a value a node computes."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"TrainingParameters.lr_params_feed_name must name the learning-rate feed, got "
                         f"{name!r}")
    writer = next((n for n in graph.node if name in n.output), None)
    if writer is not None or name in {t.name for t in graph.initializer}:
        what = (f"node {writer.name!r} ({writer.op_type}) computes it" if writer is not None
                else "an initializer of that name")
        raise ValueError(f"lr_params_feed_name {name!r} names a value of the model ({what}); name the "
                         "learning-rate feed otherwise (TrainingParameters.lr_params_feed_name)")


def check_learning_rate_not_loss_scale(name: str, loss_scale: str) -> None:
    """Refuse a learning-rate feed ``name`` that is mixed precision's loss scale input ``loss_scale``: the
    update would add no input of its own, so the one feed would be both, and the loss scale fed (2^16) the
    learning rate. Every session kind checks it (one process's, a pipeline's stages, a horizontal split's
    ranks)."""
    if name == loss_scale:
        raise ValueError(f"lr_params_feed_name {name!r} names the loss scale input of mixed precision "
                         "(TrainingSession.loss_scale_input_name): one feed would be both the learning rate "
                         "and the loss scale; name the learning-rate feed otherwise "
                         "(TrainingParameters.lr_params_feed_name)")


def warn_idle_max_norm_clip(p: TrainingParameters, opt: Optimizer, trained: list[str], clips: bool) -> None:
    """A warning when ``optimizer_attributes_map`` gives ``max_norm_clip`` for a trained weight and nothing
    clips by it: ``clips`` False (enable_grad_norm_clip off), or onnxruntime's CPU Adam (legacy_cpu_adam),
    whose update reads no norm. Every session kind warns alike."""
    clip = [w for w in trained if "max_norm_clip" in p.optimizer_attributes_map.get(w, {})]
    if clip and not clips and "max_norm_clip" in opt.FLOAT_ATTRS:
        warn(f"optimizer_attributes_map: max_norm_clip (given for {len(clip)} weight(s), e.g. "
             f"{clip[0]!r}) has no effect with enable_grad_norm_clip=False")
    elif clip and p.legacy_cpu_adam and opt.name == "AdamOptimizer":  # (its update reads no norm)
        warn(f"optimizer_attributes_map: max_norm_clip (given for {len(clip)} weight(s), e.g. "
             f"{clip[0]!r}) has no effect with legacy_cpu_adam (onnxruntime's CPU Adam did not clip)")


def _check_learning_rate_clash(graph: onnx.GraphProto, name: str) -> None:
    """Refuse a learning-rate feed ``name`` that the training graph defines besides that input: a value the
    session computes (the global norm, a gradient, an update's output) or state it keeps under that name.
    (:func:`_check_learning_rate_name` checked the user's model; onnxruntime-training 1.16.3 refused such
    a name as it resolved the graph, "Duplicate definition of name".)"""
    writer = next((n for n in graph.node if name in n.output), None)
    inputs = sum(i.name == name for i in graph.input)
    if writer is None and inputs < 2 and name not in {t.name for t in graph.initializer}:
        return
    what = (f"node {writer.name!r} ({writer.op_type}) computes it" if writer is not None
            else "the session keeps state of that name")
    raise ValueError(f"lr_params_feed_name {name!r} names a value of the training graph the session builds "
                     f"({what}); name the learning-rate feed otherwise (TrainingParameters."
                     "lr_params_feed_name)")


def _add_learning_rate_input(inputs: list[onnx.ValueInfoProto], name: str) -> None:
    """Append the learning-rate feed ``name`` to ``inputs``, unless the model has an input of that name
    already (onnxruntime skipped duplicates: the one feed serves both), which must be float."""
    same = next((i for i in inputs if i.name == name), None)
    if same is None:
        inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [1]))
    elif same.type.tensor_type.elem_type != TensorProto.FLOAT:
        raise ValueError(f"lr_params_feed_name {name!r} is an input of the model of another type than "
                         "float; name the learning-rate feed otherwise (TrainingParameters."
                         "lr_params_feed_name)")
    elif any(d.HasField("dim_value") and d.dim_value != 1 for d in same.type.tensor_type.shape.dim):
        dims = shown_dims(same.type.tensor_type.shape)
        raise ValueError(f"lr_params_feed_name {name!r} is an input of the model of shape {dims}, not "
                         "one value; name the learning-rate feed otherwise "
                         "(TrainingParameters.lr_params_feed_name)")


def _emit_update(
    w: NodeWriter,
    slots: list[WeightSlot],
    p: TrainingParameters,
    opt: Optimizer,
    inputs: list,
    outputs: list,
    extras: list[str],
    upd: dict[str, str],
    clip: bool,
    norm_input: str | None = None,
    mp: MixedPrecisionInfo | None = None,
) -> list[StateSpec]:
    """Global norm, clipping divisor and the optimizer over the slots' gradients.

    With ``norm_input`` the global norm is a graph input of that name (computed elsewhere, e.g. summed
    over ZeRO partitions across ranks) instead of being computed from the slots' gradients. With ``mp`` the
    gradients are loss-scaled: the update unscales them (and clips), and is skipped when not all are finite.
    """
    w.names.taken.update(state_names(opt, [s.name for s in slots]))  # the values made here take others
    _add_learning_rate_input(inputs, p.lr_params_feed_name)
    if mp is not None and mp.loss_scale not in {i.name for i in inputs}:
        inputs.append(helper.make_tensor_value_info(mp.loss_scale, TensorProto.FLOAT, [1]))
    norm = None
    norm_et = norm_type([s.elem_type for s in slots])  # computed here or fed as norm_input
    if clip or mp is not None:  # under mixed precision loss-scaled, as the legacy reported
        norm = _update_norm(w, slots, norm_input, inputs, outputs, extras, norm_et)
    mnc = None
    if clip and opt.uses_norm and not (p.legacy_cpu_adam and opt.name == "AdamOptimizer"):  # Adam's kernel
        mnc = {s.name: _max_norm_clip(s, opt) for s in slots}
    if mp is None and mnc is not None:
        for s in slots:
            s.divisor = clip_divisor(w, norm, mnc[s.name], norm_et=norm_et, out_et=compute_type(s.elem_type))
    specs = _state_inputs(opt, slots, inputs)
    state = {sp.name: sp.name for sp in specs}
    if mp is None:
        new_w, new_s = opt.emit(w, slots, p.lr_params_feed_name, state)
    else:
        new_w, new_s, flag = mixed_precision_update(
            w, opt, slots, p.lr_params_feed_name, state, norm, mp.loss_scale, mnc, norm_et
        )
        flag = w.emit("Reshape", [flag, w.ints(FLAG_SHAPE)], [w.names(ALL_FINITE)])[0]
        outputs.append(helper.make_tensor_value_info(flag, TensorProto.BOOL, FLAG_SHAPE))
        extras.append(flag)
    _add_update_outputs(w, slots, specs, new_w, new_s, outputs, upd)
    return specs


def _legacy_recompute(grad: onnx.ModelProto, loss: str, p: TrainingParameters,
                      weights: list[str], renamed: dict[str, str], model_values: set[str],
                      model_constants: set[str]) -> onnx.ModelProto:
    """The recompute pass the parameters ask for; errors name the parameter, and options that select
    nothing in this model are named in a warning (onnxruntime said nothing either way). ``renamed``: the
    model's values renamed apart from the session's state (:func:`_rename_state_clashes`); ``model_values``:
    the names of the user's model, whose checkpoints the session's rewrites may have removed or left as
    initializers (a Dropout's training-mode Constant, a float32 Constant that mixed precision remade in
    half, a frozen weight): constants, which are never recomputed, so they keep nothing more and are left
    out; a name of neither graph is an error, and so is a name of the step graph only (a gradient). A
    left-out name that is no constant of the model (``model_constants``: its initializers and Constant
    outputs) is an activation a rewrite replaced, such as the Sigmoid of a Log(Sigmoid(z)) computed as
    -softplus(-z): it is left out too, named in a warning, since the step keeps less than the list says."""
    asked = [k for k in ("gelu_recompute", "attn_dropout_recompute", "transformer_layer_recompute")
             if getattr(p, k)] + (["recompute_checkpoints"] if p.recompute_checkpoints else [])
    if not asked:
        return grad
    label = f"TrainingParameters {', '.join(asked)}"
    checkpoints = None
    if p.recompute_checkpoints:  # (all of them left out: still a checkpoint recompute, of every activation)
        present = _graph_values(grad)  # (an initializer, a frozen weight, is a constant of the step too)
        checkpoints, foreign, replaced = [], [], []
        for c in p.recompute_checkpoints:
            name = renamed.get(c, c)
            if c not in model_values and name in present:
                foreign.append(c)
            elif name in present or c not in model_values:  # (of neither graph: the pass refuses it)
                checkpoints.append(name)
            elif c not in model_constants:  # (a constant the rewrites removed keeps nothing: left out)
                replaced.append(c)
        if foreign:  # (a gradient, the loss's gradient: values of the step graph only)
            raise ValueError(f"TrainingParameters recompute_checkpoints: {foreign} are not values of the "
                             "model but of the training graph the session built (gradients); a checkpoint "
                             "names a value of the model's forward pass")
        if replaced:
            warn(f"TrainingParameters recompute_checkpoints: {replaced} are values of the model that the "
                 "session's rewrites replaced (a Log(Sigmoid(z)) is computed as -softplus(-z), for one), so "
                 "the step has no such value to keep; they are left out")
    try:
        return recompute_or_warn(grad, loss, label, gelu=p.gelu_recompute,
                                 attn_dropout=p.attn_dropout_recompute,
                                 transformer_layer=p.transformer_layer_recompute,
                                 number_recompute_layers=p.number_recompute_layers,
                                 checkpoints=checkpoints, weights=weights)
    except ValueError as e:
        raise ValueError(f"{label}: {e}") from None


def _update_norm(w: NodeWriter, slots: list[WeightSlot], norm_input: str | None, inputs: list, outputs: list,
                 extras: list[str], et: int) -> str:
    """The global gradient norm an update reads, of type ``et``: the graph input ``norm_input`` when given,
    else computed from the slots' gradients and output as an extra."""
    if norm_input is not None:
        inputs.append(helper.make_tensor_value_info(norm_input, et, []))
        return norm_input
    norm = global_norm(w, [s.grad for s in slots], grad_types=[s.elem_type for s in slots])
    outputs.append(helper.make_tensor_value_info(norm, et, []))
    extras.append(norm)
    return norm


def _max_norm_clip(slot: WeightSlot, opt: Optimizer) -> float:
    """The weight's ``max_norm_clip`` (its attribute map, else the optimizer's default, else 1.0); a value
    that is not positive is an error (onnxruntime took it: zero froze the weight, a negative value climbed
    the loss)."""
    value = float(slot.float_attrs.get("max_norm_clip", opt.FLOAT_ATTRS.get("max_norm_clip", 1.0)))
    if not value > 0:
        raise ValueError(f"optimizer_attributes_map[{slot.name!r}]['max_norm_clip'] must be > 0 with "
                         f"enable_grad_norm_clip, got {value} (enable_grad_norm_clip = False: no clipping)")
    return value


def _state_inputs(opt: Optimizer, slots: list[WeightSlot], inputs: list) -> list[StateSpec]:
    """The optimizer state of ``slots``, declared as graph inputs."""
    specs = opt.state(slots)
    for sp in specs:
        et = helper.np_dtype_to_tensor_dtype(sp.initial.dtype)
        inputs.append(helper.make_tensor_value_info(sp.name, et, list(sp.initial.shape)))
    return specs


def _add_update_outputs(
    w: NodeWriter,
    slots: list[WeightSlot],
    specs: list[StateSpec],
    new_w: dict[str, str],
    new_s: dict[str, str],
    outputs: list,
    upd: dict[str, str],
) -> None:
    """Declare the new weights and state as outputs. A scalar weight's update broadcasts against the [1]
    learning rate and norms: it goes back to its empty shape (else it would grow to [1] at the first step)."""
    for s in slots:
        o = new_w[s.name]
        if not s.shape:
            o = w.one("Reshape", o, w.ints([]))
        outputs.append(helper.make_tensor_value_info(o, s.elem_type, list(s.shape)))
        upd[s.name] = o
    dtypes = {sp.name: sp.initial for sp in specs}
    for sname, o in new_s.items():
        init = dtypes[sname]
        if not init.shape:
            o = w.one("Reshape", o, w.ints([]))
        outputs.append(
            helper.make_tensor_value_info(o, helper.np_dtype_to_tensor_dtype(init.dtype), list(init.shape))
        )
        upd[sname] = o


def build_update_graph(
    base: onnx.ModelProto,
    slots: list[WeightSlot],
    p: TrainingParameters,
    opt: Optimizer,
    clip: bool,
    norm_input: str | None = None,
    mp: MixedPrecisionInfo | None = None,
) -> tuple[onnx.ModelProto, dict[str, str], list[str], list[StateSpec]]:
    """An update graph over ``slots`` (weights or ZeRO pieces): inputs are each slot's value and gradient
    (``slot.grad``), the learning rate, the optimizer state (and ``norm_input``); returns the model,
    state name → output, the extra outputs (global norm) and the optimizer state it keeps.

    ``base`` gives the opset and IR version.
    """
    nodes: list[onnx.NodeProto] = []
    lr = p.lr_params_feed_name
    taken = [*(s.name for s in slots), *(s.grad for s in slots), lr, *([norm_input] if norm_input else [])]
    w = NodeWriter(NameGen(taken), nodes, prefix="")
    inputs: list = [helper.make_tensor_value_info(s.name, s.elem_type, list(s.shape)) for s in slots]
    inputs += [helper.make_tensor_value_info(s.grad, s.elem_type, list(s.shape)) for s in slots]
    outputs: list = []
    extras: list[str] = []
    upd: dict[str, str] = {}
    specs = _emit_update(
        w, slots, p, opt, inputs, outputs, extras, upd, clip=clip, norm_input=norm_input, mp=mp
    )
    model = _finish(nodes, base, inputs, outputs, "update_graph")
    # every input of an update is fed: a weight its base holds as an initializer (a horizontal split's
    # share) is not held as one too (onnxruntime warned of each such name)
    fed = {i.name for i in model.graph.input}
    kept = [t for t in model.graph.initializer if t.name not in fed]
    if len(kept) < len(model.graph.initializer):
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept)
    return model, upd, extras, specs


def _elem(types: dict[str, onnx.ValueInfoProto], name: str) -> int:
    v = types.get(name)
    return v.type.tensor_type.elem_type if v is not None else TensorProto.FLOAT
