"""Element types that ONNX shape inference left unknown, read from the operators' schemas: an output whose
type parameter is shared with a typed input, or that allows a single type, or a Cast's ``to``."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from onnxtrain.ir.graphs import DEFAULT_DOMAINS

_GRAPH_ATTRS = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def formal_types(schema: onnx.defs.OpSchema, n: int, outputs: bool) -> list[str | None]:
    """The type string (e.g. ``T``) of each of ``n`` actual inputs (or outputs) of a node; None past the
    formals, and for the members of a heterogeneous variadic (Loop's and Scan's ``V``: one type string,
    but each member its own type)."""
    formals = schema.outputs if outputs else schema.inputs
    variadic = onnx.defs.OpSchema.FormalParameterOption.Variadic
    out: list[str | None] = []
    for i in range(n):
        f = formals[i] if i < len(formals) else (
            formals[-1] if formals and formals[-1].option == variadic else None)
        if f is None or (f.option == variadic and not f.is_homogeneous):
            out.append(None)
        else:
            out.append(f.type_str)
    return out


def _known(types: dict[str, onnx.TypeProto], name: str) -> int:
    tp = types.get(name)
    if tp is None or not tp.HasField("tensor_type"):
        return TensorProto.UNDEFINED
    return tp.tensor_type.elem_type


def _single_type(type_str: str) -> int:
    """The element type of a fixed type string such as ``tensor(int64)``; UNDEFINED otherwise."""
    if not (type_str.startswith("tensor(") and type_str.endswith(")")):
        return TensorProto.UNDEFINED
    name = type_str[len("tensor("):-1].upper()
    return getattr(TensorProto, {"FLOAT32": "FLOAT"}.get(name, name), TensorProto.UNDEFINED)


def fill_elem_types(model: onnx.ModelProto, types: dict[str, onnx.TypeProto]) -> None:
    """Give ``types`` (name → TypeProto, updated in place) the element type of each main-graph tensor value
    that the schemas of its producer fix; values already typed keep their types."""
    opset = next((o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS), 0)
    for node in model.graph.node:
        if node.domain not in DEFAULT_DOMAINS or any(a.type in _GRAPH_ATTRS for a in node.attribute):
            continue  # (control flow: its bodies decide its outputs' types)
        todo = [j for j, o in enumerate(node.output) if o and _known(types, o) == TensorProto.UNDEFINED]
        if not todo:
            continue
        try:
            schema = onnx.defs.get_schema(node.op_type, opset, "")
        except onnx.defs.SchemaError:
            continue
        ins = formal_types(schema, len(node.input), outputs=False)
        outs = formal_types(schema, len(node.output), outputs=True)
        allowed = {c.type_param_str: list(c.allowed_type_strs) for c in schema.type_constraints}
        for j in todo:
            tv = outs[j]
            et = TensorProto.UNDEFINED
            if node.op_type == "Cast":
                et = next((a.i for a in node.attribute if a.name == "to"), TensorProto.UNDEFINED)
            elif tv is not None and tv in allowed:
                same = [_known(types, v) for v, t in zip(node.input, ins) if v and t == tv]
                et = next((e for e in same if e != TensorProto.UNDEFINED), TensorProto.UNDEFINED)
                if et == TensorProto.UNDEFINED and len(allowed[tv]) == 1:
                    et = _single_type(allowed[tv][0])
            elif tv is not None:
                et = _single_type(tv)
            if et == TensorProto.UNDEFINED:
                continue
            old = types.get(node.output[j])
            if old is not None and old.HasField("tensor_type"):
                new = onnx.TypeProto()
                new.CopyFrom(old)
                new.tensor_type.elem_type = et
            elif old is None:
                new = helper.make_tensor_type_proto(et, None)
            else:  # a sequence or an optional: left as it is
                continue
            types[node.output[j]] = new
