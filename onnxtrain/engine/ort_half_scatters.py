"""Scatters that combine values (``reduction`` add, mul, min or max) on float16 data, run by onnxruntime in
float32: its CPU provider has no float16 kernel for them, and a float16 model's gradient graph holds them
(cross-entropy's one-hot, a Gather's gradient), so the step failed to load on the onnxruntime backend.

    data32 = Cast(data, FLOAT); updates32 = Cast(updates, FLOAT)
    out    = Cast(ScatterElements / ScatterND(data32, indices, updates32), FLOAT16)

One combination per element (the one-hot) gives the same float16 values; several indices on one element
(repeated tokens of an embedding) are combined in float32 and rounded once, where the numpy engine rounds
after each. Scatters without a reduction, and those in bodies, stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
from onnx import TensorProto, helper

from onnxtrain.ir.builder import NameGen, with_nodes_replaced
from onnxtrain.ir.graphs import DEFAULT_DOMAINS

_SCATTERS = ("ScatterElements", "ScatterND")


def _combines(node: onnx.NodeProto) -> bool:
    return (node.op_type in _SCATTERS and node.domain in DEFAULT_DOMAINS
            and any(a.name == "reduction" and a.s not in (b"", b"none") for a in node.attribute))


def half_scatters_in_float32(model: onnx.ModelProto, typed: Callable[[], dict]) -> onnx.ModelProto:
    """``model`` with each combining scatter of float16 data computed in float32 (a copy), or ``model``."""
    g = model.graph
    if not any(_combines(n) for n in g.node):
        return model
    types = typed()

    def half(name: str) -> bool:
        t = types.get(name)
        return t is not None and t.tensor_type.elem_type == TensorProto.FLOAT16

    found = [k for k, n in enumerate(g.node) if _combines(n) and half(n.input[0])]
    if not found:
        return model

    def in_float32(_k: int, n: onnx.NodeProto, names: NameGen, _: onnx.ModelProto) -> list[onnx.NodeProto]:
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
            helper.make_node("Cast", [wide[2]], [n.output[0]], name=names(f"{base}_CastBack"),
                             to=TensorProto.FLOAT16),
        ]

    return with_nodes_replaced(model, found, in_float32)
