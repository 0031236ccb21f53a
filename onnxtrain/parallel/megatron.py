"""Horizontal (Megatron) parallelism: an MLP block's two products split over the ranks.

A block is ``x → first product (+ b1) → an elementwise activation → second product (+ b2)``, the two products
``MatMul`` or ``Gemm`` nodes with weights W1 (d → f) and W2 (f → d), trained or frozen (a frozen share is
cut as a trained one is and gets no update), the activation made of elementwise nodes whose other inputs
are scalar constants (ReLU, the exported GELU's Div/Erf/Add/Mul chain, Tanh, ...), read by nothing else.
With H ranks, rank r keeps columns ``[r·f/H, (r+1)·f/H)`` of W1 and b1 (``<w>_column_rank_<r>``) and the
same rows of W2 (``<w>_row_rank_<r>``): its second product is then one addend of the block's output, which
the ranks sum (onnxruntime's ``MegatronG``); the gradient reaching the block's input is summed the same
way (``MegatronF``). Blocks whose hidden size does not divide by H, or whose weights are read elsewhere,
stay whole on every rank, as other layers do. A gated MLP (SwiGLU: several first products of x, of one
width, meeting through elementwise nodes in the second product) splits the same way, each first product
by its columns.

:func:`shard_blocks` returns the rank's model and the cuts around each block: an ``Identity`` of the block's
input (F), the second product's output (G). :mod:`onnxtrain.session_horizontal` runs the pieces between.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxtrain.ir.attrs import attribute_value
from onnxtrain.ir.builder import FLOAT_TYPES
from onnxtrain.ir.graphs import node_reads
from onnxtrain.parallel.pipeline import CutEdge

ELEMENTWISE = frozenset(
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


Share = tuple[str, int, tuple[int, ...]]  # a split weight: (name, split axis, its segments' sizes)


class SplitWeight(NamedTuple):
    """A weight split over the ranks: this rank's share's name, the split axis, 0 columns / 1 rows, and the
    sizes of the axis's segments (a fused QKV weight's three), each split on its own."""

    share: str
    axis: int
    row: int
    segments: tuple[int, ...]


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

    @property
    def entries(self) -> tuple[int, ...]:
        """The products reading the block's input."""
        return (self.first,)

    @property
    def columns(self) -> tuple[Share, ...]:
        """The weights split by output features."""
        seg = (self.hidden,)
        return ((self.w1, self.w1_axis, seg), *(((self.b1, 0, seg),) if self.b1 else ()))

    @property
    def rows(self) -> Share:
        """The second product's weight, split by input features."""
        return (self.w2, self.w2_axis, (self.hidden,))

    reshapes: tuple[tuple[int, int, int], ...] = ()  # (Reshape node, axis of its output, full size there)
    splits: tuple[int, ...] = ()  # Split nodes whose sizes are cut to a share


class GraphIndex:
    """Who reads and makes each value of ``model``, its initializers, and the scalar constants."""

    def __init__(self, model: onnx.ModelProto, trainable: list[str]):
        g = self.graph = model.graph
        self.nodes = list(g.node)
        self.inits = {t.name: t for t in g.initializer}
        self.readers: dict[str, list[int]] = {}
        for k, n in enumerate(self.nodes):
            for i in dict.fromkeys(x for x in node_reads(n) if x):
                self.readers.setdefault(i, []).append(k)
        self.wanted = set(trainable)
        # a block's weights may be frozen: a frozen share is cut as a trained one is and gets no update
        self.frozen = {
            t.name for t in g.initializer if t.name not in self.wanted and t.data_type in FLOAT_TYPES
        }
        # constants an activation may read: one value, not trained (a trained one would need its gradient
        # summed)
        self.scalars = {
            t.name: numpy_helper.to_array(t)
            for t in g.initializer
            if int(np.prod(t.dims)) == 1 and t.name not in self.wanted
        }
        for n in self.nodes:
            value = n.attribute[0].t if n.op_type == "Constant" and n.attribute[0].name == "value" else None
            if value is not None and int(np.prod(value.dims)) == 1:
                self.scalars[n.output[0]] = numpy_helper.to_array(value)
        self.outputs = {o.name for o in g.output}
        self.made_by = {o: n for n in self.nodes for o in n.output if o}

    def weight(self, name: str, rank: int) -> bool:
        """``name`` is a weight (trained or frozen) of ``rank`` dimensions read by one node."""
        return (
            (name in self.wanted or name in self.frozen)
            and name in self.inits
            and len(self.inits[name].dims) == rank
            and len(self.readers.get(name, [])) == 1
        )

    def product(self, k: int) -> tuple[str, int] | None:
        return product_weight(self.nodes[k], self.weight, self.made_by, self.readers)

    def products_by_input(self, taken: Iterable[int] = ()) -> dict[str, list[int]]:
        """The products by weights not in ``taken``, grouped by the value they read (graph order)."""
        skip = set(taken)
        groups: dict[str, list[int]] = {}
        for k, n in enumerate(self.nodes):
            if k not in skip and self.product(k) is not None:
                groups.setdefault(n.input[0], []).append(k)
        return groups

    def start(self, k: int, f: int) -> tuple[str, str | None] | None:
        """The value a product's output features start from (after its bias) and that bias; None when the
        product has a bias that cannot split with it."""
        n = self.nodes[k]
        start, bias = n.output[0], gemm_bias(n, f, self.weight, self.inits)
        if bias == "?":  # a Gemm bias that is not an [f] weight vector read here alone
            return None
        reads = self.readers.get(start, [])
        # a product the graph also outputs stays the start (the block then stays whole: its value must be)
        if bias is None and n.op_type == "MatMul" and len(reads) == 1 and start not in self.outputs:
            add = self.nodes[reads[0]]
            other = [i for i in add.input if i != start]
            if (
                add.op_type == "Add"
                and len(other) == 1
                and self.weight(other[0], 1)
                and self.inits[other[0]].dims[0] == f
            ):
                bias, start = other[0], add.output[0]
        return start, bias


def find_mlp_blocks(model: onnx.ModelProto, trainable: list[str], size: int) -> list[MlpBlock]:
    """The blocks of ``model`` that split over ``size`` ranks, in graph order."""
    ix = GraphIndex(model, trainable)
    nodes, inits = ix.nodes, ix.inits
    blocks = []
    taken: set[int] = set()  # products already in a block: an MLP's middle layer ends one block, opens none
    for k in range(len(nodes)):
        first = ix.product(k) if k not in taken else None
        if first is None:
            continue
        w1, w1_axis = first
        f = int(inits[w1].dims[w1_axis])
        opened = ix.start(k, f)
        if opened is None:
            continue
        start, b1 = opened
        region = _region_exit(ix, [start])
        if region is None:
            continue
        second, values = region
        prod = ix.product(second)
        if prod is None or nodes[second].input[0] not in values:
            continue
        w2, w2_out = prod
        w2_axis = 1 - w2_out
        if int(inits[w2].dims[w2_axis]) != f or f % size or f < size:
            continue
        blocks.append(MlpBlock(nodes[k].input[0], k, second, w1, w1_axis, b1, w2, w2_axis, f))
        taken.update((k, second))
    blocks += _gated_blocks(ix, size, taken)
    return sorted(blocks, key=lambda b: min(b.entries))


@dataclass(frozen=True)
class GatedMlpBlock:
    """A gated MLP (SwiGLU, GeGLU): several first products of one input, of the same width, combined by
    elementwise nodes into the second product's input; each first product splits as an MLP's does."""

    x: str
    entries: tuple[int, ...]  # the first products
    second: int
    columns: tuple[Share, ...]
    rows: Share
    reshapes: tuple[tuple[int, int, int], ...] = ()
    splits: tuple[int, ...] = ()


def _gated_blocks(ix: GraphIndex, size: int, taken: set[int]) -> list[GatedMlpBlock]:
    """The gated MLP blocks among the products not ``taken`` (updated with theirs)."""
    inits = ix.inits
    blocks = []
    for x, entries in ix.products_by_input(taken).items():
        if len(entries) < 2:
            continue
        columns: list[Share] = []
        starts = []
        widths = set()
        for k in entries:
            w, w_axis = ix.product(k)
            f = int(inits[w].dims[w_axis])
            opened = ix.start(k, f)
            if opened is None:
                break
            starts.append(opened[0])
            widths.add(f)
            columns += [(w, w_axis, (f,)), *(((opened[1], 0, (f,)),) if opened[1] else ())]
        else:
            block = _gated(ix, x, entries, starts, widths, columns, size)
            if block is not None and taken.isdisjoint((*block.entries, block.second)):
                blocks.append(block)
                taken.update((*block.entries, block.second))
    return blocks


def _gated(ix: GraphIndex, x: str, entries: list[int], starts: list[str], widths: set[int],
           columns: list[Share], size: int) -> GatedMlpBlock | None:
    """The gated block from the first products ``entries`` of ``x``, or None when their values do not meet
    (elementwise, on each other and scalar constants) in one second product of their width."""
    if len(widths) != 1:
        return None
    (f,) = widths
    if f % size or f < size:
        return None
    region = _region_exit(ix, starts)
    if region is None:
        return None
    second = region[0]
    prod = ix.product(second)
    if prod is None:
        return None
    w2, w2_out = prod
    if int(ix.inits[w2].dims[1 - w2_out]) != f:
        return None
    return GatedMlpBlock(x, tuple(entries), second, tuple(columns), (w2, 1 - w2_out, (f,)))


def shard_blocks(
    model: onnx.ModelProto, blocks: Sequence[Any], rank: int, size: int
) -> tuple[onnx.ModelProto, list[list[CutEdge]], dict[str, SplitWeight]]:
    """Rank ``rank``'s model: each block's weights cut to its share, an ``Identity`` before each block (the F
    cut), the second product's bias moved after its output (the G cut), an attention block's head counts
    cut to the rank's heads. Returns the model, the cuts in graph order (F, G, F, G, ...) and the split
    weights. ``blocks``: :class:`MlpBlock` s and attention blocks, in graph order."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    inits = {t.name: t for t in g.initializer}
    split: dict[str, SplitWeight] = {}
    before: dict[int, list[onnx.NodeProto]] = {}
    after: dict[int, list[onnx.NodeProto]] = {}
    cuts: list[list[CutEdge]] = []
    for b_index, b in enumerate(blocks):
        for (w, axis, segments), row in (*((c, 0) for c in b.columns), (b.rows, 1)):
            name = share_name(w, row, rank)
            part = take_share(numpy_helper.to_array(inits[w]), axis, rank, size, segments)
            inits[w].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(part), name))
            split[w] = SplitWeight(name, axis, row, segments)
        second = g.node[b.second]
        entry = f"{b.x}_megatron_f{b_index}"
        before.setdefault(min(b.entries), []).append(
            helper.make_node("Identity", [b.x], [entry], name=f"MegatronF_{b_index}")
        )
        for k in b.entries:
            g.node[k].input[0] = entry
        for k in b.splits:
            _shrink_split(g, g.node[k], size)
        for k, axis, full in b.reshapes:
            before.setdefault(k, []).extend(_shrink_reshape(g, g.node[k], axis, full // size))
        for k in getattr(b, "heads", ()):  # 3-D Attention: the rank's share of the head counts
            for a in g.node[k].attribute:
                if a.name in ("q_num_heads", "kv_num_heads"):
                    a.i //= size
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
    # the shapes declared for the blocks' values (an exporter's value_info) are the whole model's: dropped,
    # the shares' are inferred again
    spans = [range(min(b.entries), b.second + 1) for b in blocks]
    inside = {o for r in spans for k in r for o in g.node[k].output}
    kept = [v for v in g.value_info if v.name not in inside]
    del g.value_info[:]
    g.value_info.extend(kept)
    nodes = []
    for k, n in enumerate(g.node):
        for j, i in enumerate(n.input):  # the split weights under their shares' names
            if i in split:
                n.input[j] = split[i].share
        nodes += [*before.get(k, ()), n, *after.get(k, ())]
    del g.node[:]
    g.node.extend(nodes)
    return out, cuts, split


def _shrink_split(g: onnx.GraphProto, n: onnx.NodeProto, size: int) -> None:
    """A Split of a fused product's output: each part's size cut to a share."""
    for a in n.attribute:
        if a.name == "split":
            a.ints[:] = [v // size for v in a.ints]
    if len(n.input) > 1 and n.input[1]:
        sizes = constant_value(g, n.input[1]) // size
        name = f"{n.output[0]}_megatron_sizes"
        g.initializer.append(numpy_helper.from_array(sizes.astype(np.int64), name))
        n.input[1] = name


def _shrink_reshape(g: onnx.GraphProto, n: onnx.NodeProto, axis: int, share: int) -> list[onnx.NodeProto]:
    """A Reshape whose output's ``axis`` holds the heads (or their features): that entry of its shape set to
    the rank's share, whether the shape is a constant or computed at run time."""
    base = n.output[0]
    where, value, shape = f"{base}_megatron_axis", f"{base}_megatron_share", f"{base}_megatron_shape"
    g.initializer.extend(
        [
            numpy_helper.from_array(np.array([axis], np.int64), where),
            numpy_helper.from_array(np.array([share], np.int64), value),
        ]
    )
    node = helper.make_node("ScatterElements", [n.input[1], where, value], [shape], name=f"{base}_megatron")
    n.input[1] = shape
    return [node]


def constant_value(g: onnx.GraphProto, name: str) -> np.ndarray:
    """The value of initializer or ``Constant`` output ``name``."""
    for t in g.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    for n in g.node:
        if n.op_type == "Constant" and n.output[0] == name:
            return np.asarray(attribute_value(n.attribute[0]))
    raise KeyError(name)


def share_name(weight: str, row: int, rank: int) -> str:
    """onnxruntime's name of rank ``rank``'s share of a split weight (``row``: 1 rows, 0 columns)."""
    return f"{weight}_{'row' if row else 'column'}_rank_{rank}"


def take_share(
    full: np.ndarray, axis: int, rank: int, size: int, segments: Sequence[int] = ()
) -> np.ndarray:
    """Rank ``rank``'s share of ``full`` split along ``axis`` into ``size`` equal parts (of each segment in
    turn, when ``segments`` lists more than one)."""
    bounds = np.cumsum([0, *(segments or (full.shape[axis],))])
    picked = [
        np.arange(lo + rank * ((hi - lo) // size), lo + (rank + 1) * ((hi - lo) // size))
        for lo, hi in zip(bounds[:-1], bounds[1:])
    ]
    return np.take(full, np.concatenate(picked), axis=axis)


def join_shares(shares: Sequence[np.ndarray], axis: int, segments: Sequence[int] = ()) -> np.ndarray:
    """The whole weight from every rank's share (:func:`take_share` undone)."""
    if len(segments) <= 1:
        return np.concatenate(shares, axis=axis)
    size = len(shares)
    pieces = [np.split(s, np.cumsum([v // size for v in segments])[:-1], axis=axis) for s in shares]
    return np.concatenate([p[j] for j in range(len(segments)) for p in pieces], axis=axis)


def product_weight(
    n: onnx.NodeProto,
    weight: Callable[[str, int], bool],
    made_by: dict[str, onnx.NodeProto],
    readers: dict[str, list[int]] | None = None,
) -> tuple[str, int] | None:
    """(weight, its output-feature axis) of a product by a 2-D weight: ``MatMul(x, W)``,
    ``MatMul(x, Transpose(W))`` (torch's export of ``nn.Linear``; with ``readers``, a Transpose this product
    alone reads) or a plain ``Gemm(x, W[, C])`` (no transposed x, unit alpha and beta)."""
    if n.op_type == "MatMul" and len(n.input) == 2:
        if weight(n.input[1], 2):
            return n.input[1], 1
        t = made_by.get(n.input[1])
        perm = [list(a.ints) for a in t.attribute if a.name == "perm"] if t is not None else []
        if t is not None and t.op_type == "Transpose" and perm in ([], [[1, 0]]) and weight(t.input[0], 2):
            if readers is not None and len(readers.get(n.input[1], [])) != 1:
                return None  # the transposed weight feeds other nodes too: it cannot be cut for this one
            return t.input[0], 0
        return None
    if n.op_type == "Gemm" and weight(n.input[1], 2):
        a = {x.name: x for x in n.attribute}
        if a.get("transA") and a["transA"].i or any(x in a and a[x].f != 1.0 for x in ("alpha", "beta")):
            return None
        return n.input[1], 0 if a.get("transB") and a["transB"].i else 1
    return None


def gemm_bias(n: onnx.NodeProto, f: int, weight, inits: dict[str, onnx.TensorProto]) -> str | None:
    if n.op_type == "Gemm" and len(n.input) > 2 and n.input[2]:
        c = n.input[2]
        return c if weight(c, 1) and inits[c].dims[0] == f else "?"
    return None


def walk_block(
    ix: GraphIndex, starts: Iterable[str], is_exit: Callable[[int, str], bool], admit: Callable[[int], bool]
) -> tuple[set[int], set[int], set[str]] | None:
    """Every node reading the values from ``starts`` on, up to the nodes ``is_exit(node, value)`` picks:
    ``(inside, exits, values)``; None when a value is a graph output or a node inside is not ``admit``-ted."""
    values = set(starts)
    todo, exits, inside = list(values), set(), set()
    while todo:
        v = todo.pop()
        if v in ix.outputs:
            return None
        for r in ix.readers.get(v, []):
            if is_exit(r, v):
                exits.add(r)
            elif not admit(r):
                return None
            elif r not in inside:
                inside.add(r)
                for o in ix.nodes[r].output:
                    if o and o not in values:
                        values.add(o)
                        todo.append(o)
    return inside, exits, values


def _region_exit(ix: GraphIndex, starts: Iterable[str]) -> tuple[int, set[str]] | None:
    """The one product the activation starting at ``starts`` (a gated MLP's several) flows into, and the
    activation's values, if everything between is elementwise on its own values and scalar constants and read
    nowhere else; else None."""
    nodes = ix.nodes

    def admit(r: int) -> bool:
        n = nodes[r]
        return n.op_type in ELEMENTWISE  # a Dropout too: each rank drops on its share (its own seed)

    def is_exit(r: int, v: str) -> bool:
        return nodes[r].op_type in ("MatMul", "Gemm") and nodes[r].input[0] == v

    walked = walk_block(ix, starts, is_exit, admit)
    if walked is None:
        return None
    inside, exits, values = walked
    if any(not all(i in values or i in ix.scalars or not i for i in nodes[r].input) for r in inside):
        return None  # the activation reads something besides itself and constants
    return (exits.pop(), values) if len(exits) == 1 else None

