"""Recompute (spec §9) as a memory strategy on the gradient graph.

A gradient graph (``build_gradient_model``) is the forward nodes followed by the backward nodes; a
forward value that a backward node reads stays alive from its forward producer to that backward use.
``recompute_values(model, loss, values)`` instead clones, for each of the given forward ``values``,
the forward nodes producing it (from the values that are kept: graph inputs, weights, checkpoints,
Dropout masks...) and places the clones right before the value's first backward use; the backward
nodes read the clone, named ``<value>_recompute`` as in onnxruntime. The engine frees a value after its
last use in graph order, so the original dies in the forward pass and the clone lives only during the
backward of its own part of the model. Results are bit-identical: the clones run the same kernels on
the same inputs, and a Dropout output is rebuilt from the saved mask, as the kernel computes it
(``X · (1/(1 − ratio)) · mask``), never by drawing a new mask.

Which values to recompute (each a pass, composable; ``recompute`` applies several in one go):

* ``gelu_recompute``: the GELU output and intermediates (the ``Gelu`` op, or the Erf / Tanh decomposition
  that exporters emit), recomputed from the GELU input.
* ``attn_dropout_recompute``: the output of each Dropout that follows a Softmax (possibly through Casts)
  and feeds a MatMul — the attention probabilities — rebuilt from the Softmax output and the mask.
* ``transformer_layer_recompute``: every activation of the first ``number_recompute_layers`` layers
  (0: all but the last), recomputed from the layer's input. Layers are found from the graph's
  structure (not from node names): the residual stream is the chain of dominators of the loss in the
  graph of activations; a layer begins where an attention block (a segment holding a Softmax) begins
  and ends where the next layer begins (the last layer: after its MLP segment, with a following
  LayerNormalization-only segment for post-LN models). Pre-LN (GPT) and post-LN (BERT) exports work.
* ``checkpoint_recompute`` (ours): every activation except the given checkpoint tensors.

``loss`` names the value the backward starts from (``scaled_loss`` under mixed precision): the forward
part of the graph is everything up to the last node the loss needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextvars import ContextVar
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff.registry import find_rule
from onnxtrain.ir.attrs import attribute_value
from onnxtrain.ir.builder import FLOAT_TYPES, NameGen, elem_type, model_opset, value_types
from onnxtrain.ir.graphs import RANDOM_OPS, is_training_batch_norm, path_from
from onnxtrain.user_warning import warn

GELU_OPS = frozenset({"Erf", "Tanh"})
_GELU_BODY = frozenset({"Add", "Mul", "Div", "Sub", "Erf", "Tanh", "Pow", "Sqrt", "Neg", "Cast", "Constant"})
ACTIVATIONS = frozenset({"Gelu", "Erf", "Tanh", "Relu", "Sigmoid", "Elu", "Selu", "LeakyRelu", "Softplus",
                         "HardSigmoid", "HardSwish", "Mish"})
IGNORED_INPUTS = frozenset({"training_mode", "loss_scale"})  # graph inputs that are no activations
# a recompute whose clones are nearly all (EARLY_SHARE) made within the first EARLY_PART of the backward
# pass's nodes holds its activations as long as the plain graph: it saves nothing, and says so
EARLY_PART, EARLY_SHARE, MIN_REBUILT = 0.1, 0.9, 2


class _Forward:
    """The forward part of a gradient graph and what is known about its values."""

    def __init__(self, model: onnx.ModelProto, loss: str, forward_outputs: Iterable[str] = (),
                 weights: Iterable[str] = ()):
        self.model = model
        g = model.graph
        self.nodes = list(g.node)
        self.opset = model_opset(model)
        self.producer: dict[str, int] = {}
        for k, n in enumerate(self.nodes):
            for o in n.output:
                if o:
                    self.producer[o] = k
        targets = [loss, *forward_outputs]
        for t in targets:
            if t not in self.producer:
                raise ValueError(f"recompute: {t!r} is not produced by a node of the graph")
        self.loss = loss
        # forward = every node up to the last one the loss (and forward_outputs) need
        needed, stack = set(), [self.producer[t] for t in targets]
        while stack:
            k = stack.pop()
            if k in needed:
                continue
            needed.add(k)
            stack.extend(self.producer[i] for i in self.nodes[k].input if i in self.producer)
        self.loss_nodes = needed
        self.boundary = max(needed) + 1
        self.consumers: dict[str, list[int]] = {}
        for k, n in enumerate(self.nodes[: self.boundary]):
            for i in n.input:
                if i:
                    self.consumers.setdefault(i, []).append(k)
        self.graph_outputs = {o.name for o in g.output}
        self.initializers = {t.name: t for t in g.initializer}
        self.graph_inputs = {v.name for v in g.input}
        self.weights = set(weights)  # graph inputs that hold parameters (fed from a state store), not data
        self.types = value_types(model)

    def data_consumers(self, v: str) -> list[onnx.NodeProto]:
        """Forward nodes reading ``v``'s data (Shape and Size nodes read only its shape)."""
        ks = self.consumers.get(v, [])
        return [self.nodes[k] for k in ks if self.nodes[k].op_type not in ("Shape", "Size")]

    def is_forward(self, v: str) -> bool:
        return self.producer.get(v, self.boundary) < self.boundary

    def is_float(self, v: str) -> bool:
        return elem_type(self.types, v) in FLOAT_TYPES

    def node_of(self, v: str) -> onnx.NodeProto | None:
        k = self.producer.get(v)
        return None if k is None else self.nodes[k]

    def constant(self, v: str) -> np.ndarray | None:
        """The value of a fixed input (initializer that is not a graph input, or Constant output)."""
        if not v or v in self.graph_inputs:
            return None
        if v in self.initializers:
            return numpy_helper.to_array(self.initializers[v])
        n = self.node_of(v)
        if n is not None and n.op_type == "Constant" and len(n.attribute) == 1:
            return np.asarray(attribute_value(n.attribute[0]))
        return None

    def activations(self, ignore: Iterable[str] = ()) -> set[str]:
        """Forward values that depend on a data input (not only on weights, constants or shapes)."""
        skip = set(IGNORED_INPUTS) | set(ignore) | self.weights
        act = {v for v in self.graph_inputs if v not in self.initializers and v not in skip}
        for n in self.nodes[: self.boundary]:
            if n.op_type in ("Shape", "Size"):
                continue
            if any(i in act for i in n.input if i):
                act.update(o for o in n.output if o)
        return act

    def weight_fed(self) -> set[str]:
        """Forward values that a weight feeds: a float initializer of more than one value (not a scalar
        constant), or a graph input holding a parameter."""
        sources = {n for n, t in self.initializers.items()
                   if t.data_type in FLOAT_TYPES and int(np.prod(t.dims)) > 1}
        return path_from(self.nodes[: self.boundary], sources | self.weights)[1]

    def dropout_rebuild(self, n: onnx.NodeProto) -> tuple[str, Any] | None:
        """How a Dropout's output can be rebuilt: ("identity", None) in inference form, ("mask", (scale,
        training_mode or None)) in training form with a saved mask and a fixed ratio, else None."""
        tm = n.input[2] if len(n.input) > 2 and n.input[2] else None
        if tm is None:
            return ("identity", None)
        tv = self.constant(tm)
        if tv is not None and not bool(tv.reshape(-1)[0]):
            return ("identity", None)
        if len(n.output) < 2 or not n.output[1]:
            return None
        ratio = 0.5
        if len(n.input) > 1 and n.input[1]:
            rv = self.constant(n.input[1])
            if rv is None:
                return None  # a fed ratio: its float32 reciprocal could differ from the kernel's
            ratio = float(rv.reshape(-1)[0])
        if not 0.0 <= ratio < 1.0:
            return None
        return ("mask", (1.0 / (1.0 - ratio), None if tv is not None else tm))

    def recomputable(self, v: str) -> bool:
        n = self.node_of(v)
        if n is None or not self.is_forward(v) or v in self.graph_outputs or not self.is_float(v):
            return False
        if n.op_type == "Dropout":
            return v == n.output[0] and self.dropout_rebuild(n) is not None
        if n.op_type in RANDOM_OPS or n.op_type == "Constant":
            return False
        return not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute)


# ---- the clone pass ---------------------------------------------------------------------------------------

def recompute_values(model: onnx.ModelProto, loss: str, values: Iterable[str],
                     forward_outputs: Iterable[str] = (), weights: Iterable[str] = (),
                     one_graph: bool = False) -> onnx.ModelProto:
    """Recompute the forward ``values`` in the backward pass instead of keeping them alive.

    Values that cannot be recomputed (graph outputs, non-float values, outputs of random ops other than
    a Dropout's output with a saved mask, backward values) are kept and silently skipped. With
    ``one_graph`` (forward and backward run as one graph), a note says when nearly every clone is made as
    the backward starts, which saves nothing (a pipeline stage's, run apart, still saves what it stashes).
    """
    fa = _Forward(model, loss, forward_outputs, weights=weights)
    marked = {v for v in values if fa.recomputable(v)}
    names = NameGen.for_model(model)
    new_nodes: list[onnx.NodeProto] = list(fa.nodes[: fa.boundary])
    clone_of: dict[str, str] = {}
    cloned: set[int] = set()

    def clone_inputs(n: onnx.NodeProto) -> list[str]:
        if n.op_type == "Dropout":
            return [n.input[0]]
        return [i for i in n.input if i]

    early: list[int] = []  # nodes cloned while the backward pass is in its first EARLY_PART of nodes

    def materialize(v: str, at: int) -> None:
        """Clone the nodes ``v`` needs for the backward's node ``at``."""
        todo: set[int] = set()
        stack = [fa.producer[v]]
        while stack:
            k = stack.pop()
            if k in cloned or k in todo:
                continue
            todo.add(k)
            stack.extend(fa.producer[i] for i in clone_inputs(fa.nodes[k])
                         if i in marked and i not in clone_of)
        for k in sorted(todo):  # the original (topological) order
            new_nodes.extend(_clone(fa, k, marked, clone_of, names))
            cloned.add(k)
        if at <= EARLY_PART * backward:
            early.extend(todo)

    backward = len(fa.nodes) - fa.boundary
    for at, n in enumerate(fa.nodes[fa.boundary:]):
        node = _copy(n)
        for j, v in enumerate(node.input):
            if v in marked:
                if v not in clone_of:
                    materialize(v, at)
                node.input[j] = clone_of[v]
        new_nodes.append(node)
    if one_graph and len(cloned) >= MIN_REBUILT and len(early) >= EARLY_SHARE * len(cloned):
        _note(f"recompute: {len(early)} of the {len(cloned)} recomputed nodes are rebuilt as the backward "
              "pass starts (they feed its first nodes), so recomputing saves no memory (recompute "
              "checkpoints must include values that every later part of the model reads: a "
              "transformer's residual Add outputs, say)")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(new_nodes)
    return out


def _clone(fa: _Forward, k: int, marked: set[str], clone_of: dict[str, str],
           names: NameGen) -> list[onnx.NodeProto]:
    """The nodes recomputing node ``k``'s marked outputs; records their names in ``clone_of``."""
    n = fa.nodes[k]
    base = n.name or n.op_type
    if n.op_type == "Dropout":
        how = fa.dropout_rebuild(n)
        x = clone_of.get(n.input[0], n.input[0])
        y = names(f"{n.output[0]}_recompute")
        clone_of[n.output[0]] = y
        if how is None or how[0] == "identity":  # inference form: Y = X
            return [helper.make_node("Identity", [x], [y], name=names(f"{base}_recompute"))]
        scale, tm = how[1]
        value_et = elem_type(fa.types, n.input[0]) or TensorProto.FLOAT
        # the kernel scales float16 and bfloat16 in float32 and rounds once: so does the rebuild
        et = TensorProto.FLOAT if value_et in (TensorProto.BFLOAT16, TensorProto.FLOAT16) else value_et
        dt = helper.tensor_dtype_to_np_dtype(et)
        out: list[onnx.NodeProto] = []
        if et != value_et:
            wide = names(f"{base}_recompute_float")
            out.append(helper.make_node("Cast", [x], [wide], name=names(f"{base}_recompute_Cast"), to=et))
            x = wide
        s = names(f"{base}_recompute_scale")
        out.append(helper.make_node("Constant", [], [s], name=names(f"{base}_recompute_Constant"),
                                    value=numpy_helper.from_array(np.asarray(scale, dtype=dt), s)))
        if tm is not None:  # the training flag is fed: scale 1 in inference mode (mask all true there)
            one = names(f"{base}_recompute_one")
            out.append(helper.make_node("Constant", [], [one], name=names(f"{base}_recompute_Constant"),
                                        value=numpy_helper.from_array(np.asarray(1.0, dtype=dt), one)))
            s2 = names(f"{base}_recompute_scale")
            out.append(helper.make_node("Where", [tm, s, one], [s2], name=names(f"{base}_recompute_Where")))
            s = s2
        # Y = (X · scale) · mask, in the kernel's order (a dropped element is ±0 like X·scale·0)
        xs = names(f"{base}_recompute_scaled")
        m = names(f"{base}_recompute_mask")
        out.append(helper.make_node("Mul", [x, s], [xs], name=names(f"{base}_recompute_Mul")))
        out.append(helper.make_node("Cast", [n.output[1]], [m], name=names(f"{base}_recompute_Cast"), to=et))
        if et == value_et:
            out.append(helper.make_node("Mul", [xs, m], [y], name=names(f"{base}_recompute")))
            return out
        ym = names(f"{base}_recompute_masked")
        out.append(helper.make_node("Mul", [xs, m], [ym], name=names(f"{base}_recompute_Mul")))
        out.append(helper.make_node("Cast", [ym], [y], name=names(f"{base}_recompute"), to=value_et))
        return out
    c = _copy(n)
    c.name = names(f"{base}_recompute")
    for j, i in enumerate(c.input):
        if i in clone_of:
            c.input[j] = clone_of[i]
    optional = _optional_outputs(n, fa.opset)
    if is_training_batch_norm(n):  # ONNX wants all three outputs in training mode (onnxruntime refuses fewer)
        optional -= {1, 2}
    for j, o in enumerate(n.output):
        if not o:
            continue
        if o in marked:
            clone_of[o] = c.output[j] = names(f"{o}_recompute")
        elif j in optional:
            c.output[j] = ""  # kept from the forward pass; the clone need not produce it
        else:
            c.output[j] = names(f"{o}_recompute_unused")
    while c.output and not c.output[-1]:
        c.output.pop()
    return [c]


def _optional_outputs(n: onnx.NodeProto, opset: int) -> set[int]:
    try:
        schema = onnx.defs.get_schema(n.op_type, opset, n.domain or "")
    except onnx.defs.SchemaError:
        return set()
    opt = onnx.defs.OpSchema.FormalParameterOption.Optional
    return {j for j, f in enumerate(schema.outputs) if f.option == opt}


# ---- what to recompute ------------------------------------------------------------------------------------

def gelu_values(model: onnx.ModelProto, loss: str) -> set[str]:
    """Outputs and intermediates of every GELU (``Gelu`` op, or an Erf/Tanh decomposition)."""
    fa = model if isinstance(model, _Forward) else _Forward(model, loss)
    out: set[str] = set()
    for k, n in enumerate(fa.nodes[: fa.boundary]):
        if n.op_type == "Gelu":
            out.add(n.output[0])
        elif n.op_type in GELU_OPS:
            out |= _decomposed_gelu(fa, k)
    return out


def _decomposed_gelu(fa: _Forward, k: int) -> set[str]:
    """The float values of the GELU ``x·½·(1 + erf(x/√2))`` (or its tanh form) around node ``k``.

    x is the value that feeds both the Erf/Tanh branch and the final product; the region is every node
    on a path from x to the GELU output.
    """
    e = fa.nodes[k]
    cone: set[str] = set()  # values behind the Erf/Tanh, a few nodes deep
    frontier = [i for i in e.input if i]
    for _ in range(6):
        nxt = []
        for v in frontier:
            if v in cone or fa.constant(v) is not None:
                continue
            cone.add(v)
            p = fa.node_of(v)
            if p is not None and p.op_type in _GELU_BODY:
                nxt.extend(i for i in p.input if i)
        frontier = nxt
    cur, x = e.output[0], None
    for _ in range(6):
        cons = fa.data_consumers(cur)
        if x is not None:  # after x·(...): at most one more scaling by a constant (the ½, when not first)
            n = cons[0] if len(cons) == 1 else None
            if n is not None and n.op_type in ("Mul", "Div") and len(n.output) == 1:
                others = [i for i in n.input if i != cur]
                if others and all(fa.constant(i) is not None for i in others):
                    cur = n.output[0]
            break
        if len(cons) != 1:
            return set()
        n = cons[0]
        if n.op_type not in ("Add", "Mul", "Div", "Sub") or len(n.output) != 1:
            return set()
        if n.op_type == "Mul":
            for other in (i for i in n.input if i != cur):
                if other in cone:
                    x = other
                else:
                    p = fa.node_of(other)  # ½·x computed first
                    if p is not None and p.op_type in ("Mul", "Div"):
                        q = [i for i in p.input if fa.constant(i) is None]
                        if len(q) == 1 and q[0] in cone and len(p.input) == 2:
                            x = q[0]
        cur = n.output[0]
    if x is None:
        return set()
    region = _between(fa, x, cur)
    if not region or len(region) > 16 or any(fa.nodes[j].op_type not in _GELU_BODY for j in region):
        return set()
    return {o for j in region for o in fa.nodes[j].output if o and fa.is_float(o)}


def _between(fa: _Forward, start: str, end: str) -> set[int]:
    """Forward nodes on a path from value ``start`` to value ``end`` (excluding start's producer)."""
    down: set[str] = {start}
    for n in fa.nodes[: fa.boundary]:
        if any(i in down for i in n.input if i):
            down.update(o for o in n.output if o)
    region: set[int] = set()
    stack = [end]
    seen: set[str] = set()
    while stack:
        v = stack.pop()
        if v in seen or v == start or v not in down:
            continue
        seen.add(v)
        k = fa.producer.get(v)
        if k is None or k >= fa.boundary:
            continue
        region.add(k)
        stack.extend(i for i in fa.nodes[k].input if i)
    return region


def attn_dropout_values(model: onnx.ModelProto, loss: str) -> set[str]:
    """Outputs of Dropouts that follow a Softmax and feed a MatMul (through Casts), and those Casts."""
    fa = model if isinstance(model, _Forward) else _Forward(model, loss)
    out: set[str] = set()
    for n in fa.nodes[: fa.boundary]:
        if n.op_type != "Dropout":
            continue
        p = fa.node_of(n.input[0])
        while p is not None and p.op_type == "Cast":
            p = fa.node_of(p.input[0])
        if p is None or p.op_type != "Softmax":
            continue
        chain, cur, ok = [n.output[0]], n.output[0], False
        while True:
            cons = fa.data_consumers(cur)
            if cons and all(c.op_type == "MatMul" for c in cons):
                ok = True
                break
            if len(cons) == 1 and cons[0].op_type == "Cast":
                cur = cons[0].output[0]
                chain.append(cur)
                continue
            break
        if ok:
            out.update(chain)
    return out


def _dominator_chain(fa: _Forward, act: set[str]) -> list[str]:
    """The activations every path from the data inputs to the loss goes through, inputs first.

    Edges follow differentiable input slots only (a gradient rule's ``stop`` slots, such as Gather's
    indices or Dropout's ratio, are no edges), so shape computations and masks do not bypass a layer.
    """
    root = "<root>"
    idom: dict[str, str] = {}
    depth: dict[str, int] = {root: 0}

    def lca(a: str, b: str) -> str:
        while a != b:
            if depth[a] < depth[b]:
                a, b = b, a
            a = idom[a]
        return a

    for n in fa.nodes[: fa.boundary]:
        rule = find_rule(n.op_type, fa.opset, n.domain)
        stop = rule.stopped(n) if rule else frozenset()
        preds = [i for j, i in enumerate(n.input) if i and i in act and i in depth and j not in stop]
        for o in n.output:
            if not o or o not in act or not fa.is_float(o):
                continue
            d = preds[0] if preds else root
            for p in preds[1:]:
                d = lca(d, p)
            idom[o] = d
            depth[o] = depth[d] + 1
    if fa.loss not in idom:
        return []
    chain, v = [], fa.loss
    while v != root:
        chain.append(v)
        v = idom[v]
    chain.reverse()
    return chain


def find_transformer_layers(model: onnx.ModelProto, loss: str) -> list[tuple[str, str, set[str]]]:
    """The transformer layers of a gradient graph: (start value, end value, activations inside), in order."""
    fa = model if isinstance(model, _Forward) else _Forward(model, loss)
    # values no weight feeds (a BERT's attention-mask bias, made from an input alone) join every layer from
    # the side: in the analysis, no layer's output would dominate the loss
    act = fa.activations() & fa.weight_fed()
    chain = _dominator_chain(fa, act)
    if len(chain) < 3:
        return []
    pos = {v: i for i, v in enumerate(chain)}
    # segment i holds the activations after chain[i] up to chain[i + 1]; find each activation's segment
    seg_of: dict[str, int] = {}
    down: dict[str, int] = {}
    for n in fa.nodes[: fa.boundary]:
        srcs = [down[i] if i in down else pos.get(i) for i in n.input if i in act]
        srcs = [s for s in srcs if s is not None]
        for o in n.output:
            if not o or o not in act:
                continue
            if o in pos:
                seg_of[o] = pos[o] - 1
                continue
            if srcs:
                down[o] = seg_of[o] = max(srcs)
    kinds: list[str] = []
    for i in range(len(chain) - 1):
        ops = [fa.nodes[fa.producer[v]].op_type for v, s in seg_of.items() if s == i]
        if "Softmax" in ops:
            kinds.append("attn")
        elif any(o in ACTIVATIONS for o in ops) and sum(o in ("MatMul", "Gemm") for o in ops) >= 2:
            kinds.append("mlp")
        elif ops and all(o == "LayerNormalization" for o in ops):
            kinds.append("norm")
        else:
            kinds.append("other")
    starts = [i for i, k in enumerate(kinds) if k == "attn"]
    if not starts:
        return []
    bounds: list[tuple[int, int]] = []
    for a, i in enumerate(starts):
        nxt = starts[a + 1] if a + 1 < len(starts) else len(kinds)
        mlp = [j for j in range(i + 1, nxt) if kinds[j] == "mlp"]
        if not mlp:
            _note("transformer_layer_recompute: an attention block without an MLP block after it; "
                 "no layer is recomputed")
            return []
        end = nxt if a + 1 < len(starts) else mlp[0] + 1
        while a + 1 == len(starts) and end < len(kinds) and kinds[end] == "norm":
            end += 1  # post-LN: the layer ends after its LayerNormalization
        bounds.append((i, end))
    layers = []
    for i, end in bounds:
        inside = {v for v, s in seg_of.items() if i <= s < end and v != chain[end] and fa.is_float(v)}
        layers.append((chain[i], chain[end], inside))
    return layers


def transformer_layer_values(model: onnx.ModelProto, loss: str, number_recompute_layers: int = 0,
                             layers: list | None = None) -> set[str]:
    """Activations of the first ``number_recompute_layers`` layers (0: all layers but the last; a negative
    value too, with a note, as onnxruntime's transformer read any value below 1); ``layers``: those
    :func:`find_transformer_layers` found, when known."""
    layers = find_transformer_layers(model, loss) if layers is None else layers
    if not layers:
        _note("transformer_layer_recompute: no transformer layer found; nothing is recomputed")
        return set()
    n, most = int(number_recompute_layers), len(layers) - 1
    if n < 0:
        _note(f"number_recompute_layers={n} is below 0: taken as 0 (as onnxruntime did), every layer but "
              f"the last, {most}, is recomputed")
        n = 0
    if n == 0:
        n = most
    elif n > most:
        _note(f"number_recompute_layers={n} is more than the {len(layers)} layers minus one; "
             f"recomputing {most}")
        n = most
    out: set[str] = set()
    for _, _, inside in layers[:n]:
        out |= inside
    return out


def checkpoint_values(model: onnx.ModelProto, loss: str, checkpoints: Iterable[str]) -> set[str]:
    """Every float activation except the ``checkpoints`` (recomputed from the nearest kept values)."""
    fa = model if isinstance(model, _Forward) else _Forward(model, loss)
    keep = set(checkpoints)
    unknown = sorted(c for c in keep if c not in fa.producer and c not in fa.graph_inputs)
    if unknown:
        raise ValueError(f"recompute checkpoints {unknown} are not values of the forward graph (known values "
                         f"are node outputs and graph inputs)")
    return {v for v in fa.activations() if v not in keep and v in fa.producer and fa.is_forward(v)}


# ---- the passes -----------------------------------------------------------------------------------------

def gelu_recompute(model: onnx.ModelProto, loss: str) -> onnx.ModelProto:
    return recompute_values(model, loss, gelu_values(model, loss))


def attn_dropout_recompute(model: onnx.ModelProto, loss: str) -> onnx.ModelProto:
    return recompute_values(model, loss, attn_dropout_values(model, loss))


def transformer_layer_recompute(model: onnx.ModelProto, loss: str,
                                number_recompute_layers: int = 0) -> onnx.ModelProto:
    return recompute_values(model, loss, transformer_layer_values(model, loss, number_recompute_layers))


def checkpoint_recompute(model: onnx.ModelProto, loss: str, checkpoints: Sequence[str]) -> onnx.ModelProto:
    """Recompute every activation between the given checkpoint tensors (names of forward values)."""
    return recompute_values(model, loss, checkpoint_values(model, loss, checkpoints), one_graph=True)


def recompute(model: onnx.ModelProto, loss: str, *, gelu: bool = False, attn_dropout: bool = False,
              transformer_layer: bool = False, number_recompute_layers: int = 0,
              checkpoints: Sequence[str] | None = None, weights: Iterable[str] = (),
              forward_outputs: Iterable[str] = (), values: Iterable[str] = (),
              one_graph: bool = False) -> onnx.ModelProto:
    """The union of the selected strategies, in one clone pass (the session's entry point).

    ``weights`` names graph inputs that hold parameters (the legacy session feeds its trained weights
    as inputs): they are not activations. ``forward_outputs``: forward values other than the loss's
    ancestors (a pipeline stage's outputs, which its backward does not start from). ``values``: more
    activations to recompute, chosen elsewhere (a cut session's transformer layers, found on the whole model).
    ``one_graph``: see :func:`recompute_values`.
    """
    values = set(values)
    if not (gelu or attn_dropout or transformer_layer or checkpoints is not None or values):
        return model
    forward_outputs = list(forward_outputs)
    fa = _Forward(model, loss, forward_outputs, weights=weights)
    if gelu:
        values |= _selected(fa, gelu_values(fa, loss), "the GELU recompute finds no GELU (a Gelu op, or the "
                            "Erf or Tanh form exporters write) whose values the backward pass keeps")
    if attn_dropout:
        values |= _selected(fa, attn_dropout_values(fa, loss), "the attention-dropout recompute finds no "
                            "Dropout between a Softmax and a MatMul whose output the backward pass keeps")
    if transformer_layer:
        found = find_transformer_layers(fa, loss)
        layer_values = transformer_layer_values(fa, loss, number_recompute_layers, found)
        if len(found) == 1:  # (none found: transformer_layer_values says so)
            _selected(fa, layer_values, "the transformer-layer recompute finds one transformer layer, the "
                      "last, which is never recomputed (the backward pass uses its activations at once)")
        values |= layer_values
    if checkpoints is not None:
        values |= checkpoint_values(fa, loss, checkpoints)
    return (recompute_values(model, loss, values, forward_outputs, weights=weights, one_graph=one_graph)
            if values else model)


# the notes of the pass running in this thread, when :func:`recompute_or_warn` collects them (else warnings)
_NOTES: ContextVar[list[str] | None] = ContextVar("recompute_notes", default=None)
# the options of that pass that select nothing, said when the others recompute something
_IDLE: ContextVar[list[str] | None] = ContextVar("recompute_idle", default=None)


def _selected(fa: _Forward, found: set[str], idle: str) -> set[str]:
    """``found``; when none of it can be recomputed, ``idle`` (why) is recorded for
    :func:`recompute_or_warn`."""
    record = _IDLE.get()
    if record is not None and not any(fa.recomputable(v) for v in found):
        record.append(idle)
    return found


def _note(message: str) -> None:
    notes = _NOTES.get()
    if notes is None:
        warn(message)
    else:
        notes.append(message)


def recompute_or_warn(model: onnx.ModelProto, loss: str, label: str, **options: Any) -> onnx.ModelProto:
    """:func:`recompute` with one warning, naming ``label`` (the options as the caller knows them), when
    it recomputes nothing, holding the pass's own reasons (no transformer layer found, ...); otherwise its
    notes as warnings, and one for each option that selects nothing beside others that do. The notes are
    collected per thread (a context variable), not by catching warnings, which would take other threads'
    warnings too."""
    before = len(model.graph.node)
    token, idle_token = _NOTES.set([]), _IDLE.set([])
    try:
        out = recompute(model, loss, one_graph=True, **options)
        notes, idle = _NOTES.get() or [], _IDLE.get() or []
    finally:
        _NOTES.reset(token)
        _IDLE.reset(idle_token)
    if len(out.graph.node) == before:  # the pass adds a clone per recomputed node
        why = "; ".join(notes) or "no value the options select is kept for the backward pass"
        warn(f"{label}: nothing in this model is recomputed ({why})")
    else:
        for note in notes:
            warn(note)
        for why in idle:  # an option selecting nothing beside others that do (it was said of none alone)
            warn(f"{label}: {why}, so it recomputes nothing (the other options' values are recomputed)")
    return out


def _copy(node: onnx.NodeProto) -> onnx.NodeProto:
    c = onnx.NodeProto()
    c.CopyFrom(node)
    return c
