"""Symbolic dim names in value types: which ones a sequence's elements share (and so may not hold), and
types with such dims made unknown."""

from __future__ import annotations

import onnx

from onnxtrain.ir.graphs import DEFAULT_DOMAINS


def _type_dims(tp: onnx.TypeProto) -> tuple[set[str], bool]:
    """The symbolic dim names in ``tp`` (through sequences, optionals and maps), and whether it holds a
    sequence."""
    kind = tp.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        tt = getattr(tp, kind)
        dims = {d.dim_param for d in tt.shape.dim if d.dim_param} if tt.HasField("shape") else set()
        return dims, False
    if kind == "sequence_type":
        return _type_dims(tp.sequence_type.elem_type)[0], True
    if kind == "optional_type":
        return _type_dims(tp.optional_type.elem_type)
    if kind == "map_type":
        return _type_dims(tp.map_type.value_type)
    return set(), False


def sequence_element_dims(model: onnx.ModelProto, types: dict[str, onnx.TypeProto]) -> set[str]:
    """The symbolic dims of ``types`` that first appear in a sequence's element type (or on a SequenceAt
    output): names inference shares among all the elements of a sequence, whose sizes may differ."""
    g = model.graph
    trusted: set[str] = set()
    shared: set[str] = set()
    for v in g.input:  # a declared sequence input's dims say nothing about its elements' sizes either
        dims, in_sequence = _type_dims(types.get(v.name, v.type))
        (shared if in_sequence else trusted).update(dims)
    trusted -= shared
    for n in g.node:
        from_sequence = n.op_type == "SequenceAt" and n.domain in DEFAULT_DOMAINS
        for o in n.output:
            tp = types.get(o) if o else None
            if tp is None:
                continue
            dims, in_sequence = _type_dims(tp)
            (shared if in_sequence or from_sequence else trusted).update(dims - trusted - shared)
    return shared


def _clear_dims(tp: onnx.TypeProto, dims: set[str]) -> None:
    """Make the dims of ``tp`` named in ``dims`` unknown (in place)."""
    kind = tp.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        for d in getattr(tp, kind).shape.dim:
            if d.dim_param in dims:
                d.ClearField("dim_param")
    elif kind == "sequence_type":
        _clear_dims(tp.sequence_type.elem_type, dims)
    elif kind == "optional_type":
        _clear_dims(tp.optional_type.elem_type, dims)
    elif kind == "map_type":
        _clear_dims(tp.map_type.value_type, dims)


def forget_dims(types: dict[str, onnx.TypeProto], dims: set[str]) -> None:
    """Replace the types in ``types`` that name one of ``dims`` by copies with those dims unknown."""
    if not dims:
        return
    for name, tp in types.items():
        if _type_dims(tp)[0] & dims:
            copy = onnx.TypeProto()
            copy.CopyFrom(tp)
            _clear_dims(copy, dims)
            types[name] = copy
