"""A Sum of zero Pads that lay pieces side by side, rewritten for onnxruntime as one Concat.

The gradient of q, k and v gathered from one projection (torch's ``nn.MultiheadAttention`` export) is each
piece padded with zeros back to the projection's shape, and the three summed. onnxruntime writes the three
pads and reads them back: 1.3 ms per layer of the transformer encoder's training step (three Pads of 250 µs,
a Sum of 440–590 µs) for what a Concat writes once. Where the pads can be read before a run
(:class:`~onnxtrain.ir.shape_values.ShapeValues`), pad along one axis only, tile it exactly (sorted by their
start, each piece ends where the next starts, the first at 0, the last at the end) and the pieces' other
dims are known equal, the Sum becomes ``Concat(pieces, axis)``. The same values, except that a −0.0 in a
piece stays −0.0 where the Sum's added zeros made it +0.0. The Pads and the constants only they read go.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper

from onnxtrain.ir.builder import model_opset
from onnxtrain.ir.graphs import DEFAULT_DOMAINS, constant_arrays, drop_unread, fed_initializers, node_reads
from onnxtrain.ir.shape_values import ShapeValues, unknown
from onnxtrain.ir.types import symbolic_shape

# what computes a Pad's pads from constants and shapes
_SHAPE_OPS = {"Constant", "Concat", "Unsqueeze", "Squeeze", "Reshape", "Cast", "Identity", "Gather", "Shape",
              "Slice", "Add", "Sub", "Mul", "Div", "Mod", "ConstantOfShape"}


def pads_as_concat(model: onnx.ModelProto, typed: Callable[[], dict]) -> onnx.ModelProto:
    """``model`` with each Sum of tiling zero Pads as a Concat (a copy), or ``model`` itself."""
    g = model.graph
    made_by = {o: n for n in g.node for o in n.output}
    sums = [n for n in g.node if n.op_type == "Sum" and n.domain in DEFAULT_DOMAINS and len(n.input) > 1
            and all(made_by.get(i) is not None and made_by[i].op_type == "Pad" for i in n.input)]
    if not sums or model_opset(model) < 11:  # pads as an input from opset 11
        return model
    types = typed()
    fed = fed_initializers(model)  # a value a run may feed is no constant
    values = ShapeValues(model, types, model_opset(model), fed)
    zeros = constant_arrays(g, {made_by[i].input[2] for n in sums for i in n.input
                                if len(made_by[i].input) > 2 and made_by[i].input[2]}, fed)
    readers: dict[str, int] = {}
    for n in g.node:
        for i in node_reads(n):
            readers[i] = readers.get(i, 0) + 1
    outputs = {o.name for o in g.output}
    plans: dict[str, tuple[list[str], int]] = {}  # Sum output -> (pieces in order, axis)
    for n in sums:
        pads = [made_by[i] for i in n.input]
        if any(readers.get(i, 0) != 1 or i in outputs for i in n.input):
            continue
        plan = _tiling(pads, values, zeros, types)
        if plan is not None:
            plans[n.output[0]] = plan
    if not plans:
        return model
    gone = {i for n in sums if n.output[0] in plans for i in n.input}  # the tiling Pads' outputs
    nodes = []
    for n in g.node:
        if n.op_type == "Pad" and n.output and n.output[0] in gone:
            continue
        if n.op_type == "Sum" and n.output and n.output[0] in plans:
            pieces, axis = plans[n.output[0]]
            nodes.append(helper.make_node("Concat", pieces, [n.output[0]], name=n.name or None, axis=axis))
        else:
            nodes.append(n)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    # the pads and zeros only the Pads read go, and what computed them
    drop_unread(out.graph, {x for i in gone for x in made_by[i].input[1:]}, ops=_SHAPE_OPS)
    return out


def _tiling(pads: list[onnx.NodeProto], values: ShapeValues, zeros: dict[str, np.ndarray],
            types: dict) -> tuple[list[str], int] | None:
    """(pieces sorted by start, axis) when the Pads lay their pieces side by side along one axis."""
    spans, axis, shapes = [], None, []
    for p in pads:
        mode = next((a.s for a in p.attribute if a.name == "mode"), b"constant")
        if mode not in (b"constant", "constant") or len(p.input) > 3 and p.input[3]:  # no axes input
            return None
        if len(p.input) > 2 and p.input[2] and not (p.input[2] in zeros and not np.any(zeros[p.input[2]])):
            return None
        v = values.value(p.input[1])
        if v is None or v.ndim != 1 or v.size % 2 or np.any(v < 0):
            return None
        r = v.size // 2
        used = [k for k in range(r) if v[k] or v[r + k]]
        if len(used) != 1 or axis not in (None, used[0]):
            return None
        axis = used[0]
        shape = symbolic_shape(types, p.input[0])
        if shape is None or len(shape) != r or not isinstance(shape[axis], int):
            return None
        spans.append((int(v[axis]), shape[axis], int(v[r + axis]), p.input[0]))
        shapes.append(shape)
    assert axis is not None
    others = [[d for k, d in enumerate(s) if k != axis] for s in shapes]
    if any(unknown(d) for s in others for d in s) or any(s != others[0] for s in others):
        return None
    spans.sort()
    total = spans[0][0] + spans[0][1] + spans[0][2]
    at = 0
    for begin, size, end, _ in spans:
        if begin != at or begin + size + end != total:
            return None
        at += size
    return ([piece for *_, piece in spans], axis) if at == total else None
