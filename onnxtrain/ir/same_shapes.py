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


def _known(t: onnx.TypeProto | None) -> tuple[bool, bool]:
    """Whether ``t`` is a tensor type with an element type, and whether it has a shape too."""
    typed = t is not None and t.HasField("tensor_type") and bool(t.tensor_type.elem_type)
    return typed, typed and t is not None and t.tensor_type.HasField("shape")


def refined_same_shapes(model: onnx.ModelProto,
                        types: dict[str, onnx.TypeProto]) -> list[onnx.ValueInfoProto]:
    """Value infos giving each output of a :data:`SAME_SHAPE_OPS` node in ``model``'s graph the type of the
    node's first input where the input's type says more (an element type, or a shape too)."""
    out = []
    for n in model.graph.node:
        if n.op_type not in SAME_SHAPE_OPS or n.domain not in DEFAULT_DOMAINS or not n.input or not n.output:
            continue
        x, y = types.get(n.input[0]), n.output[0]
        if y and x is not None and _known(x) > _known(types.get(y)):
            out.append(helper.make_value_info(y, x))
    return out


__all__ = ["SAME_SHAPE_OPS", "refined_same_shapes"]
