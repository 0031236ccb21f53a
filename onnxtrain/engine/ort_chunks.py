"""Running an elementwise graph (an optimizer's update) on the onnxruntime backend piece by piece.

onnxruntime allocates every intermediate of a run at its full size in its arena: an AdamW update of three
4096² weights held about three weight-sized intermediates a weight there (peak RSS 1,248 MiB against
onnxruntime-training's 946). When each element of every output reads only the same element of the inputs,
besides a few scalars (the learning rate, the step), the graph gives the same values run on consecutive
pieces of its flattened arrays: the plan binds each piece in place (outputs into the arrays they return) and
onnxruntime's intermediates are piece-sized.

A graph qualifies when its non-scalar values form *groups* of one static shape each: every node that reads
a value of a group is an elementwise op of :data:`ELEMENTWISE` whose other operands are scalars (one element,
rank 0 or 1), and its outputs join the group, or a reduction of :data:`REDUCTIONS` over all axes, whose
output is a *reduced* scalar (a gradient's squared norm for clipping, mixed precision's finiteness check).
Nodes reading scalars only (the bias corrections, step counts) are unrestricted. A graph with reductions or
with outputs of no group runs in two parts: its *prefix*, the nodes that compute the reduced scalars and
those outputs, runs once on the whole arrays (it reads them and outputs scalars), then the rest, which takes
the reduced scalars as inputs, runs in pieces. Each group is cut into the same number of pieces, so a run
reads and writes the same share of every group.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from dataclasses import dataclass

import onnx

from onnxtrain.ir.graphs import drop_value_info
from onnxtrain.ir.types import value_info_shape

# ops whose output element i reads input elements i only (after broadcasting a scalar operand)
ELEMENTWISE = frozenset({
    "Abs", "Add", "And", "Cast", "Ceil", "Clip", "Div", "Equal", "Erf", "Exp", "Floor", "Greater",
    "GreaterOrEqual", "Identity", "IsInf", "IsNaN", "Less", "LessOrEqual", "Log", "Max", "Min", "Mul", "Neg",
    "Not", "Or", "Pow", "Reciprocal", "Relu", "Sigmoid", "Sign", "Sqrt", "Sub", "Sum", "Tanh", "Where", "Xor",
})
# reductions to one value (over all axes, keepdims 0); a reduction of a group's values is a reduced scalar
REDUCTIONS = frozenset({"ReduceL1", "ReduceL2", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceSum",
                        "ReduceSumSquare"})
CHUNK_VALUES = 1 << 18  # values of the largest group in one piece
# values of the largest group from which a graph runs in pieces: each run of the graph costs 0.2-0.35 ms
# besides its arithmetic (the MLP's AdamW over 0.67 M values: 1.38 ms whole, 1.80 ms in two pieces), which
# pieces of a large update win back in cache hits (three 1024² weights: 22 -> 15 ms a step)
CHUNK_FROM = 1 << 20


@dataclass(frozen=True)
class ChunkLayout:
    """How a graph's inputs and outputs fall into groups: ``group`` (input or output name → its group's index)
    and each group's ``shapes``; inputs outside ``group`` are scalars. ``values``: every grouped value;
    ``reduced``: what the prefix computes, the reduced scalars the pieces read and the graph outputs of no
    group (reduced, or computed from scalars alone, as an optimizer's step counts)."""

    group: dict[str, int]
    shapes: list[list[int]]
    values: frozenset[str]
    reduced: tuple[str, ...] = ()
    reduced_infos: tuple[onnx.ValueInfoProto, ...] = ()  # their inferred types, in the same order

    @property
    def sizes(self) -> list[int]:
        return [_numel(shape) for shape in self.shapes]

    def pieces(self, count: int) -> Iterator[list[tuple[int, int]]]:
        """For each of ``count`` runs, every group's piece as (start, stop) over its flattened values."""
        sizes = self.sizes
        for i in range(count):
            yield [(n * i // count, n * (i + 1) // count) for n in sizes]


def pieces_off() -> bool:
    """Whether the environment says ``ONNXTRAIN_ORT_PIECES=0`` (for A/B runs): every update runs whole, and
    a legacy session's step as one graph (:mod:`onnxtrain.session_halves`)."""
    return os.environ.get("ONNXTRAIN_ORT_PIECES", "1") in ("0", "false", "no", "off")


def layout_for_pieces(model: onnx.ModelProto, scalar_inputs: Collection[str]) -> ChunkLayout | None:
    """The :func:`chunk_layout` of a graph that runs piece by piece: it qualifies, its largest group has
    ``CHUNK_FROM`` values or more, and the environment does not say ``ONNXTRAIN_ORT_PIECES=0`` (for A/B
    runs); else None, decided from the inputs' declared shapes before any analysis when none is that
    large."""
    if pieces_off():
        return None
    inits = {t.name for t in model.graph.initializer}
    if not any((_numel(value_info_shape(vi.type)) or 0) >= CHUNK_FROM for vi in model.graph.input
               if vi.name not in inits and vi.name not in scalar_inputs):
        return None
    layout = chunk_layout(model, scalar_inputs)
    if layout is None or max(layout.sizes, default=0) < CHUNK_FROM or piece_count(layout) < 2:
        return None
    return layout


def piece_count(layout: ChunkLayout) -> int:
    """How many runs a run of a graph of ``layout`` takes: pieces of at most ``CHUNK_VALUES`` values of its
    largest group."""
    return max(1, -(-max(layout.sizes, default=0) // CHUNK_VALUES))


def _numel(dims: list | None) -> int | None:
    if dims is None or not all(isinstance(d, int) for d in dims):
        return None
    n = 1
    for d in dims:
        n *= d
    return n


def _scalar_dims(dims: list | None) -> bool:
    """Whether ``dims`` are those of one element that broadcasts with a flat piece to the piece's shape."""
    return dims is not None and len(dims) <= 1 and _numel(dims) == 1


def _full_reduction(node: onnx.NodeProto) -> bool:
    """Whether ``node`` reduces its input over all axes to a rank-0 value."""
    attrs = {a.name: a for a in node.attribute}
    keep = attrs["keepdims"].i if "keepdims" in attrs else 1
    empty_noop = attrs["noop_with_empty_axes"].i if "noop_with_empty_axes" in attrs else 0
    return (node.op_type in REDUCTIONS and keep == 0 and not empty_noop and "axes" not in attrs
            and len([i for i in node.input if i]) == 1)


def chunk_layout(model: onnx.ModelProto, scalar_inputs: Collection[str]) -> ChunkLayout | None:
    """The groups of a graph that may run piece by piece (see the module docstring), ``scalar_inputs``
    being the inputs the same for every element; None when the graph does not qualify."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph
    except Exception:
        return None
    dims: dict[str, list | None] = {t.name: list(t.dims) for t in g.initializer}
    for vi in (*inferred.value_info, *inferred.input, *inferred.output):
        dims.setdefault(vi.name, value_info_shape(vi.type))
    parent: dict[str, str] = {}
    reduced: set[str] = set()  # values computed from a reduction of grouped values
    made: set[str] = set()  # values some node outputs
    carried: set[str] = set()  # what the prefix hands the pieces or outputs

    def root(v: str) -> str:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    shapes: dict[str, list[int]] = {}
    for vi in g.input:
        if vi.name in inits:
            continue
        if not vi.type.HasField("tensor_type"):
            return None
        d = value_info_shape(vi.type)
        if vi.name in scalar_inputs:
            if not _scalar_dims(d):
                return None
            continue
        if _numel(d) is None:
            return None
        parent[vi.name] = vi.name
        shapes[vi.name] = d
    for node in g.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            return None
        reads = [i for i in node.input if i]
        grouped = [i for i in reads if i in parent]
        outputs = [o for o in node.output if o]
        made.update(outputs)
        if not grouped:
            if any(i in reduced for i in reads):
                reduced.update(outputs)
            continue  # scalars only (the bias corrections, step counts)
        if node.domain not in ("", "ai.onnx"):
            return None
        if _full_reduction(node):
            reduced.update(outputs)
            continue
        if node.op_type not in ELEMENTWISE:
            return None
        if any(i not in parent and not _scalar_dims(dims.get(i)) for i in reads):
            return None
        carried.update(i for i in reads if i in reduced)
        top = root(grouped[0])
        for i in grouped[1:]:
            r = root(i)
            if r != top:
                if shapes[r] != shapes[top]:
                    return None
                parent[r] = top
        for o in outputs:
            parent[o] = top
    group: dict[str, int] = {}
    roots: dict[str, int] = {}
    inputs = {vi.name for vi in g.input}
    for vi in g.output:
        if vi.name in inputs or vi.name not in made:
            return None  # an input or an initializer passed through
        if vi.name not in parent:
            carried.add(vi.name)  # reduced, or computed from scalars alone: the prefix's
    for name in [*(vi.name for vi in g.input if vi.name in parent), *(vi.name for vi in g.output)]:
        if name not in parent:
            continue
        r = root(name)
        declared = dims.get(name)
        if declared is not None and declared != shapes[r]:
            return None
        group[name] = roots.setdefault(r, len(roots))
    ordered = sorted(roots, key=roots.__getitem__)
    order = {n: k for k, n in enumerate(v for node in g.node for v in node.output)}
    reduced_order = tuple(sorted(carried, key=order.__getitem__))
    infos = {vi.name: vi for vi in (*inferred.value_info, *inferred.output)}
    return ChunkLayout(group, [shapes[r] for r in ordered], frozenset(parent), reduced_order,
                       tuple(infos[r] for r in reduced_order))


def _slice(g: onnx.GraphProto, targets: Collection[str], given: Collection[str] = ()) -> list[onnx.NodeProto]:
    """The nodes of ``g`` that compute ``targets``, in graph order, taking the values ``given`` as known."""
    producer = {o: n for n in g.node for o in n.output if o}
    needed: set[int] = set()
    todo = [t for t in targets if t not in given]
    seen = set(todo)
    while todo:
        node = producer.get(todo.pop())
        if node is None or id(node) in needed:
            continue
        needed.add(id(node))
        for i in node.input:
            if i and i not in given and i not in seen:
                seen.add(i)
                todo.append(i)
    return [n for n in g.node if id(n) in needed]


def _submodel(model: onnx.ModelProto, nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
              outputs: list[onnx.ValueInfoProto], name: str) -> onnx.ModelProto:
    """A model of ``nodes`` of ``model``'s graph, with the given graph inputs and outputs, the initializers
    they read and ``model``'s opsets."""
    g = model.graph
    read = {i for n in nodes for i in n.input}
    graph = onnx.helper.make_graph(
        nodes, name, [vi for vi in inputs if vi.name in read or vi.name in {o.name for o in outputs}],
        outputs, [t for t in g.initializer if t.name in read])
    out = onnx.helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    out.producer_name = model.producer_name
    out.functions.extend(model.functions)
    made = {o for n in nodes for o in n.output}
    graph.value_info.extend(vi for vi in g.value_info if vi.name in made)
    return out


def split_models(model: onnx.ModelProto,
                 layout: ChunkLayout) -> tuple[onnx.ModelProto | None, onnx.ModelProto]:
    """The graph of ``layout`` as its prefix (None without reductions: the nodes computing
    ``layout.reduced``, run on the whole arrays) and the part run on pieces: the rest, taking the reduced
    scalars as inputs, with each grouped input and output declared flat, of one symbolic length per group,
    and the grouped intermediates' declared shapes dropped."""
    g = model.graph
    carried = list(layout.reduced_infos)
    prefix = None
    if layout.reduced:
        prefix = _submodel(model, _slice(g, layout.reduced), list(g.input), carried, f"{g.name}_prefix")
    outputs = [vi for vi in g.output if vi.name in layout.group]
    nodes = _slice(g, [vi.name for vi in outputs], given=set(layout.reduced))
    main = _submodel(model, nodes, [*g.input, *carried], outputs, g.name)
    for vi in (*main.graph.input, *main.graph.output):
        k = layout.group.get(vi.name)
        if k is None:
            continue
        shape = vi.type.tensor_type.shape
        shape.ClearField("dim")
        shape.dim.add().dim_param = f"onnxtrain_piece_{k}"
    drop_value_info(main.graph, layout.values)
    return prefix, main
