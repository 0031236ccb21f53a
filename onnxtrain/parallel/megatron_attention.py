"""Horizontal (Megatron) parallelism of self-attention: the heads split over the ranks.

An attention block reads its input x through products by weights (Q, K and V, or one fused QKV
product whose output a ``Split`` cuts in three), reshapes them into heads, and ends in one output
projection. With H ranks, rank r keeps the columns of each projection (of each of a fused product's three
parts) that make its heads ``[r·heads/H, (r+1)·heads/H)``, and the same rows of the output projection: its
projection is one addend of the block's output, summed over the ranks as an MLP block's is
(:mod:`onnxtrain.parallel.megatron`). The head count in each ``Reshape`` is cut to the rank's share, whether
its shape is a constant or computed from ``Shape`` at run time.

Between the products and the output projection, the block may hold ``Reshape``, ``Transpose``, products of
two of its own values (the scores, the weighted values), ONNX's ``Attention`` op on the heads (opset 23:
torch's export of ``scaled_dot_product_attention``), ``Softmax`` over an axis other than the heads',
elementwise nodes whose other inputs broadcast over the heads (the scale, a causal mask) and ``Dropout``
(each rank draws its heads' mask with its own seed, given by the session). The axis that holds the heads
is followed through them on the shapes of one forward run at a small batch; anything else leaves the
attention whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import onnx
from onnx import helper

from onnxtrain.parallel.megatron import ELEMENTWISE, GraphIndex, Share, constant_value, walk_block

_BROADCAST = ELEMENTWISE | {"Where", "Max", "Min"}
_PROBE_DIM = 3  # the size of every free dimension (batch, ...) in the forward run that finds the shapes


@dataclass(frozen=True)
class AttentionBlock:
    """Where one split attention sits in the graph (node indices), and what shrinks in it."""

    x: str
    entries: tuple[int, ...]  # the products reading x
    second: int  # the output projection
    columns: tuple[Share, ...]  # the projections' weights and biases, split by output features
    rows: Share  # the output projection's weight, split by input features
    reshapes: tuple[tuple[int, int, int], ...]  # (Reshape node, its output's heads axis, the full size there)
    splits: tuple[int, ...]  # the Splits of a fused QKV product
    heads: tuple[int, ...] = ()  # ONNX Attention nodes on 3-D inputs: their head counts shrink


def find_attention_blocks(
    model: onnx.ModelProto, trainable: list[str], size: int, taken: set[int] = frozenset()
) -> list[AttentionBlock]:
    """The attention blocks of ``model`` that split over ``size`` ranks, in graph order; ``taken``: node
    indices of products already in other blocks."""
    ix = GraphIndex(model, trainable)
    groups = {x: ks for x, ks in ix.products_by_input(taken).items() if _reaches_reshape(ix, ks)}
    if not groups:  # no heads anywhere: spare the forward run
        return []
    shapes = probe_shapes(model)
    if shapes is None:
        return []
    blocks = []
    for x, entries in groups.items():
        b = _attention(ix, shapes, x, entries, size)
        if b is not None and taken.isdisjoint((*b.entries, b.second)):
            blocks.append(b)
            taken = {*taken, *b.entries, b.second}
    return sorted(blocks, key=lambda b: min(b.entries))


def _is_exit(ix: GraphIndex, r: int, v: str) -> bool:
    """Node ``r`` is a product of ``v`` by a weight: where an attention block ends."""
    n = ix.nodes[r]
    return n.op_type in ("MatMul", "Gemm") and n.input[0] == v and ix.product(r) is not None


def _reaches_reshape(ix: GraphIndex, entries: list[int]) -> bool:
    """The products ``entries`` flow into a ``Reshape`` (or ONNX's ``Attention``, which reshapes 3-D inputs
    itself) before the next product: heads, possibly."""
    walked = walk_block(ix, [ix.nodes[k].output[0] for k in entries], partial(_is_exit, ix), lambda r: True)
    return walked is not None and any(ix.nodes[r].op_type in ("Reshape", "Attention") for r in walked[0])


def probe_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]] | None:
    """The shape of every tensor of ``model`` in one forward run on zeros, free dimensions set to 3; None
    when the model does not run so (then nothing splits)."""
    from onnxtrain.engine.plan import Plan  # the engine imports parallel: import it when needed

    inferred = onnx.shape_inference.infer_shapes(model)
    known = {v.name: v for v in inferred.graph.value_info if v.type.HasField("tensor_type")}
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    produced = [o for n in model.graph.node for o in n.output if o in known]
    probe.graph.output.extend(known[o] for o in produced)
    feeds = {}
    inits = {t.name for t in model.graph.initializer}
    for v in model.graph.input:
        if v.name in inits:
            continue
        t = v.type.tensor_type
        if not v.type.HasField("tensor_type") or not t.HasField("shape"):
            return None
        dims = [d.dim_value if d.HasField("dim_value") else _PROBE_DIM for d in t.shape.dim]
        feeds[v.name] = np.zeros(dims, onnx.helper.tensor_dtype_to_np_dtype(t.elem_type))
    try:
        values = Plan(probe, fuse=False).run(feeds, produced)
    except Exception:  # a model that does not run on zeros keeps its attention whole
        return None
    shapes = {name: tuple(np.shape(v)) for name, v in zip(produced, values)}
    shapes.update({k: v.shape for k, v in feeds.items()})
    shapes.update({t.name: tuple(t.dims) for t in model.graph.initializer})
    return shapes


def _attention(
    ix: GraphIndex, shapes: dict[str, tuple[int, ...]], x: str, entries: list[int], size: int
) -> AttentionBlock | None:
    """The attention block opened by the products ``entries`` of ``x``, or None."""
    nodes = ix.nodes
    axis: dict[str, int] = {}  # a value of the block → the axis that holds its heads
    columns: list[Share] = []
    splits: list[int] = []
    inside: set[int] = set()
    for k in entries:
        w, w_axis = ix.product(k)
        f = int(ix.inits[w].dims[w_axis])
        opened = ix.start(k, f)
        if opened is None or opened[0] not in shapes:
            return None
        start, bias = opened
        last = len(shapes[start]) - 1
        segments: tuple[int, ...] = (f,)
        reads = ix.readers.get(start, [])
        if len(reads) == 1 and nodes[reads[0]].op_type == "Split":
            sizes = _split_sizes(ix, reads[0], f, last)
            if sizes is None:
                return None
            segments = sizes
            splits.append(reads[0])
            inside.add(reads[0])
            axis.update({o: last for o in nodes[reads[0]].output})
        else:
            axis[start] = last
        if any(s % size or s < size for s in segments):
            return None
        columns += [(w, w_axis, segments), *(((bias, 0, segments),) if bias else ())]

    # the block's nodes: every reader of its values up to the output projection
    walked = walk_block(ix, list(axis), partial(_is_exit, ix), lambda r: True)
    if walked is None:
        return None
    found, exits, _ = walked
    inside |= found
    if len(exits) != 1:
        return None
    (second,) = exits
    reshapes, heads = [], []
    for r in sorted(inside - set(splits)):
        if not _heads_axis(ix, shapes, r, axis, size):
            return None
        if nodes[r].op_type == "Reshape":
            k = axis[nodes[r].output[0]]
            reshapes.append((r, k, shapes[nodes[r].output[0]][k]))
        if nodes[r].op_type == "Attention" and len(shapes[nodes[r].input[0]]) == 3:
            heads.append(r)
    if not reshapes and not heads:  # no heads: an MLP block's shape, found by onnxtrain.parallel.megatron
        return None
    v = nodes[second].input[0]
    w2, w2_out = ix.product(second)
    d = shapes[v][axis[v]] if v in axis else -1
    if v not in axis or axis[v] != len(shapes[v]) - 1 or int(ix.inits[w2].dims[1 - w2_out]) != d:
        return None
    return AttentionBlock(
        x,
        tuple(entries),
        second,
        tuple(columns),
        (w2, 1 - w2_out, (d,)),
        tuple(reshapes),
        tuple(splits),
        tuple(heads),
    )


def _split_sizes(ix: GraphIndex, k: int, f: int, last: int) -> tuple[int, ...] | None:
    """The sizes a fused product's ``Split`` cuts its ``f`` output features into, or None."""
    n = ix.nodes[k]
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    if attrs.get("axis", 0) not in (last, -1):
        return None
    if len(n.input) > 1 and n.input[1]:
        try:
            sizes = tuple(int(v) for v in constant_value(ix.graph, n.input[1]))
        except KeyError:
            return None
    elif "split" in attrs:
        sizes = tuple(attrs["split"])
    else:
        sizes = (f // len(n.output),) * len(n.output)
    return sizes if sum(sizes) == f and len(sizes) == len(n.output) else None


def _heads_axis(
    ix: GraphIndex, shapes: dict[str, tuple[int, ...]], r: int, axis: dict[str, int], size: int
) -> bool:
    """Follow the heads' axis through node ``r`` (its outputs' axes into ``axis``); False when the node does
    not keep the heads apart."""
    n = ix.nodes[r]
    if any(o not in shapes for o in n.output if o):
        return False
    ins = [i for i in n.input if i in axis]
    out = n.output[0]
    ro = len(shapes[out])
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    if n.op_type == "Reshape":
        if ins != [n.input[0]]:
            return False
        src, a = shapes[n.input[0]], axis[n.input[0]]
        inner = int(np.prod(src[a:]))
        dst = shapes[out]
        k = next(
            (
                j
                for j in range(ro)
                if int(np.prod(dst[j:])) == inner and dst[j] % size == 0 and dst[j] >= size
            ),
            None,
        )
        if k is None or src[a] % size:
            return False
        axis[out] = k
        return True
    if n.op_type == "Transpose":
        perm = list(attrs.get("perm", range(ro - 1, -1, -1)))
        axis[out] = perm.index(axis[n.input[0]])
        return True
    if n.op_type == "MatMul":
        if len(ins) != 2:
            return False
        aligned = {ro - len(shapes[i]) + axis[i] for i in ins}
        if len(aligned) != 1 or next(iter(aligned)) >= ro - 2:
            return False
        axis[out] = aligned.pop()
        return True
    if n.op_type == "Attention":
        return _attention_node(ix, shapes, n, axis, attrs, size)
    if n.op_type in ("Softmax", "LogSoftmax"):
        a = axis[n.input[0]]
        if attrs.get("axis", -1) % ro == a:
            return False
        axis[out] = a
        return True
    if n.op_type not in _BROADCAST:  # a Dropout too: each rank drops on its heads (its own seed)
        return False
    aligned = {ro - len(shapes[i]) + axis[i] for i in ins}
    if len(aligned) != 1:
        return False
    a = aligned.pop()
    for i in n.input:
        if not i or i in axis:
            continue
        if i in ix.wanted or i not in shapes:
            return False  # a trained input would need its gradient summed over the ranks
        s = shapes[i]
        p = a - (ro - len(s))
        if p >= 0 and s[p] != 1:
            return False  # it varies along the heads
    for o in n.output:
        if o:
            axis[o] = a
    return True


def _attention_node(
    ix: GraphIndex,
    shapes: dict[str, tuple[int, ...]],
    n: onnx.NodeProto,
    axis: dict[str, int],
    attrs: dict,
    size: int,
) -> bool:
    """ONNX's ``Attention`` (opset 23) on Q, K and V with their heads on axis 1 of 4-D inputs, or packed in
    the last axis of 3-D ones (counted by ``q_num_heads`` and ``kv_num_heads``, which each rank's share
    divides by the ranks): each rank attends with its own heads (grouped key/value heads split alike, so
    each query head keeps its group). Refused: past keys and values, outputs besides Y, a trained mask or
    one that varies along the heads."""
    q, k, v = n.input[:3]
    rank = len(shapes[q]) if q in shapes else 0
    if rank not in (3, 4) or any(i not in axis or len(shapes[i]) != rank for i in (q, k, v)):
        return False
    heads_axis = 1 if rank == 4 else 2
    if any(axis[i] != heads_axis for i in (q, k, v)) or any(n.input[4:]) or any(n.output[1:]):
        return False
    counts = [attrs.get("q_num_heads", 0), attrs.get("kv_num_heads", 0)]
    if rank == 3 and any(c < size or c % size for c in counts):
        return False
    mask = n.input[3] if len(n.input) > 3 else ""
    if mask:
        if mask in axis or mask in ix.wanted or mask not in shapes:
            return False
        s = shapes[mask]
        if len(s) >= 3 and s[len(s) - 3] != 1:  # aligned with (batch, heads, queries, keys) from the right
            return False
    axis[n.output[0]] = heads_axis
    return True
