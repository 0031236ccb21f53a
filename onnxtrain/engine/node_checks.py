"""Load-time checks of a graph's standard nodes against their ONNX schemas, as onnxruntime refuses a model.

For every node of ONNX's own domain (``""``/``"ai.onnx"``) and of ``"ai.onnx.ml"``, :func:`invalid_nodes`
takes the op's schema at the model's opset for that domain and checks what ``onnx.checker.check_node`` does
of the node's form: its number of inputs and outputs within the schema's range, an empty name (an omitted
value) only where the schema's parameter is optional or variadic, every attribute known to the schema and
of the schema's type (strictly: an INT where FLOAT is declared is refused, as the checker and onnxruntime
refuse it), and every required attribute present. Empty names count as inputs and outputs, also after the
schema's last parameter (``Relu(x, "")`` has two inputs), as for the checker and onnxruntime.

The types of a node's inputs, as onnxruntime checks them at load: an input of known type must be of a type
that the constraint of its formal parameter allows (``schema.type_constraints``: an int64 Relu at opset 13,
Gather's float indices, a Reshape's int32 shape), and the inputs bound to one type variable (Add's two ``T``,
every value of Concat's variadic ``T``) of one type (Add of a float and a double); a heterogeneous variadic's
values (Loop's carried values) only of allowed types. The types known: those the graph declares
(:func:`graph_types`: inputs, initializers, value_info, outputs) and those the nodes checked before give their
outputs by their schemas (the one type a constraint allows, as Shape's int64; the type of the input that binds
the output's variable, as Add's; Cast's ``to``, Constant's and ConstantOfShape's value, QuantizeLinear's
``output_dtype``, the ``dtype`` of EyeLike, Bernoulli, Multinomial and the random ops, with their defaults; a
control-flow node's outputs, the types its body declares for them). An output whose type is found so must be
the type the graph declares for it, if it declares one (its value_info, the graph's outputs), as onnxruntime's
"does not match expected type"; the nodes after it are checked with the type the node makes. Nothing is
inferred beyond that (no shape inference runs): an input of no type found so is not checked (the output of a
node of another domain or of a control-flow node whose body declares no type for it, a sparse tensor). A
map's type is compared in one spelling (the ai.onnx.ml schemas' ``map(int64, float)`` is a value's
``map(int64,tensor(float))``).
What the engine runs beyond the schemas is let through (``_FLOAT64_TOO``: float64 Celu, RotaryEmbedding,
CausalConvWithState and LinearAttention, which the float64 gradient checks of the op tables run), although
onnxruntime refuses it.

An op of ONNX's domains used at an opset before the one that defines it (HardSwish at opset 11), or whose
schema there is a removed form (Upsample-10, Scatter-11), is invalid, as for onnxruntime (but for
``_EARLIER_OPS``, which it runs). Nodes of other domains (onnxtrain's gradient ops,
``com.microsoft``, ``ai.onnx.preview.training``) and ops ONNX does not define are not checked: the engine's
"no kernel" error names the latter. Nodes in the
bodies of control-flow ops are checked too, named under their node, their input types with the types the body
declares (a Loop body's inputs) and its nodes give, and those of the enclosing graphs' values that the body
reads (the plan compiling a body gets them from the plan of its node: ``outer_types``).

:class:`~onnxtrain.engine.plan.Plan` runs the check as it compiles each node (:class:`NodeChecker`, sharing
the node's input and output names with the compile loop: about 6 % of building a training step's plan)
and raises :class:`~onnxtrain.engine.interface.InvalidNodeError` listing the invalid nodes
(:func:`invalid_nodes`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from typing import NamedTuple

import onnx
from onnx import AttributeProto, TensorProto

from onnxtrain.engine.interface import ONNX_DOMAINS, node_label, op_name
from onnxtrain.ir.graphs import first_opset, graph_values, named_subgraphs
from onnxtrain.ir.types import TENSOR_TYPE_STRINGS as _TENSOR_TYPES
from onnxtrain.ir.types import type_string

# the domains whose ops onnx.defs defines (the checked ones), by their names in nodes → their names there
_OPTIONAL = onnx.defs.OpSchema.FormalParameterOption.Optional
_VARIADIC = onnx.defs.OpSchema.FormalParameterOption.Variadic
_UNBOUNDED = 2**31 - 1  # a variadic parameter's max_input / max_output
_TYPE_NAMES = {v: k for k, v in AttributeProto.AttributeType.items()}
# the standard ops that hold graphs (control flow): only their attributes are searched for bodies
_BODY_OPS = frozenset({"If", "Loop", "Scan", "SequenceMap"})
_UNSEEN = object()
_FLOAT = _TENSOR_TYPES[TensorProto.FLOAT]
_INT64 = _TENSOR_TYPES[TensorProto.INT64]
_STRING = _TENSOR_TYPES[TensorProto.STRING]
# ops whose output type an attribute gives (see _attribute_type), and for those of a ``dtype`` attribute, the
# type when it is left out (None: their input 0's)
_DTYPE_DEFAULTS = {"EyeLike": None, "RandomNormalLike": None, "RandomUniformLike": None, "Bernoulli": None,
                   "RandomNormal": _FLOAT, "RandomUniform": _FLOAT,
                   "Multinomial": _TENSOR_TYPES[TensorProto.INT32]}
_TYPED_BY_ATTRIBUTE = frozenset({"Cast", "Constant", "ConstantOfShape", "QuantizeLinear", "SequenceEmpty",
                                 *_DTYPE_DEFAULTS})
# Constant's attributes other than a tensor → its output's type
_CONSTANT_TYPES = {"value_float": _FLOAT, "value_floats": _FLOAT, "value_int": _INT64, "value_ints": _INT64,
                   "value_string": _STRING, "value_strings": _STRING}

# Ops of ONNX's domain whose schemas allow float32 but not float64, which the engine runs in float64 too
# (the op tables' float64 forward and gradient checks), so the type check lets float64 through wherever they
# allow float32, although onnxruntime refuses it
_FLOAT64_TOO = frozenset({"Celu", "RotaryEmbedding", "CausalConvWithState", "LinearAttention"})
_DOUBLE = _TENSOR_TYPES[TensorProto.DOUBLE]
# Ops of ONNX's domain that onnxruntime runs below the opset that defines them (LayerNormalization: its own
# kernel, registered in ONNX's domain from opset 1; ThresholdedRelu: an experimental op before opset 10): not
# refused there, and not checked (no schema)
_EARLIER_OPS = frozenset({"LayerNormalization", "ThresholdedRelu"})
# Ops of ONNX's domain whose deprecated schemas (a form ONNX removed: Upsample from opset 10, Scatter from 11)
# onnxruntime refuses; it runs the other deprecated ones (GroupNormalization-18, the ai.onnx.ml tree
# ensembles' 5), as the engine does
_REMOVED_FORMS = frozenset({"Upsample", "Scatter"})


class _Typed(NamedTuple):
    """What a schema allows of the type of one formal parameter."""

    var: str  # its type variable ("T") or its literal type ("tensor(int64)")
    allowed: frozenset[str]  # the type strings the variable allows ("tensor(float)", "seq(tensor(int64))")
    listed: str  # the same, in the schema's order, for a message
    bind: bool  # a type variable that every value bound to it must share (not a heterogeneous variadic)


class _Form(NamedTuple):
    """What a schema allows of a node's form."""

    label: str  # "Relu-14"
    inputs: tuple[tuple[int, int], tuple[tuple[str, bool, bool], ...]]  # (min, max), formals (see _arity)
    outputs: tuple[tuple[int, int], tuple[tuple[str, bool, bool], ...]]
    attributes: Mapping[str, int]  # name → AttributeProto type
    required: tuple[str, ...]
    input_types: tuple[_Typed, ...]  # per formal input (the last one repeated for a variadic)
    variadic_input: bool  # the last formal input is variadic
    # per formal output: the one type it can be, or the type variable an input binds it to (else None)
    output_types: tuple[tuple[str | None, str | None], ...]
    variadic_output: bool


def _spelled(t: str) -> str:
    """A schema's type string as :func:`~onnxtrain.ir.types.type_string` spells a value's type: no spaces, a
    map's values a tensor type (the ai.onnx.ml schemas write ``map(int64, float)`` for
    ``map(int64,tensor(float))``, also inside a ``seq``)."""
    t = t.replace(" ", "")
    for kind in ("seq(", "optional("):
        if t.startswith(kind) and t.endswith(")"):
            return f"{kind}{_spelled(t[len(kind):-1])})"
    if t.startswith("map(") and t.endswith(")") and "," in t:
        key, value = t[4:-1].split(",", 1)
        value = _spelled(value)
        return f"map({key},{value if '(' in value else f'tensor({value})'})"
    return t


@cache
def _form(op_type: str, opset: int, domain: str) -> _Form | None:
    try:
        s = onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        return None
    if s.deprecated and domain == "" and op_type in _REMOVED_FORMS:
        return None  # _unavailable says so

    def params(formals: Iterable[onnx.defs.OpSchema.FormalParameter]) -> tuple[tuple[str, bool, bool], ...]:
        return tuple((f.name, f.option in (_OPTIONAL, _VARIADIC), f.option == _VARIADIC) for f in formals)

    constraints = {c.type_param_str: tuple(map(_spelled, c.allowed_type_strs)) for c in s.type_constraints}
    if domain == "" and op_type in _FLOAT64_TOO:
        constraints = {v: (*a, _DOUBLE) if _FLOAT in a and _DOUBLE not in a else a
                       for v, a in constraints.items()}

    def typed(formals: Iterable[onnx.defs.OpSchema.FormalParameter]) -> tuple[_Typed, ...]:
        out = []
        for f in formals:
            var = _spelled(f.type_str)  # (a type variable's name stays as it is)
            allowed = constraints.get(var)
            if allowed is None:  # a literal type, not a variable
                out.append(_Typed(var, frozenset((var,)), var, False))
            else:
                out.append(_Typed(var, frozenset(allowed), ", ".join(allowed), bool(f.is_homogeneous)))
        return tuple(out)

    def variadic(formals: Sequence[onnx.defs.OpSchema.FormalParameter]) -> bool:
        return bool(formals) and formals[-1].option == _VARIADIC

    outputs = tuple((next(iter(f.allowed)) if len(f.allowed) == 1 else None, f.var if f.bind else None)
                    for f in typed(s.outputs))
    attrs = {name: int(a.type.value) for name, a in s.attributes.items()}
    required = tuple(name for name, a in s.attributes.items() if a.required)
    return _Form(f"{s.name}-{s.since_version}", ((s.min_input, s.max_input), params(s.inputs)),
                 ((s.min_output, s.max_output), params(s.outputs)), attrs, required, typed(s.inputs),
                 variadic(s.inputs), outputs, variadic(s.outputs))


@cache
def _unavailable(op_type: str, opset: int, domain: str) -> str | None:
    """Why an op ONNX defines cannot be used at ``opset`` (it comes later, or is deprecated there), as
    onnxruntime refuses it; None otherwise (also for ops ONNX does not define, and :data:`_EARLIER_OPS`)."""
    if domain == "" and op_type in _EARLIER_OPS:
        return None
    first = first_opset(op_type, domain)
    if first > opset:
        return f"{op_type} is not an operator of opset {opset}: ONNX added it at opset {first}"
    if domain == "" and op_type in _REMOVED_FORMS and onnx.defs.get_schema(op_type, opset, domain).deprecated:
        return f"{op_type} is deprecated at opset {opset} (a removed form): re-export the model"
    return None


def graph_types(graph: onnx.GraphProto) -> dict[str, str]:
    """The types ``graph`` declares of its values: its value_info, outputs, inputs, then its initializers'
    (an initializer's own type wins over the input of its name), by name; values of no known type left
    out."""
    types: dict[str, str] = {}
    for infos in (graph.value_info, graph.output, graph.input):
        for v in infos:
            t = type_string(v.type)
            if t is not None:
                types[v.name] = t
    tensor_types = _TENSOR_TYPES
    for init in graph.initializer:
        t = tensor_types.get(init.data_type)
        if t is not None:
            types[init.name] = t
    return types


def _attribute_type(node: onnx.NodeProto, types: Mapping[str, str]) -> str | None:
    """The output type that the attributes of a Cast, Constant, ConstantOfShape, QuantizeLinear,
    SequenceEmpty or an op of ``_DTYPE_DEFAULTS`` give it (with their defaults: ConstantOfShape's float,
    QuantizeLinear's uint8 without a zero point, SequenceEmpty's sequence of float, a random op's float or
    its input's type); None when unknown (a sparse Constant, a default from an input of unknown type)."""
    op = node.op_type
    if op == "SequenceEmpty":
        dtype = next((a.i for a in node.attribute if a.name == "dtype" and a.type == AttributeProto.INT),
                     TensorProto.FLOAT)
        t = _TENSOR_TYPES.get(dtype)
        return None if t is None else f"seq({t})"
    if op in _DTYPE_DEFAULTS:
        for a in node.attribute:
            if a.name == "dtype" and a.type == AttributeProto.INT:
                return _TENSOR_TYPES.get(a.i)
        default = _DTYPE_DEFAULTS[op]
        return default if default is not None else types.get(node.input[0]) if node.input else None
    if op == "QuantizeLinear":  # with a zero point, its type (the schema's variable) is the output's
        for a in node.attribute:
            if a.name == "output_dtype" and a.type == AttributeProto.INT and a.i:
                return _TENSOR_TYPES.get(a.i)
        return _TENSOR_TYPES[TensorProto.UINT8] if len(node.input) < 3 or not node.input[2] else None
    for a in node.attribute:
        if op == "Cast":
            if a.name == "to" and a.type == AttributeProto.INT:
                return _TENSOR_TYPES.get(a.i)
        elif a.name == "value" and a.type == AttributeProto.TENSOR:
            return _TENSOR_TYPES.get(a.t.data_type)
        elif op == "Constant":
            return _CONSTANT_TYPES.get(a.name)
    return _FLOAT if op == "ConstantOfShape" else None


def _bind(form: _Form, ins: Sequence[str], types: Mapping[str, str]) -> dict[str, str] | str:
    """The types that a node's inputs ``ins`` of known type (``types``) bind their schema's type variables
    to (``form``, its arity already checked), or what is wrong with them: a type that the formal
    parameter's constraint does not allow, or two values bound to one type variable of different types."""
    formals = form.input_types
    n = len(formals)
    bound: dict[str, str] = {}
    first: dict[str, int] = {}
    for i, name in enumerate(ins):
        if i < n:
            f = formals[i]
        elif form.variadic_input:
            f = formals[-1]
        else:
            break  # past the last parameter (refused by the count before)
        if not name:
            continue
        t = types.get(name)
        if t is None:
            continue
        if t not in f.allowed:
            if f.var in f.allowed:  # a literal type
                return f"input {i} {name!r} is {t}; {form.label} takes {f.var} there"
            return f"input {i} {name!r} is {t}, not allowed for {f.var} of {form.label} ({f.listed})"
        if f.bind:
            var = f.var
            was = bound.get(var)
            if was is None:
                bound[var] = t
                first[var] = i
            elif was != t:
                k = first[var]
                return f"input {i} {name!r} is {t}, but {var} of input {k} {ins[k]!r} is {was}"
    return bound


def _type_problem(form: _Form, ins: Sequence[str], types: Mapping[str, str]) -> str | None:
    """What is wrong with the types of a node's inputs (see :func:`_bind`); None when nothing is."""
    why = _bind(form, ins, types)
    return why if isinstance(why, str) else None


def _output_types(node: onnx.NodeProto, form: _Form, outs: Sequence[str], bound: Mapping[str, str],
                  types: Mapping[str, str]) -> list[tuple[int, str]]:
    """(index, type) of each of ``node``'s outputs ``outs`` whose type its schema (or, for a Cast, a Constant
    and the ops of ``_TYPED_BY_ATTRIBUTE``, its attributes) gives: the one type a constraint allows, or a
    type variable's that an input of known type binds (``bound``)."""
    rules = form.output_types
    n = len(rules)
    out = []
    for j, name in enumerate(outs):
        if j < n:
            fixed, var = rules[j]
        elif form.variadic_output:
            fixed, var = rules[-1]
        else:
            break
        if not name:
            continue
        t = fixed
        if t is None and var is not None:
            t = bound.get(var)
        if t is None:
            op = node.op_type
            if op in _TYPED_BY_ATTRIBUTE:
                t = _attribute_type(node, types)
            elif op in _BODY_OPS:
                t = _body_type(node, j)
            elif op == "SequenceConstruct" and node.input and node.input[0] in types:
                t = f"seq({types[node.input[0]]})"  # (its elements' type: S is bound by no input)
            elif op == "LayerNormalization" and j > 0:  # Mean and InvStdDev: U, bound by stash_type
                stash = next((a.i for a in node.attribute if a.name == "stash_type"
                              and a.type == AttributeProto.INT), TensorProto.FLOAT)
                t = _TENSOR_TYPES.get(stash)
        if t is not None:
            out.append((j, t))
    return out


# ops whose types relate in ways no type constraint says
_RELATED = frozenset({"If", "SequenceInsert", "Loop", "Scan"})


def _relation_problem(node: onnx.NodeProto, types: Mapping[str, str]) -> str | None:
    """What ONNX's type inference refuses and the schemas' type constraints do not say, as a message: an
    If whose branches declare an output of two types, a SequenceInsert of a tensor of another type than the
    sequence's elements, a Loop's or Scan's input of another type than the body declares for the body input
    it is handed to (whose plan would run on that declaration); None otherwise (or when the types are
    unknown)."""
    if node.op_type in ("Loop", "Scan"):
        return _body_input_problem(node, types)
    if node.op_type == "If":
        graphs = {a.name: a.g for a in node.attribute if a.type == AttributeProto.GRAPH}
        then, other = graphs.get("then_branch"), graphs.get("else_branch")
        if then is None or other is None:
            return None
        for j, (a, b) in enumerate(zip(then.output, other.output)):
            ta, tb = type_string(a.type), type_string(b.type)
            if ta is not None and tb is not None and ta != tb:
                return f"output {j}: then_branch declares {ta}, else_branch {tb} (the branches must agree)"
        return None
    if node.op_type == "SequenceInsert" and len(node.input) > 1:
        seq, item = types.get(node.input[0]), types.get(node.input[1])
        if seq is not None and item is not None and seq.startswith("seq(") and seq[4:-1] != item:
            return f"input 1 {node.input[1]!r} is {item}, but sequence {node.input[0]!r} holds {seq[4:-1]}"
    return None


def _body_input_problem(node: onnx.NodeProto, types: Mapping[str, str]) -> str | None:
    """A Loop's carried value, or a Scan's state or scan input, of another type than the body declares for
    the body input it is handed to (a scan input's slice: the same element type), as a message."""
    body = next((a.g for a in node.attribute if a.name == "body" and a.type == AttributeProto.GRAPH), None)
    if body is None:
        return None
    # node input k is body input k - shift: a Loop's from its carried values (input 2) on, a Scan's from its
    # first (Scan-8: after its sequence_lens)
    first, shift = (2, 0) if node.op_type == "Loop" else (0, max(0, len(node.input) - len(body.input)))
    for k in range(first + shift, min(len(node.input), len(body.input) + shift)):
        name = node.input[k]
        given = types.get(name) if name else None
        formal = body.input[k - shift]
        declared = type_string(formal.type)
        if given is not None and declared is not None and given != declared:
            return (f"input {k} {name!r} is {given}, but the body declares its input {k - shift} "
                    f"{formal.name!r} {declared}")
    return None


def _body_type(node: onnx.NodeProto, j: int) -> str | None:
    """The type of a control-flow node's output ``j`` that its body declares: an If's as both branches
    declare it (one of them when the other declares none), a Loop's (after the body's condition) and a
    Scan's as the body's output in that place, a SequenceMap's a sequence of it; None when unknown."""
    graphs = {a.name: a.g for a in node.attribute if a.type == AttributeProto.GRAPH}
    op = node.op_type
    if op == "If":
        known = {type_string(g.output[j].type) for g in graphs.values() if j < len(g.output)} - {None}
        return known.pop() if len(known) == 1 else None
    body = graphs.get("body")
    k = j + 1 if op == "Loop" else j
    if body is None or k >= len(body.output):
        return None
    t = type_string(body.output[k].type)
    return f"seq({t})" if op == "SequenceMap" and t is not None else t


def _declared_problem(node: onnx.NodeProto, form: _Form, ins: Sequence[str], outs: Sequence[str],
                      types: dict[str, str]) -> str | None:
    """An output whose type by the schema (:func:`_output_types`) is not the one the graph declares for it
    (its value_info or the graph's output), as a message; None when every known one agrees. The outputs
    then take their schema's types in ``types``, so that the nodes after are checked with the types this
    one makes, not charged with its mistake."""
    bound = _bind(form, ins, types)
    if isinstance(bound, str):
        return bound
    given = _output_types(node, form, outs, bound, types)
    wrong = _misdeclared(given, outs, types)
    types.update((outs[j], t) for j, t in given)
    if wrong is None:
        return None
    j, t, declared = wrong
    return f"output {j} {outs[j]!r} is {t} by {form.label}, but the graph declares it {declared}"


def _misdeclared(given: Sequence[tuple[int, str]], outs: Sequence[str],
                 types: Mapping[str, str]) -> tuple[int, str, str] | None:
    """The first of ``given`` ((output index, type) by the schema) whose output the graph declares of
    another type in ``types``: (index, type, declared type); None when they all agree."""
    for j, t in given:
        declared = types.get(outs[j])
        if declared is not None and declared != t:
            return j, t, declared
    return None


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
    if not lo <= len(names) <= hi:
        return f"has {_plural(len(names), what)}; {label} takes {_range(lo, hi)}"
    for i, n in enumerate(names):
        if n or not formals:
            continue
        name, may_omit, _ = formals[min(i, len(formals) - 1)]
        if not may_omit:
            return f"{what} {i} ({name}) of {label} is required, but its name is empty"
    return None


class NodeChecker:
    """Checks nodes one at a time against their schemas at a model's ``opsets`` (domain → version, ONNX's
    own domain under ``""``), in the order of ``graph``'s nodes (the input types: the ones ``graph``
    declares, :func:`graph_types`, and those the checked nodes before gave their outputs). A plan calls
    :meth:`invalid` on every node it compiles, with the input and output names it reads anyway: the common
    case (counts in range, no empty name, known attributes of the declared types, input types allowed)
    costs a few lookups; :meth:`problem` says what is wrong."""

    def __init__(self, opsets: Mapping[str, int], graph: onnx.GraphProto | None = None,
                 outer: Mapping[str, str] | None = None):
        """``outer``: the types of the enclosing graphs' values, for a body (its own declarations win)."""
        self.opsets = opsets
        self._forms: dict[tuple[str, str], _Form | None] = {}
        self.types: dict[str, str] = dict(outer) if outer else {}
        if graph is not None:
            self.types.update(graph_types(graph))

    def within(self, graph: onnx.GraphProto) -> NodeChecker:
        """A checker of ``graph``'s nodes (a body, which may read the values this one has typed so far, but
        for those of the names it defines itself: a body may reuse an outer name) at the same opsets,
        sharing this one's schemas."""
        own = graph_values(graph)
        outer = {k: t for k, t in self.types.items() if k not in own}
        check = NodeChecker(self.opsets, graph, outer)
        check._forms = self._forms
        return check

    def form(self, node: onnx.NodeProto) -> _Form | None:
        """The node's schema's form, None when it is not checked (another domain, no schema)."""
        domain = ONNX_DOMAINS.get(node.domain)
        if domain is None:
            return None
        op = node.op_type
        form = self._forms.get((op, domain), _UNSEEN)
        if form is _UNSEEN:
            version = self.opsets.get(domain)
            form = self._forms[op, domain] = _form(op, version, domain) if version is not None else None
        return form

    def _unavailable(self, node: onnx.NodeProto) -> str | None:
        domain = ONNX_DOMAINS.get(node.domain)
        version = self.opsets.get(domain) if domain is not None else None
        return None if version is None else _unavailable(node.op_type, version, domain)

    def invalid(self, node: onnx.NodeProto, ins: Sequence[str], outs: Sequence[str]) -> bool:
        """Whether ``node`` (its input names ``ins`` and output names ``outs``) is invalid. Call it on the
        nodes in order: a valid node's output types are kept for the nodes after it."""
        form = self.form(node)
        if form is None:
            return self._unavailable(node) is not None
        (ilo, ihi), _ = form.inputs
        (olo, ohi), _ = form.outputs
        if ilo <= len(ins) <= ihi and olo <= len(outs) <= ohi and "" not in ins and "" not in outs:
            attrs = node.attribute
            valid = not form.required
            if attrs:
                known = form.attributes
                for a in attrs:
                    if known.get(a.name) != a.type:
                        valid = False
                        break
        else:
            valid = False
        if not valid and _problem(node, form, ins, outs) is not None:
            return True
        bound = _bind(form, ins, self.types)
        if isinstance(bound, str):
            return True
        types = self.types
        given = _output_types(node, form, outs, bound, types)
        if _misdeclared(given, outs, types) is not None:
            return True
        if node.op_type in _RELATED and _relation_problem(node, types) is not None:
            return True
        types.update((outs[j], t) for j, t in given)
        return False

    def problem(self, node: onnx.NodeProto, k: int, where: str = "") -> str | None:
        """What is wrong with ``node`` (index ``k`` in its graph, for an unnamed one), as a message naming the
        node, op and opset after ``where``; None when it is valid or not checked."""
        form = self.form(node)
        why = None
        if form is not None:
            ins = tuple(node.input)
            outs = tuple(node.output)
            why = (_problem(node, form, ins, outs) or _type_problem(form, ins, self.types)
                   or _relation_problem(node, self.types)
                   or _declared_problem(node, form, ins, outs, self.types))
        else:
            why = self._unavailable(node)
        if why is None:
            return None
        version = self.opsets[ONNX_DOMAINS[node.domain]]
        return f"{where}node {node_label(node, k)} ({op_name(node)}, opset {version}): {why}"


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
        d = ONNX_DOMAINS.get(o.domain)
        if d is not None:
            out[d] = int(o.version)
    return out


def invalid_nodes(graph: onnx.GraphProto, opsets: Mapping[str, int] | NodeChecker, where: str = "",
                  limit: int = 10, outer: Mapping[str, str] | None = None) -> list[str]:
    """One message per invalid node of ``graph`` and of the bodies of its control-flow nodes (at most
    ``limit``): the node (its name, or its index when unnamed), op, opset and what is wrong. ``opsets``:
    domain → version, ONNX's own domain under ``""`` (or the :class:`NodeChecker` of the graph around
    ``graph``). ``outer``, with ``opsets`` a mapping: the types of the outer values ``graph`` reads (a
    body compiled on its own, whose captures are untyped inputs)."""
    check = opsets.within(graph) if isinstance(opsets, NodeChecker) else NodeChecker(opsets, graph, outer)
    out: list[str] = []
    for k, node in enumerate(graph.node):
        if check.invalid(node, tuple(node.input), tuple(node.output)):
            out.append(check.problem(node, k, where) or "")
            if len(out) >= limit:
                return out
        if node.op_type in _BODY_OPS:
            for name, g in named_subgraphs(node):
                inside = f"{where}node {node_label(node, k)} ({op_name(node)}), {name}: "
                out += invalid_nodes(g, check, inside, limit - len(out))
                if len(out) >= limit:
                    return out[:limit]
    return out


def checked_opsets(model: onnx.ModelProto) -> dict[str, int]:
    """The opsets nodes are checked at: the model's ONNX opset (the engine's default when it imports none) and
    its ``ai.onnx.ml`` one when it imports it."""
    from onnxtrain.engine.interface import default_opset

    return {"": default_opset(model), **model_opsets(model)}


def check_nodes(model: onnx.ModelProto, outer_types: Mapping[str, str] | None = None) -> None:
    """Raise :class:`~onnxtrain.engine.interface.InvalidNodeError` naming the nodes of ONNX's domains (``""``,
    ``"ai.onnx.ml"``), bodies included, that their schemas at the model's opsets do not allow.
    ``outer_types``: the types of the values of the graphs enclosing the model's graph (a body's)."""
    from onnxtrain.engine.interface import InvalidNodeError

    found = invalid_nodes(model.graph, checked_opsets(model), outer=outer_types)
    if len(found) == 1:
        raise InvalidNodeError(found[0])
    if found:
        more = "+" if len(found) >= 10 else ""
        raise InvalidNodeError(f"{len(found)}{more} invalid nodes:\n  " + "\n  ".join(found))
