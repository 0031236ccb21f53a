"""Node attributes as Python values, with the ONNX schema's defaults filled in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import onnx
from onnx import AttributeProto, numpy_helper


def attribute_value(attr: AttributeProto) -> Any:
    """An AttributeProto as a Python value: str for strings, ndarray for tensors."""
    t = attr.type
    if t == AttributeProto.FLOAT:
        return float(attr.f)
    if t == AttributeProto.INT:
        return int(attr.i)
    if t == AttributeProto.STRING:
        return attr.s.decode("utf-8")
    if t == AttributeProto.TENSOR:
        return numpy_helper.to_array(attr.t)
    if t == AttributeProto.FLOATS:
        return [float(v) for v in attr.floats]
    if t == AttributeProto.INTS:
        return [int(v) for v in attr.ints]
    if t == AttributeProto.STRINGS:
        return [s.decode("utf-8") for s in attr.strings]
    return onnx.helper.get_attribute_value(attr)


# (op, opset, domain) → the schema's attributes: (name, default or None); the schema lookup and its
# attribute objects cost more than the node's own attributes, once per node of a large graph
_DEFAULTS: dict[tuple[str, int, str], tuple[tuple[str, AttributeProto | None], ...]] = {}


def _default(d: AttributeProto) -> AttributeProto | None:
    if d.type == AttributeProto.STRING and d.s == b"foward":  # GRU-1's direction default, misspelled by ONNX
        return onnx.helper.make_attribute(d.name, "forward")
    return d if d.type != AttributeProto.UNDEFINED and d.name else None


def schema_defaults(op: str, opset: int, domain: str) -> tuple[tuple[str, AttributeProto | None], ...]:
    """(name, default value or None) of each attribute of the schema of ``op`` at ``opset`` in ``domain``;
    none for an op without a schema."""
    key = (op, opset, domain)
    found = _DEFAULTS.get(key)
    if found is None:
        try:
            schema = onnx.defs.get_schema(op, opset, domain)
        except Exception:
            schema = None
        found = () if schema is None else tuple(
            (name, _default(a.default_value)) for name, a in schema.attributes.items()
        )
        _DEFAULTS[key] = found
    return found


def parse_attributes(node: onnx.NodeProto, opset: int) -> dict[str, Any]:
    """Node attributes with the schema's defaults filled in (absent optional ones are None)."""
    # each default is read anew: its value (a list, an array) is the node's own to change
    values = {name: None if d is None else attribute_value(d)
              for name, d in schema_defaults(node.op_type, opset, node.domain or "")}
    for a in node.attribute:
        if a.ref_attr_name:
            raise ValueError(f"node {node.name!r} ({node.op_type}): attribute references are not supported")
        values[a.name] = attribute_value(a)
    return values


MVN_DEFAULT_AXES = (0, 2, 3)


def mvn_axes(axes: Sequence[int], rank: int | None) -> list[int]:
    """MeanVarianceNormalization's axes for an input of ``rank``: the default [0, 2, 3] on an input of rank
    below 4 keeps the axes it has (a 3-D input normalises over 0 and 2, as onnxruntime does)."""
    axes = [int(a) for a in axes]
    if rank is not None and tuple(axes) == MVN_DEFAULT_AXES and rank < 4:
        return [a for a in axes if a < rank]
    return axes
