"""Horizontal (Megatron) parallelism: an MLP block's two products split over the ranks.

A block is ``x → first product (+ b1) → an elementwise activation → second product (+ b2)``, the two products
``MatMul`` or ``Gemm`` nodes with trained weights W1 (d → f) and W2 (f → d), the activation made of
elementwise nodes whose other inputs are scalar constants (ReLU, the exported GELU's Div/Erf/Add/Mul chain,
Tanh, ...), read by nothing else. With H ranks, rank r keeps columns ``[r·f/H, (r+1)·f/H)`` of W1 and b1
(``<w>_column_rank_<r>``) and the same rows of W2 (``<w>_row_rank_<r>``): its second product is then one
addend of the block's output, which the ranks sum (onnxruntime's ``MegatronG``); the gradient reaching the
block's input is summed the same way (``MegatronF``). Blocks whose hidden size does not divide by H, or
whose weights are read elsewhere, stay whole on every rank, as other layers do.

:func:`shard_blocks` returns the rank's model and the cuts around each block: an ``Identity`` of the block's
input (F), the second product's output (G). :mod:`onnxtrain.session_horizontal` runs the pieces between.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxtrain.ir.graphs import node_reads
from onnxtrain.parallel.pipeline import CutEdge

_ELEMENTWISE = frozenset(
    {
        "Relu",
        "Gelu",
        "Erf",
        "Tanh",
        "Sigmoid",
        "Sqrt",
        "Neg",
        "Abs",
        "Exp",
        "Log",
        "Softplus",
        "LeakyRelu",
        "Elu",
        "Selu",
        "Celu",
        "HardSigmoid",
        "HardSwish",
        "Mish",
        "Cast",
        "Identity",
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Pow",
        "Dropout",
    }
)


@dataclass(frozen=True)
class MlpBlock:
    """Where one split block sits in the graph."""

    x: str  # the block's input
    first: int  # node index of the first product
    second: int  # node index of the second product
    w1: str
    w1_axis: int  # W1's output-feature axis
    b1: str | None
    w2: str
    w2_axis: int  # W2's input-feature axis
    hidden: int  # f


def find_mlp_blocks(model: onnx.ModelProto, trainable: list[str], size: int) -> list[MlpBlock]:
    """The blocks of ``model`` that split over ``size`` ranks, in graph order."""
    g = model.graph
    nodes = list(g.node)
    inits = {t.name: t for t in g.initializer}
    readers: dict[str, list[int]] = {}
    for k, n in enumerate(nodes):
        for i in dict.fromkeys(x for x in node_reads(n) if x):
            readers.setdefault(i, []).append(k)
    wanted = set(trainable)
    # constants an activation may read: one value, not trained (a trained one would need its gradient summed)
    scalars = {
        t.name: numpy_helper.to_array(t)
        for t in g.initializer
        if int(np.prod(t.dims)) == 1 and t.name not in wanted
    }
    for n in nodes:
        value = n.attribute[0].t if n.op_type == "Constant" and n.attribute[0].name == "value" else None
        if value is not None and int(np.prod(value.dims)) == 1:
            scalars[n.output[0]] = numpy_helper.to_array(value)
    outputs = {o.name for o in g.output}

    def weight(name: str, rank: int) -> bool:
        return name in wanted and len(inits[name].dims) == rank and len(readers.get(name, [])) == 1

    made_by = {o: n for n in nodes for o in n.output if o}
    blocks = []
    taken: set[int] = set()  # products already in a block: an MLP's middle layer ends one block, opens none
    for k, n in enumerate(nodes):
        first = _product(n, weight, made_by) if k not in taken else None
        if first is None:
            continue
        w1, w1_axis = first
        f = int(inits[w1].dims[w1_axis])
        start, b1 = n.output[0], _gemm_bias(n, f, weight, inits)
        if b1 == "?":  # a Gemm bias that is not a trained [f] vector read here alone
            continue
        reads = readers.get(start, [])
        if b1 is None and n.op_type == "MatMul" and len(reads) == 1:
            add = nodes[reads[0]]
            other = [i for i in add.input if i != start]
            if (
                add.op_type == "Add"
                and len(other) == 1
                and weight(other[0], 1)
                and inits[other[0]].dims[0] == f
            ):
                b1, start = other[0], add.output[0]
        second = _region_exit(nodes, readers, start, scalars, outputs)
        if second is None:
            continue
        prod = _product(nodes[second], weight, made_by)
        if prod is None or nodes[second].input[0] not in _region_values(nodes, readers, start, second):
            continue
        w2, w2_out = prod
        w2_axis = 1 - w2_out
        if int(inits[w2].dims[w2_axis]) != f or f % size or f < size:
            continue
        blocks.append(MlpBlock(n.input[0], k, second, w1, w1_axis, b1, w2, w2_axis, f))
        taken.update((k, second))
    return blocks


def shard_blocks(
    model: onnx.ModelProto, blocks: list[MlpBlock], rank: int, size: int
) -> tuple[onnx.ModelProto, list[list[CutEdge]], dict[str, tuple[str, int, int]]]:
    """Rank ``rank``'s model: each block's weights cut to its share, an ``Identity`` before each block (the F
    cut), the second product's bias moved after its output (the G cut). Returns the model, the cuts in graph
    order (F, G, F, G, ...) and, for each split weight, ``(shard name, split axis, 0 column / 1 row)``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    inits = {t.name: t for t in g.initializer}
    split: dict[str, tuple[str, int, int]] = {}
    before: dict[int, list[onnx.NodeProto]] = {}
    after: dict[int, list[onnx.NodeProto]] = {}
    cuts: list[list[CutEdge]] = []
    for b_index, b in enumerate(blocks):
        for w, axis, row in ((b.w1, b.w1_axis, 0), *(((b.b1, 0, 0),) if b.b1 else ()), (b.w2, b.w2_axis, 1)):
            name = share_name(w, row, rank)
            part = take_share(numpy_helper.to_array(inits[w]), axis, rank, size)
            inits[w].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(part), name))
            split[w] = (name, axis, row)
        first, second = g.node[b.first], g.node[b.second]
        entry = f"{b.x}_megatron_f{b_index}"
        before[b.first] = [helper.make_node("Identity", [b.x], [entry], name=f"MegatronF_{b_index}")]
        first.input[0] = entry
        partial = second.output[0]
        if second.op_type == "Gemm" and len(second.input) > 2 and second.input[2]:
            partial = f"{second.output[0]}_megatron_g{b_index}"
            after[b.second] = [
                helper.make_node(
                    "Add", [partial, second.input[2]], [second.output[0]], name=f"MegatronG_{b_index}"
                )
            ]
            del second.input[2:]
            second.output[0] = partial
        cuts += [[CutEdge(entry)], [CutEdge(partial)]]
    nodes = []
    for k, n in enumerate(g.node):
        for j, i in enumerate(n.input):  # the split weights under their shares' names
            if i in split:
                n.input[j] = split[i][0]
        nodes += [*before.get(k, ()), n, *after.get(k, ())]
    del g.node[:]
    g.node.extend(nodes)
    return out, cuts, split


def share_name(weight: str, row: int, rank: int) -> str:
    """onnxruntime's name of rank ``rank``'s share of a split weight (``row``: 1 rows, 0 columns)."""
    return f"{weight}_{'row' if row else 'column'}_rank_{rank}"


def take_share(full: np.ndarray, axis: int, rank: int, size: int) -> np.ndarray:
    """Rank ``rank``'s share of ``full`` split along ``axis`` into ``size`` equal parts."""
    share = full.shape[axis] // size
    return np.take(full, np.arange(rank * share, (rank + 1) * share), axis=axis)


def _product(n: onnx.NodeProto, weight, made_by: dict[str, onnx.NodeProto]) -> tuple[str, int] | None:
    """(weight, its output-feature axis) of a product by a trained 2-D weight: ``MatMul(x, W)``,
    ``MatMul(x, Transpose(W))`` (torch's export of ``nn.Linear``) or a plain ``Gemm(x, W[, C])`` (no
    transposed x, unit alpha and beta)."""
    if n.op_type == "MatMul" and len(n.input) == 2:
        if weight(n.input[1], 2):
            return n.input[1], 1
        t = made_by.get(n.input[1])
        perm = [list(a.ints) for a in t.attribute if a.name == "perm"] if t is not None else []
        if t is not None and t.op_type == "Transpose" and perm in ([], [[1, 0]]) and weight(t.input[0], 2):
            return t.input[0], 0
        return None
    if n.op_type == "Gemm" and weight(n.input[1], 2):
        a = {x.name: x for x in n.attribute}
        if a.get("transA") and a["transA"].i or any(x in a and a[x].f != 1.0 for x in ("alpha", "beta")):
            return None
        return n.input[1], 0 if a.get("transB") and a["transB"].i else 1
    return None


def _gemm_bias(n: onnx.NodeProto, f: int, weight, inits: dict[str, onnx.TensorProto]) -> str | None:
    if n.op_type == "Gemm" and len(n.input) > 2 and n.input[2]:
        c = n.input[2]
        return c if weight(c, 1) and inits[c].dims[0] == f else "?"
    return None


def _region_values(
    nodes: list[onnx.NodeProto], readers: dict[str, list[int]], start: str, stop: int
) -> set[str]:
    values, todo = {start}, [start]
    while todo:
        v = todo.pop()
        for r in readers.get(v, []):
            if r != stop:
                for o in nodes[r].output:
                    if o and o not in values:
                        values.add(o)
                        todo.append(o)
    return values


def _region_exit(
    nodes: list[onnx.NodeProto],
    readers: dict[str, list[int]],
    start: str,
    scalars: dict[str, np.ndarray],
    outputs: set[str],
) -> int | None:
    """The one product the activation starting at ``start`` flows into, if everything between is elementwise
    on scalar constants and read nowhere else; else None."""
    values, todo, exits, inside = {start}, [start], set(), set()
    while todo:
        v = todo.pop()
        if v in outputs:
            return None
        for r in readers.get(v, []):
            n = nodes[r]
            if n.op_type in ("MatMul", "Gemm") and n.input[0] == v:
                exits.add(r)
            elif n.op_type not in _ELEMENTWISE or n.op_type == "Dropout" and not _keeps_all(n, scalars):
                return None
            elif r not in inside:
                inside.add(r)
                for o in n.output:
                    if o and o not in values:
                        values.add(o)
                        todo.append(o)
    if any(not all(i in values or i in scalars or not i for i in nodes[r].input) for r in inside):
        return None  # the activation reads something besides itself and constants
    return exits.pop() if len(exits) == 1 else None


def _keeps_all(n: onnx.NodeProto, scalars: dict[str, np.ndarray]) -> bool:
    """A Dropout that keeps everything (inference mode, or a constant ratio of 0): its ranks' shares need no
    common mask."""
    if len(n.input) < 3 or not n.input[2]:
        return True
    ratio = scalars.get(n.input[1]) if len(n.input) > 1 else None
    return ratio is not None and float(ratio.reshape(-1)[0]) == 0.0
