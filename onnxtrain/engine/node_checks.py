"""Load-time checks of a graph's standard nodes against their ONNX schemas, as onnxruntime refuses a model.

For every node of ONNX's own domain (``""``/``"ai.onnx"``) and of ``"ai.onnx.ml"``, :func:`invalid_nodes`
takes the op's schema at the model's opset for that domain and checks what ``onnx.checker.check_node`` does
of the node's form: its number of inputs and outputs within the schema's range, an empty name (an omitted
value) only where the schema's parameter is optional or variadic, every attribute known to the schema and
of the schema's type (strictly: an INT where FLOAT is declared is refused, as the checker and onnxruntime
refuse it), and every required attribute present. Unlike the checker, empty names after the last input or
output are left out of the count (``Relu(x, "")`` passes: nothing is read from it).

Nodes of other domains (onnxtrain's gradient ops, ``com.microsoft``, ``ai.onnx.preview.training``) and ops
without a schema at that opset are not checked: the engine's "no kernel" error names the latter. Nodes in
the bodies of control-flow ops are checked too, named under their node.

:class:`~onnxtrain.engine.plan.Plan` runs the check as it compiles each node (:class:`NodeChecker`, sharing
the node's input and output names with the compile loop: about 3 % of building a training step's plan) and
raises :class:`~onnxtrain.engine.plan.InvalidNodeError` listing the invalid nodes (:func:`invalid_nodes`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from typing import NamedTuple

import onnx
from onnx import AttributeProto

from onnxtrain.ir.graphs import named_subgraphs

_DOMAINS = {"": "", "ai.onnx": "", "ai.onnx.ml": "ai.onnx.ml"}  # checked domain → its name in onnx.defs
_OPTIONAL = onnx.defs.OpSchema.FormalParameterOption.Optional
_VARIADIC = onnx.defs.OpSchema.FormalParameterOption.Variadic
_UNBOUNDED = 2**31 - 1  # a variadic parameter's max_input / max_output
_TYPE_NAMES = {v: k for k, v in AttributeProto.AttributeType.items()}
# the standard ops that hold graphs (control flow): only their attributes are searched for bodies
_BODY_OPS = frozenset({"If", "Loop", "Scan", "SequenceMap"})
_UNSEEN = object()


class _Form(NamedTuple):
    """What a schema allows of a node's form."""

    label: str  # "Relu-14"
    inputs: tuple[tuple[int, int], tuple[tuple[str, bool, bool], ...]]  # (min, max), formals (see _arity)
    outputs: tuple[tuple[int, int], tuple[tuple[str, bool, bool], ...]]
    attributes: Mapping[str, int]  # name → AttributeProto type
    required: tuple[str, ...]


@cache
def _form(op_type: str, opset: int, domain: str) -> _Form | None:
    try:
        s = onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        return None

    def params(formals: Iterable[onnx.defs.OpSchema.FormalParameter]) -> tuple[tuple[str, bool, bool], ...]:
        return tuple((f.name, f.option in (_OPTIONAL, _VARIADIC), f.option == _VARIADIC) for f in formals)

    attrs = {name: int(a.type.value) for name, a in s.attributes.items()}
    required = tuple(name for name, a in s.attributes.items() if a.required)
    return _Form(f"{s.name}-{s.since_version}", ((s.min_input, s.max_input), params(s.inputs)),
                 ((s.min_output, s.max_output), params(s.outputs)), attrs, required)


def _range(lo: int, hi: int) -> str:
    if hi >= _UNBOUNDED:
        return f"at least {lo}"
    return str(lo) if lo == hi else f"{lo} to {hi}"


def _plural(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def _arity(names: Iterable[str], form: tuple[tuple[int, int], tuple[tuple[str, bool, bool], ...]], what: str,
           label: str) -> str | None:
    """What is wrong with a node's ``what`` ("input"/"output") names against the schema's ``form``: (min, max)
    and per formal parameter (name, whether it may be empty: optional or variadic, whether variadic)."""
    names = list(names)
    (lo, hi), formals = form
    given = len(names)
    while given and not names[given - 1]:
        given -= 1  # trailing omitted values: not given
    if given > hi:
        return f"has {_plural(given, what)}; {label} takes {_range(lo, hi)}"
    if len(names) < lo:
        return f"has {_plural(len(names), what)}; {label} takes {_range(lo, hi)}"
    for i, n in enumerate(names):
        if n or not formals:
            continue
        if i >= len(formals) and not formals[-1][2]:
            break  # empty names past the schema's last parameter: trailing (counted above), not given
        name, may_omit, _ = formals[min(i, len(formals) - 1)]
        if not may_omit:
            return f"{what} {i} ({name}) of {label} is required, but its name is empty"
    return None


class NodeChecker:
    """Checks nodes one at a time against their schemas at a model's ``opsets`` (domain → version, ONNX's
    own domain under ``""``). A plan calls :meth:`invalid` on every node it compiles, with the input and
    output names it reads anyway: the common case (counts in range, no empty name, known attributes of the
    declared types) costs a few lookups; :meth:`problem` says what is wrong."""

    def __init__(self, opsets: Mapping[str, int]):
        self.opsets = opsets
        self._forms: dict[tuple[str, str], _Form | None] = {}

    def form(self, node: onnx.NodeProto) -> _Form | None:
        """The node's schema's form, None when it is not checked (another domain, no schema)."""
        domain = _DOMAINS.get(node.domain)
        if domain is None:
            return None
        op = node.op_type
        form = self._forms.get((op, domain), _UNSEEN)
        if form is _UNSEEN:
            version = self.opsets.get(domain)
            form = self._forms[op, domain] = _form(op, version, domain) if version is not None else None
        return form

    def invalid(self, node: onnx.NodeProto, ins: Sequence[str], outs: Sequence[str]) -> bool:
        """Whether ``node`` (its input names ``ins`` and output names ``outs``) is invalid."""
        form = self.form(node)
        if form is None:
            return False
        (ilo, ihi), _ = form.inputs
        (olo, ohi), _ = form.outputs
        if ilo <= len(ins) <= ihi and olo <= len(outs) <= ohi and "" not in ins and "" not in outs:
            attrs = node.attribute
            if attrs:
                known = form.attributes
                for a in attrs:
                    if known.get(a.name) != a.type:
                        break
                else:
                    if not form.required:
                        return False
            elif not form.required:
                return False
        return _problem(node, form, ins, outs) is not None

    def problem(self, node: onnx.NodeProto, k: int, where: str = "") -> str | None:
        """What is wrong with ``node`` (index ``k`` in its graph, for an unnamed one), as a message naming the
        node, op and opset after ``where``; None when it is valid or not checked."""
        form = self.form(node)
        why = _problem(node, form, node.input, node.output) if form is not None else None
        if why is None:
            return None
        version = self.opsets[_DOMAINS[node.domain]]
        return f"{where}node {_label(node, k)} ({_op(node)}, opset {version}): {why}"


def _problem(node: onnx.NodeProto, form: _Form, ins: Sequence[str], outs: Sequence[str]) -> str | None:
    why = _arity(ins, form.inputs, "input", form.label) or _arity(outs, form.outputs, "output", form.label)
    if why:
        return why
    known = form.attributes
    for a in node.attribute:
        want = known.get(a.name)
        if want is None:
            return f"attribute {a.name!r} is not an attribute of {form.label}"
        if a.type != want and not a.ref_attr_name:  # a reference: bound when its function is expanded
            have = _TYPE_NAMES.get(a.type, str(a.type)) if a.type else "of no type"
            return f"attribute {a.name!r} is {have}; {form.label} declares {_TYPE_NAMES.get(want, want)}"
    if form.required:
        given = {a.name for a in node.attribute}
        for name in form.required:
            if name not in given:
                return f"required attribute {name!r} of {form.label} is missing"
    return None


def model_opsets(model: onnx.ModelProto) -> dict[str, int]:
    """The versions of the checked domains ``model`` imports ("" for ONNX's own under either name)."""
    out: dict[str, int] = {}
    for o in model.opset_import:
        d = _DOMAINS.get(o.domain)
        if d is not None:
            out[d] = int(o.version)
    return out


def _label(node: onnx.NodeProto, k: int) -> str:
    return repr(node.name) if node.name else f"#{k} (unnamed)"


def _op(node: onnx.NodeProto) -> str:
    return f"{node.domain}.{node.op_type}" if node.domain else node.op_type


def invalid_nodes(graph: onnx.GraphProto, opsets: Mapping[str, int] | NodeChecker, where: str = "",
                  limit: int = 10) -> list[str]:
    """One message per invalid node of ``graph`` and of the bodies of its control-flow nodes (at most
    ``limit``): the node (its name, or its index when unnamed), op, opset and what is wrong. ``opsets``:
    domain → version, ONNX's own domain under ``""`` (or a :class:`NodeChecker` of them)."""
    check = opsets if isinstance(opsets, NodeChecker) else NodeChecker(opsets)
    out: list[str] = []
    for k, node in enumerate(graph.node):
        if check.invalid(node, tuple(node.input), tuple(node.output)):
            out.append(check.problem(node, k, where) or "")
            if len(out) >= limit:
                return out
        if node.op_type in _BODY_OPS:
            for name, g in named_subgraphs(node):
                inside = f"{where}node {_label(node, k)} ({_op(node)}), {name}: "
                out += invalid_nodes(g, check, inside, limit - len(out))
                if len(out) >= limit:
                    return out[:limit]
    return out
