"""Which outputs of a graph onnxruntime may write straight into a donated input's array.

The numpy engine decides this on its own steps (:mod:`onnxtrain.engine.donation`). onnxruntime runs the
nodes in an order of its choosing, so here the condition is on the graph alone: output ``o`` may be bound
to the buffer of input ``x`` when ``o`` is made by an elementwise node, both have the same static shape and
type, and every node that reads ``x``, or a value that might share its memory, is an ancestor of the
node making ``o`` through data, not only a shape (it has run before ``o`` is written in any order
onnxruntime may pick, whatever it folds) or is that node itself (which reads each element before writing
it, index by index). An optimizer update ``m' = β·m + …`` qualifies; a weight that the backward pass still
reads after its new value could be computed does not.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx

from onnxtrain.ir.graphs import constant_arrays, fed_initializers, node_reads
from onnxtrain.ir.types import value_info_shape

# nodes whose output is a new buffer, element i computed from the inputs' elements i (after broadcasting).
# Not Cast, Max, Min, Clip...: onnxruntime's graph optimizers remove some of them when they do nothing (a
# Cast to the same type, a one-input Max), and their consumers then read the input itself
ELEMENTWISE = frozenset({
    "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Sqrt", "Reciprocal", "Exp", "Log", "Pow", "Where",
    "Relu", "Sigmoid", "Tanh", "Sign", "Floor", "Ceil",
})
# nodes whose output is a new buffer in any case (other nodes may hand out a view of an input)
FRESH = ELEMENTWISE | frozenset({"MatMul", "Gemm", "Conv", "Softmax"})
# nodes that read only their input's shape (and type): onnxruntime computes them at load time when that is
# static, so the node making the input need not run before them (CastLike reads only its second input's type)
SHAPE_ONLY = frozenset({"Shape", "Size", "EyeLike"})
# products onnxruntime's MatMulScaleFusion folds a constant scale of an operand into (alpha), which then
# read the operand itself: a weight scaled by a constant and multiplied is read as the weight
SCALED_PRODUCTS = frozenset({"MatMul", "Gemm", "Transpose"})
# x + 0, x - 0, x · 1, x / 1 and x ^ 1 with a constant operand: onnxruntime's NoopElimination removes them
NEUTRAL = {"Add": 0.0, "Sub": 0.0, "Mul": 1.0, "Div": 1.0, "Pow": 1.0}


def safe_updates(model: onnx.ModelProto, updates: Mapping[str, str]) -> dict[str, str]:
    """The pairs of ``updates`` (output name → the graph input it replaces) whose output onnxruntime may
    write into the input's array (see the module docstring); the others are left out."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    outputs = {o.name: o for o in g.output}
    inputs = {v.name: v for v in g.input if v.name not in inits and v.name not in outputs}
    producer: dict[str, int] = {}
    for k, n in enumerate(g.node):
        for o in n.output:
            if o:
                producer[o] = k
    consts = _constants(model)
    # the inputs each value might share memory with (through nodes outside FRESH, or that do nothing)
    roots: dict[str, frozenset[str]] = {x: frozenset((x,)) for x in inputs}
    readers_of: dict[str, set[str]] = {}
    for n in g.node:
        for i in n.input:
            readers_of.setdefault(i, set()).add(n.op_type)
    for n in g.node:
        aliasing = (n.op_type not in FRESH or _does_nothing(n, consts)
                    or _scale_of_a_product(n, consts, readers_of))
        reads = node_reads(n)
        src = frozenset().union(*(roots.get(i, frozenset()) for i in reads)) if aliasing else frozenset()
        for o in n.output:
            if o:
                roots[o] = src
    readers: dict[str, set[int]] = {x: set() for x in inputs}
    for k, n in enumerate(g.node):
        for i in node_reads(n):
            for x in roots.get(i, ()):
                readers[x].add(k)
    escaping = {x for o in outputs for x in roots.get(o, ()) if o != x}  # an output that may be a view

    def ancestors(k: int) -> set[int]:
        todo, seen = [k], set()
        while todo:
            n = g.node[todo.pop()]
            # onnxruntime folds what reads only a shape or a type when that is static: no order with the
            # node making it
            for i in _data_inputs(n):
                p = producer.get(i)
                if p is not None and p not in seen:
                    seen.add(p)
                    todo.append(p)
        return seen

    safe: dict[str, str] = {}
    for o, x in updates.items():
        k, info, xi = producer.get(o), outputs.get(o), inputs.get(x)
        if k is None or info is None or xi is None or x in escaping or x in safe.values():
            continue
        shape = value_info_shape(info.type)
        static = shape is not None and all(isinstance(d, int) for d in shape)
        if (g.node[k].op_type not in ELEMENTWISE or not static or xi.type != info.type
                or value_info_shape(xi.type) != shape):
            continue
        before = ancestors(k)
        if any(r != k and r not in before for r in readers[x]):
            continue  # a node that may run after o is written still reads x
        if k in readers[x] and any(i != x and x in roots.get(i, ()) for i in g.node[k].input):
            continue  # the producer reads x through a view of another shape
        safe[o] = x
    return safe


def _data_inputs(node: onnx.NodeProto) -> list[str]:
    """The inputs whose values (not only shape or type) ``node`` reads."""
    if node.op_type in SHAPE_ONLY:
        return []
    if node.op_type == "CastLike":
        return list(node.input[:1])
    return list(node.input)


def _constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Values of the initializers and Constant nodes that are operands of :data:`NEUTRAL` ops, by name, also
    through Casts and Identities of them (onnxruntime folds those first)."""
    g = model.graph
    operands = {i for n in g.node if n.op_type in NEUTRAL for i in n.input}
    producer = {o: n for n in g.node for o in n.output if o}
    walks = {v: _cast_chain(v, producer) for v in operands}
    found = constant_arrays(g, {start for start, _ in walks.values()}, fed_initializers(model))
    values = {}
    for v, (start, casts) in walks.items():
        if start in found:
            a = found[start]
            for to in casts:
                a = a.astype(onnx.helper.tensor_dtype_to_np_dtype(to))
            values[v] = a
    return values


def _cast_chain(name: str, producer: Mapping[str, onnx.NodeProto]) -> tuple[str, list[int]]:
    """The value ``name`` is made from through Casts and Identities, and the Casts' types in the order they
    apply."""
    casts: list[int] = []
    while name in producer and producer[name].op_type in ("Cast", "Identity"):
        node = producer[name]
        casts += [a.i for a in node.attribute if a.name == "to"]
        name = node.input[0]
    return name, casts[::-1]


def _scale_of_a_product(node: onnx.NodeProto, consts: Mapping[str, np.ndarray],
                        readers_of: Mapping[str, set[str]]) -> bool:
    """True for ``x · c`` or ``x / c`` with a one-value constant ``c`` whose result a MatMul, Gemm or
    Transpose reads (see :data:`SCALED_PRODUCTS`)."""
    if node.op_type not in ("Mul", "Div") or len(node.input) != 2:
        return False
    sides = node.input[1:] if node.op_type == "Div" else node.input
    if not any(i in consts and consts[i].size == 1 for i in sides):
        return False
    return bool(readers_of.get(node.output[0], set()) & SCALED_PRODUCTS)


def _does_nothing(node: onnx.NodeProto, consts: Mapping[str, np.ndarray]) -> bool:
    """True for ``x op c`` with a constant ``c`` all of the op's neutral value (see :data:`NEUTRAL`)."""
    neutral = NEUTRAL.get(node.op_type)
    if neutral is None or len(node.input) != 2:
        return False
    sides = node.input[1:] if node.op_type in ("Sub", "Div", "Pow") else node.input
    return any(i in consts and consts[i].size and bool(np.all(consts[i] == neutral)) for i in sides)
