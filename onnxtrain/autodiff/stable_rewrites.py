"""Numerically stable forms of the log-sigmoid terms torch's exporters write for the logistic losses.

Both exporters write ``F.logsigmoid(x)`` as ``Log(Sigmoid(x))``; the TorchScript export of
``BCEWithLogitsLoss`` writes ``y·log σ(x) + (1 − y)·log(1 − σ(x))`` with ``Log(Sub(1, Sigmoid(x)))``, the
dynamo export ``(1 − y)·x − log σ(x)``; dynamo writes ``torch.log1p(−σ(x))`` as
``Log(Add(Neg(Sigmoid(x)), 1))``, its constant 1 an initializer (a Cast of a Constant without its optimizer).
Computed as written they break down in float32 where torch
does not: σ(x) rounds to 1 from x ≈ 17, so log(1 − σ(x)) is −inf, its gradient 0·inf = NaN (in the loss and in
every gradient, even where that term's weight y is 1); σ(x) is 0 below x ≈ −88, so log σ(x) is −inf.

:func:`stable_log_sigmoids` rewrites, in the graph prepared for differentiation (whose nodes are also the
forward of the training graph),

    log σ(x)      = −softplus(−x)   →  Neg(Softplus(Neg(x)))
    log(1 − σ(x)) = −softplus(x)    →  Neg(Softplus(x))

whose values and gradients (σ(±x)) stay finite for every finite x. The Sigmoid stays when something else
reads its output. A Cast between the σ term and the Log (mixed precision reads a float16 σ(x) in float32)
is matched too: the stable form then computes in the Log's type from x cast to it. A clamped Log (read by
a Max or Clip: ``F.binary_cross_entropy(σ(x), y)``, a loss of probabilities that torch computes from the
rounded σ(x), clamping its logs at −100) stays as written, equal to torch's. Logs of float32 and
float16 only: onnxruntime has no float64 Softplus kernel (and in float64 the breakdown starts at |x| ≈ 37
and 709), ONNX none for bfloat16 before opset 22.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.ir.attrs import attribute_value
from onnxtrain.ir.builder import NameGen, elem_type, symbolic_shape, value_types
from onnxtrain.ir.graphs import DEFAULT_DOMAINS, node_reads

_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16)  # of the Log
_FLOATS = (*_TYPES, TensorProto.BFLOAT16, TensorProto.DOUBLE)  # of x, cast to the Log's type
_PASS_THROUGH = ("Cast", "CastLike", "Identity")  # a constant 1 may come through these (dynamo exports)
_CONSTANT_VALUES = ("value", "value_float", "value_int")
# a Log read by these is clamped: F.binary_cross_entropy, a loss of probabilities, as dynamo writes it,
# Max(Log(p), −100); torch computes it from the rounded p and the clamp, and so does the graph as written
_CLAMPS = ("Max", "Clip")


class _Graph:
    """The main graph's producers, clamped values and fixed values."""

    def __init__(self, model: onnx.ModelProto):
        g = model.graph
        self.nodes = list(g.node)
        self.producer = {o: n for n in self.nodes for o in n.output if o}
        self.outputs = {o.name for o in g.output}
        self.clamped = {i for n in self.nodes if n.op_type in _CLAMPS and n.domain in DEFAULT_DOMAINS
                        for i in n.input}
        inputs = {v.name for v in g.input}
        self.initializers = {t.name: t for t in g.initializer if t.name not in inputs}

    def made_by(self, name: str, op: str) -> onnx.NodeProto | None:
        n = self.producer.get(name)
        return n if n is not None and n.op_type == op and n.domain in DEFAULT_DOMAINS else None

    def value(self, name: str, depth: int = 0) -> np.ndarray | None:
        """The value of a fixed tensor: an initializer, a Constant, or one of those through a Cast,
        CastLike or Identity (the value before the cast: only ``== 1`` is asked of it)."""
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        n = self.producer.get(name)
        if n is None or n.domain not in DEFAULT_DOMAINS or depth > 4:
            return None
        if n.op_type == "Constant" and len(n.attribute) == 1 and n.attribute[0].name in _CONSTANT_VALUES:
            return np.asarray(attribute_value(n.attribute[0]))
        if n.op_type in _PASS_THROUGH and n.input:
            return self.value(n.input[0], depth + 1)
        return None


def _is_one(g: _Graph, name: str, rank: int | None) -> bool:
    """Whether ``name`` is a fixed one-element 1 that broadcasts to no larger rank than ``rank``."""
    v = g.value(name)
    if v is None or v.size != 1 or v.dtype.kind not in "fiu" or float(v.reshape(-1)[0]) != 1.0:
        return False
    return v.ndim == 0 or (rank is not None and v.ndim <= rank)


def _sigmoid_input(g: _Graph, s: str) -> str | None:
    n = g.made_by(s, "Sigmoid")
    return n.input[0] if n is not None and len(n.input) == 1 else None


def _match(g: _Graph, log: onnx.NodeProto, types: dict[str, Any] | None) -> tuple[str, bool, list] | None:
    """(x, whether the Log is of 1 − σ(x), the nodes between x and the Log) for a Log of σ(x) or of
    1 − σ(x), either through a Cast (mixed precision: a float16 σ(x) read in float32); ``types`` None: any
    candidate (before types are known)."""
    v = log.input[0]
    cast = g.made_by(v, "Cast")
    if cast is not None and len(cast.input) == 1:
        m = _match_value(g, cast.input[0], types)
        return None if m is None else (m[0], m[1], [cast, *m[2]])
    return _match_value(g, v, types)


def _match_value(g: _Graph, v: str, types: dict[str, Any] | None) -> tuple[str, bool, list] | None:
    if _sigmoid_input(g, v) is not None:
        return _sigmoid_input(g, v), False, [g.producer[v]]
    sub, add = g.made_by(v, "Sub"), g.made_by(v, "Add")

    def one(c: str, s: str) -> bool:  # c a 1 that leaves σ(x)'s shape as it is (types None: not asked yet)
        if types is None:
            return True
        shape = symbolic_shape(types, s)
        return _is_one(g, c, None if shape is None else len(shape))

    if sub is not None and len(sub.input) == 2:  # 1 − σ(x)
        x = _sigmoid_input(g, sub.input[1])
        if x is not None and one(sub.input[0], sub.input[1]):
            return x, True, [sub, g.producer[sub.input[1]]]
    if add is not None and len(add.input) == 2:  # −σ(x) + 1, either order
        for a, b in (add.input, reversed(add.input)):
            neg = g.made_by(a, "Neg")
            x = _sigmoid_input(g, neg.input[0]) if neg is not None and len(neg.input) == 1 else None
            if x is not None and one(b, a):
                return x, True, [add, neg, g.producer[neg.input[0]]]
    return None


def stable_log_sigmoids(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each float32 or float16 ``Log(Sigmoid(x))`` of its main graph written
    ``Neg(Softplus(Neg(x)))`` and each ``Log(1 − Sigmoid(x))`` written ``Neg(Softplus(x))`` (see the module
    docstring); ``model`` itself when it has none."""
    g = _Graph(model)
    logs = [n for n in g.nodes if n.op_type == "Log" and n.domain in DEFAULT_DOMAINS and len(n.input) == 1
            and len(n.output) == 1 and n.output[0] not in g.clamped and _match(g, n, None) is not None]
    if not logs:
        return model
    types = value_types(model)
    found = {}
    for n in logs:
        m = _match(g, n, types)
        if m is not None and elem_type(types, m[0]) in _FLOATS and elem_type(types, n.output[0]) in _TYPES:
            found[id(n)] = (*m, elem_type(types, m[0]) != elem_type(types, n.output[0]))
    if not found:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    names = NameGen.for_model(model)
    nodes: list[onnx.NodeProto] = []
    chains: list[onnx.NodeProto] = []
    for n in g.nodes:
        if id(n) not in found:
            nodes.append(n)
            continue
        x, complement, chain, cast = found[id(n)]
        chains.extend(chain)
        base = n.name or n.output[0]
        if cast:  # computed in the Log's type, from x cast to it
            xc = names(f"{n.output[0]}_x")
            to = next(a.i for a in chain[0].attribute if a.name == "to")
            nodes.append(helper.make_node("Cast", [x], [xc], name=names(f"{base}_stable/Cast"), to=to))
            x = xc
        if not complement:  # log σ(x) = −softplus(−x)
            neg = names(f"{n.output[0]}_neg_x")
            nodes.append(helper.make_node("Neg", [x], [neg], name=names(f"{base}_stable/Neg_x")))
            x = neg
        sp = names(f"{n.output[0]}_softplus")
        nodes.append(helper.make_node("Softplus", [x], [sp], name=names(f"{base}_stable/Softplus")))
        nodes.append(helper.make_node("Neg", [sp], n.output, name=names(f"{base}_stable/Neg")))
    # the Sigmoid, Sub, Neg, Add between x and a rewritten Log, when nothing else reads them now
    gone: set[int] = set()
    readers: dict[str, int] = {}
    for n in nodes:
        for i in node_reads(n):
            readers[i] = readers.get(i, 0) + 1
    changed = True
    while changed:
        changed = False
        for c in chains:
            if id(c) in gone or any(readers.get(o) or o in g.outputs for o in c.output if o):
                continue
            gone.add(id(c))
            changed = True
            for i in node_reads(c):
                readers[i] -= 1
    dropped = {o for n in nodes if id(n) in gone for o in n.output}
    kept_info = [v for v in out.graph.value_info if v.name not in dropped]
    del out.graph.node[:]
    out.graph.node.extend(n for n in nodes if id(n) not in gone)
    del out.graph.value_info[:]
    out.graph.value_info.extend(kept_info)
    return out
