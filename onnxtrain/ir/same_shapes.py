"""Types of the outputs of ops whose output has its input's type and shape but that ONNX's shape inference
leaves unknown.

ONNX 1.23's inference gives ``GroupNormalization`` (18 and 21) no type at all and
``MeanVarianceNormalization`` an element type without a shape. Every value after them was then untyped too,
so the gradient rules that need a rank (InstanceNormalization) and the function bodies that need a type
(RMSNormalization, Attention) refused graphs onnxruntime trains. :func:`refined_same_shapes` gives such an
output its input's type; the next round of inference carries it on.
"""

from __future__ import annotations

import onnx
from onnx import helper

from onnxtrain.ir.graphs import DEFAULT_DOMAINS

SAME_SHAPE_OPS = frozenset({"GroupNormalization", "MeanVarianceNormalization"})


def _has_shape(t: onnx.TypeProto | None) -> bool:
    return (t is not None and t.HasField("tensor_type") and bool(t.tensor_type.elem_type)
            and t.tensor_type.HasField("shape"))


def refined_same_shapes(model: onnx.ModelProto,
                        types: dict[str, onnx.TypeProto]) -> list[onnx.ValueInfoProto]:
    """Value infos giving each untyped or unshaped output of a :data:`SAME_SHAPE_OPS` node in ``model``'s
    graph the type of the node's first input, where that one has a shape."""
    out = []
    for n in model.graph.node:
        if n.op_type not in SAME_SHAPE_OPS or n.domain not in DEFAULT_DOMAINS or not n.input or not n.output:
            continue
        x, y = types.get(n.input[0]), n.output[0]
        if y and _has_shape(x) and not _has_shape(types.get(y)):
            assert x is not None
            out.append(helper.make_value_info(y, x))
    return out


__all__ = ["SAME_SHAPE_OPS", "refined_same_shapes"]
