"""Scatters that combine values (``reduction`` add, mul, min or max) on float16 or bfloat16 data, run by
onnxruntime in float32: its CPU provider has no float16 kernel for most of them and no bfloat16 one for any,
and a half-precision model's gradient graph holds them (cross-entropy's one-hot, a Gather's gradient), so the
step failed on the onnxruntime backend (at load, or at its first run for a scatter inside a body).

    data32 = Cast(data, FLOAT); updates32 = Cast(updates, FLOAT)
    out    = Cast(ScatterElements / ScatterND(data32, indices, updates32), FLOAT16 or BFLOAT16)

One combination per element (the one-hot) gives the numpy engine's values: its half ops round the exact
result once too, and a float32 result of two half values rounded again to half is that (float32 has more
than twice their digits and two more). Several indices on one element (repeated tokens of an embedding) are
combined in float32 and rounded once, where the numpy engine rounds after each. The scatters of the main
graph and of If, Loop and Scan bodies (nested ones too) are rewritten; those without a reduction stay.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
from onnx import TensorProto, helper

from onnxtrain.ir.builder import NameGen, value_types
from onnxtrain.ir.graphs import DEFAULT_DOMAINS, walk_graphs

_SCATTERS = ("ScatterElements", "ScatterND")
_HALVES = (TensorProto.FLOAT16, TensorProto.BFLOAT16)


def _combines(node: onnx.NodeProto) -> bool:
    return (node.op_type in _SCATTERS and node.domain in DEFAULT_DOMAINS
            and any(a.name == "reduction" and a.s not in (b"", b"none") for a in node.attribute))


def _body_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element types of the values of ``model``'s bodies as ONNX's shape inference gives them (their
    declared inputs and outputs, and what inference adds to their value_info); empty when it fails."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # a model inference refuses: its bodies' declared types only
        inferred = model
    out: dict[str, int] = {}
    for g in list(walk_graphs(inferred.graph))[1:]:
        for v in (*g.input, *g.output, *g.value_info):
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
                out[v.name] = v.type.tensor_type.elem_type
    return out


def half_scatters_in_float32(
    model: onnx.ModelProto, typed: Callable[[], dict] | None = None
) -> onnx.ModelProto:
    """``model`` with each combining scatter of float16 or bfloat16 data computed in float32 (a copy), or
    ``model`` itself. ``typed()``: the model's value types (default: inferred from ``model``)."""
    graphs = list(walk_graphs(model.graph))
    where = [k for k, g in enumerate(graphs) if any(_combines(n) for n in g.node)]
    if not where:
        return model
    known = typed() if typed is not None else value_types(model)
    types = {name: tp.tensor_type.elem_type for name, tp in known.items() if tp.HasField("tensor_type")}
    if where != [0]:  # a body's values are not in ``typed()``
        types = {**_body_types(model), **types}

    def half(node: onnx.NodeProto) -> int | None:
        """The data's half type (the data's, the updates' or the output's, all one type), or None."""
        for name in (node.input[0], node.input[2], node.output[0]):
            et = types.get(name)
            if et is not None:
                return et if et in _HALVES else None
        return None

    if not any(_combines(n) and half(n) is not None for k in where for n in graphs[k].node):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    names = NameGen.for_model(out)
    # innermost bodies first: a graph's nodes are rebuilt (copied) after the bodies they hold are rewritten
    for g in reversed(list(walk_graphs(out.graph))):
        if not any(_combines(n) and half(n) is not None for n in g.node):
            continue
        nodes: list[onnx.NodeProto] = []
        for n in g.node:
            et = half(n) if _combines(n) else None
            nodes.extend([n] if et is None else _in_float32(n, et, names))
        del g.node[:]
        g.node.extend(nodes)
    return out


def _in_float32(n: onnx.NodeProto, et: int, names: NameGen) -> list[onnx.NodeProto]:
    """Scatter ``n`` on data of half type ``et`` as the nodes of the module docstring."""
    base = n.name or n.op_type
    data, indices, updates = n.input
    wide = [names(f"{data}/float32"), names(f"{updates}/float32"), names(f"{n.output[0]}/float32")]
    scatter = helper.make_node(n.op_type, [wide[0], indices, wide[1]], [wide[2]], name=names(base))
    scatter.attribute.extend(n.attribute)
    return [
        helper.make_node("Cast", [data], [wide[0]], name=names(f"{base}_CastData"), to=TensorProto.FLOAT),
        helper.make_node("Cast", [updates], [wide[1]], name=names(f"{base}_CastUpdates"),
                         to=TensorProto.FLOAT),
        scatter,
        helper.make_node("Cast", [wide[2]], [n.output[0]], name=names(f"{base}_CastBack"), to=et),
    ]
