"""Broadcasting operands given the output's rank before onnxruntime runs a graph.

onnxruntime's elementwise kernels broadcast an operand of lower rank onto a tensor whose last axis is 1 one
element at a time: ``Mul`` of a (512, 256, 1, 1) weight by a scalar takes 1 ms where the same weight as
(512, 256) takes 18 µs, and as fast again when the scalar is given the shape (1, 1, 1, 1) (onnxruntime 1.32,
two threads). ``Add``, ``Sub``, ``Div``, ``Max``, ``Min``, ``Sum``, the comparisons and ``PRelu`` alike are
50–300× slower that way. The optimizer's per-weight update of a 1×1 convolution's weight is a dozen such
nodes: a legacy Adam step of one 512 → 512 1×1 Conv took 123 ms on the backend against 18 ms for the same
weight as a Gemm.

So each operand of lower rank than such a node's output (its last dim 1, its rank known) is given the
output's rank, with leading 1s as broadcasting would: a constant by a reshaped copy, a run-time value by an
``Unsqueeze`` (one per value and rank, shared by the nodes that read it). The values are the same bits.
Only the main graph is rewritten (a body's ranks are mostly unknown before a run).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxtrain.ir.builder import NameGen, model_opset, static_shape, with_nodes_replaced
from onnxtrain.ir.graphs import DEFAULT_DOMAINS, constant_arrays, drop_unread, fed_initializers

BROADCASTING_OPS = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean", "Equal", "Less", "Greater",
    "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Where", "PRelu", "BitShift", "BitwiseAnd",
    "BitwiseOr", "BitwiseXor",
})
MIN_VALUES = 64  # outputs of fewer static values stay as they are (the extra node would cost more)
_AXES_AS_INPUT = 13  # Unsqueeze's axes: an attribute before opset 13, an input from it


def _may_apply(model: onnx.ModelProto) -> bool:
    """Whether the graph has a broadcasting node and a value that may end in an axis of 1: a declared one,
    or the output of a reduction or an Unsqueeze (a check that spares most graphs the shape inference)."""
    g = model.graph
    if not any(n.op_type in BROADCASTING_OPS and n.domain in DEFAULT_DOMAINS for n in g.node):
        return False
    if any(t.dims and t.dims[-1] == 1 and len(t.dims) > 1 for t in g.initializer):
        return True
    for v in (*g.input, *g.output, *g.value_info):
        dims = v.type.tensor_type.shape.dim if v.type.HasField("tensor_type") else ()
        if len(dims) > 1 and dims[-1].HasField("dim_value") and dims[-1].dim_value == 1:
            return True
    shaping = ("Unsqueeze", "Reshape", "Expand")
    return any(n.op_type.startswith("Reduce") or n.op_type in shaping for n in g.node)


def _plan(node: onnx.NodeProto, types: dict) -> dict[int, int] | None:
    """{input position: its rank} of the inputs to raise to the output's rank, or None to leave the node."""
    if node.op_type not in BROADCASTING_OPS or node.domain not in DEFAULT_DOMAINS or not node.output:
        return None
    out = static_shape(types, node.output[0])
    if out is None or len(out) < 2 or out[-1] != 1:
        return None
    if all(d is not None for d in out) and int(np.prod(out)) < MIN_VALUES:
        return None
    lower: dict[int, int] = {}
    for i, name in enumerate(node.input):
        if not name:
            continue
        shape = static_shape(types, name)
        if shape is None:
            return None  # an operand of unknown rank: the output's rank says nothing of it
        if len(shape) < len(out):
            lower[i] = len(shape)
    return lower or None


def equal_rank_operands(model: onnx.ModelProto, typed: Callable[[], dict]) -> onnx.ModelProto:
    """``model`` with the lower-rank operands of broadcasting nodes whose output ends in an axis of 1 given
    the output's rank (module docstring; a copy), or ``model`` itself when no node has such an operand."""
    if not _may_apply(model):
        return model
    types = typed()
    plans = {k: p for k, n in enumerate(model.graph.node) if (p := _plan(n, types)) is not None}
    if not plans:
        return model
    g = model.graph
    wanted = {g.node[k].input[i] for k, p in plans.items() for i in p}
    constants = constant_arrays(g, wanted, fed_initializers(model))
    opset = model_opset(model)
    made: dict[tuple[str, int], str] = {}  # (value, rank) → its name at that rank

    def raised(name: str, have: int, rank: int, names: NameGen, out: onnx.ModelProto,
               before: list[onnx.NodeProto]) -> str:
        key = (name, rank)
        if key in made:
            return made[key]
        new = names(f"{name}/rank{rank}")
        if name in constants:
            value = constants[name]
            lifted = value.reshape((1,) * (rank - have) + value.shape)
            out.graph.initializer.append(numpy_helper.from_array(lifted, new))
        else:
            axes = list(range(rank - have))
            node_name = names(f"{new}/Unsqueeze")
            if opset >= _AXES_AS_INPUT:
                axes_name = names(f"{new}/axes")
                out.graph.initializer.append(numpy_helper.from_array(np.array(axes, np.int64), axes_name))
                before.append(helper.make_node("Unsqueeze", [name, axes_name], [new], name=node_name))
            else:
                before.append(helper.make_node("Unsqueeze", [name], [new], name=node_name, axes=axes))
        made[key] = new
        return new

    def replace(k: int, n: onnx.NodeProto, names: NameGen, out: onnx.ModelProto) -> list[onnx.NodeProto]:
        rank = len(static_shape(types, n.output[0]) or ())
        before: list[onnx.NodeProto] = []
        inputs = list(n.input)
        for i, have in plans[k].items():
            inputs[i] = raised(inputs[i], have, rank, names, out, before)
        node = onnx.NodeProto()
        node.CopyFrom(n)
        del node.input[:]
        node.input.extend(inputs)
        return [*before, node]

    out = with_nodes_replaced(model, plans, replace)
    drop_unread(out.graph, set(constants))  # constants only the rewritten nodes read
    return out
