"""Operators that ONNX defines by a function: a node replaced by its schema's body of other operators.

ONNX writes some operators as a body of other standard ones (``Attention``, ``RMSNormalization``,
``RotaryEmbedding``, ``Swish``, ``SwiGLU``, ...; torch's exporter emits the first three at opset 23).
:func:`expand_functions` replaces the nodes a caller picks by that body, so one mechanism serves every
such operator: the engine runs the body of an op it has no kernel for, and the gradient builder
differentiates the body of an op it has no rule for. The body is the schema's own, built for the node's
attributes and input types (a context-dependent function) at the model's opset.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx

from onnxtrain.ir.builder import NameGen, model_opset, value_types
from onnxtrain.ir.graphs import DEFAULT_DOMAINS, node_reads, rename_values, subgraphs, walk_graphs

_MAX_DEPTH = 4  # a body may hold function ops of its own: expanded again, this many times at most


class FunctionExpansionError(ValueError):
    """A node's function body cannot be built or does not fit the model (names the node)."""


def _schema(op_type: str, opset: int) -> onnx.defs.OpSchema | None:
    try:
        return onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return None


def has_function(op_type: str, opset: int, domain: str = "") -> bool:
    """Whether the default-domain op ``op_type`` at ``opset`` has a function body in its schema."""
    if domain not in DEFAULT_DOMAINS:
        return False
    s = _schema(op_type, opset)
    return s is not None and (s.has_function or s.has_context_dependent_function)


def _label(node: onnx.NodeProto) -> str:
    return f"node {node.name!r} ({node.op_type})" if node.name else f"a {node.op_type} node"


def function_body(
    node: onnx.NodeProto, opset: int, input_types: list[onnx.TypeProto]
) -> onnx.FunctionProto:
    """The body of ``node`` at ``opset`` (``input_types``: one per input slot, empty for an absent one)."""
    s = _schema(node.op_type, opset)
    if s is None or not (s.has_function or s.has_context_dependent_function):
        raise FunctionExpansionError(f"{_label(node)}: no function body at opset {opset}")
    try:
        if s.has_context_dependent_function:
            version = max(v for v in s.context_dependent_function_opset_versions if v <= opset)
            raw = s.get_context_dependent_function_with_opset_version(
                version, node.SerializeToString(), [t.SerializeToString() for t in input_types]
            )
        else:
            version = max(v for v in s.function_opset_versions if v <= opset)
            raw = s.get_function_with_opset_version(version)
    except Exception as e:  # ONNX's builders reject attributes or types they cannot express
        raise FunctionExpansionError(f"{_label(node)}: ONNX could not build its function body: {e}") from None
    body = onnx.FunctionProto()
    body.ParseFromString(raw)
    if not body.node:
        raise FunctionExpansionError(f"{_label(node)}: ONNX built an empty function body for these inputs")
    return body


def body_opset(body: onnx.FunctionProto, default: int) -> int:
    """The default-domain opset ``body`` is written for."""
    return next((int(o.version) for o in body.opset_import if o.domain in DEFAULT_DOMAINS), default)


def _to_opset(
    node: onnx.NodeProto,
    nodes: list[onnx.NodeProto],
    own: int,
    opset: int,
    types: dict[str, onnx.TypeProto],
) -> list[onnx.NodeProto]:
    """``nodes`` (a body written for opset ``own``) moved to ``opset`` by ONNX's version converter, which
    adapts the ops whose meaning changed in between."""
    from onnx import version_converter

    made = {o for n in nodes for o in n.output if o}
    reads = [v for n in nodes for v in node_reads(n) if v not in made]
    inputs = [onnx.helper.make_value_info(v, types.get(v, onnx.TypeProto())) for v in dict.fromkeys(reads)]
    outputs = [onnx.helper.make_value_info(v, onnx.TypeProto()) for v in node.output if v]
    graph = onnx.helper.make_graph(nodes, "body", inputs, outputs)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", own)])
    try:
        moved = version_converter.convert_version(model, opset)
    except Exception as e:
        raise FunctionExpansionError(
            f"{_label(node)}: its function body is written for opset {own}; moving it to the model's "
            f"opset {opset} failed: {e}"
        ) from None
    return list(moved.graph.node)


def _attributes(node: onnx.NodeProto, opset: int) -> dict[str, onnx.AttributeProto]:
    """The node's attributes, with the schema's defaults for those it leaves out."""
    out = {a.name: a for a in node.attribute}
    s = _schema(node.op_type, opset)
    for name, spec in (s.attributes.items() if s is not None else ()):
        if name not in out and spec.default_value.type != onnx.AttributeProto.UNDEFINED:
            out[name] = spec.default_value
    return out


def expand_node(
    node: onnx.NodeProto, body: onnx.FunctionProto, opset: int, names: NameGen
) -> list[onnx.NodeProto]:
    """``body``'s nodes in place of ``node``: its inputs and outputs bound to the node's, its other values
    and node names made unique with ``names``, attribute references bound, nodes that compute only outputs
    the node leaves out dropped."""
    prefix = node.name or node.op_type
    rename: dict[str, str] = {}
    for i, v in enumerate(body.input):
        rename[v] = node.input[i] if i < len(node.input) else ""
    wanted = set()
    for j, v in enumerate(body.output):
        if j < len(node.output) and node.output[j]:
            rename[v] = node.output[j]
            wanted.add(v)
    for inner in body.node:
        for v in (*inner.input, *inner.output):
            if v and v not in rename:
                rename[v] = names(f"{prefix}/{v}")
    live: list[onnx.NodeProto] = []
    for inner in reversed(body.node):  # what the node's outputs need
        if any(o in wanted for o in inner.output if o):
            live.append(inner)
            wanted.update(node_reads(inner))
    given = _attributes(node, opset)
    out = []
    for inner in reversed(live):
        n = onnx.NodeProto()
        n.CopyFrom(inner)
        rename_values(n, rename)
        _bind_refs(n, given)
        for sub in subgraphs(n):
            for g in walk_graphs(sub):
                for x in g.node:
                    _bind_refs(x, given)
        n.name = names(f"{prefix}/{inner.name or inner.op_type}")
        out.append(n)
    _localise_constants(out, names)
    return out


def _localise_constants(nodes: list[onnx.NodeProto], names: NameGen) -> None:
    """Give each body of ``nodes`` its own copy of the constants it reads from around it (in place).

    ONNX's shape inference does not see the values of outer-scope constants, so a body's ``Unsqueeze`` or
    ``Reshape`` by such an axis list loses its output's rank, and with it every later rank of the body and
    the ranks of a ``Scan``'s outputs, which the ``Scan`` gradient needs (``LinearAttention``'s body)."""
    constants = {n.output[0]: n for n in nodes if n.op_type == "Constant" and not n.input}
    for node in nodes:
        for body in subgraphs(node):
            reads = {v for x in body.node for v in node_reads(x)}
            copies: list[onnx.NodeProto] = []
            rename: dict[str, str] = {}
            for name in sorted(reads & constants.keys()):
                copy = onnx.NodeProto()
                copy.CopyFrom(constants[name])
                rename[name] = copy.output[0] = names(name)
                copy.name = names(constants[name].name or "Constant")
                copies.append(copy)
            if not copies:
                continue
            for x in body.node:
                rename_values(x, rename)
            kept = list(body.node)
            del body.node[:]
            body.node.extend([*copies, *kept])


def _bind_refs(n: onnx.NodeProto, given: dict[str, onnx.AttributeProto]) -> None:
    """Replace, in place, ``n``'s references to the outer node's attributes (``ref_attr_name``) by their
    values; a reference to an attribute the node does not have is dropped, as ONNX specifies."""
    kept = []
    for a in n.attribute:
        if a.ref_attr_name:
            src = given.get(a.ref_attr_name)
            if src is None:
                continue
            bound = onnx.AttributeProto()
            bound.CopyFrom(src)
            bound.name = a.name
            a = bound
        kept.append(a)
    del n.attribute[:]
    n.attribute.extend(kept)


def expand_functions(
    model: onnx.ModelProto, wanted: Callable[[onnx.NodeProto], bool]
) -> onnx.ModelProto:
    """``model`` with every default-domain node that ``wanted`` picks and whose op has a function body at
    the model's opset replaced by that body (a copy; ``model`` itself when there is none)."""
    opset = model_opset(model)

    def picked(n: onnx.NodeProto) -> bool:
        return n.domain in DEFAULT_DOMAINS and wanted(n) and has_function(n.op_type, opset)

    if not any(picked(n) for g in walk_graphs(model.graph) for n in g.node):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for _ in range(_MAX_DEPTH):
        graphs = [g for g in walk_graphs(out.graph) if any(picked(n) for n in g.node)]
        if not graphs:
            return out
        types = value_types(out)
        names = NameGen.for_model(out)
        for g in graphs:
            nodes: list[onnx.NodeProto] = []
            declared = {v.name for v in (*g.value_info, *g.output)}
            for n in g.node:
                if not picked(n):
                    nodes.append(n)
                    continue
                body = function_body(n, opset, [_input_type(n, v, types) for v in n.input])
                expanded = expand_node(n, body, opset, names)
                own = body_opset(body, opset)
                nodes.extend(expanded if own == opset else _to_opset(n, expanded, own, opset, types))
                # the node's outputs keep the types inferred for the op: shape inference may not follow its
                # body (a ReduceMean over axes computed at run time) and the ops after it need their ranks
                for o in n.output:
                    if o and o not in declared and o in types:
                        g.value_info.append(onnx.helper.make_value_info(o, types[o]))
            del g.node[:]
            g.node.extend(nodes)
    left = sorted({n.op_type for g in walk_graphs(out.graph) for n in g.node if picked(n)})
    raise FunctionExpansionError(
        f"the function bodies of {left} still hold function ops after {_MAX_DEPTH} rounds"
    )


def _input_type(node: onnx.NodeProto, name: str, types: dict[str, onnx.TypeProto]) -> onnx.TypeProto:
    if not name:
        return onnx.TypeProto()  # an absent optional input
    t = types.get(name)
    if t is None or not t.HasField("tensor_type") or not t.tensor_type.elem_type:
        raise FunctionExpansionError(
            f"{_label(node)}: the type of its input {name!r} is unknown, which its function body needs "
            "(give the model's inputs their types)"
        )
    return t


__all__ = [
    "FunctionExpansionError", "body_opset", "expand_functions", "expand_node", "function_body", "has_function"
]
