"""Transcendental float32 steps whose last bit decides a discrete result, computed correctly rounded.

numpy's float32 exp, log, sin, tanh, ... are SIMD approximations (SVML's on AVX-512 hosts) that differ from
the correctly rounded float32 by one ulp on 10-48 % of inputs; torch's differ on under 1 % for most of them,
and both are within the accuracy ONNX asks. That ulp vanishes in continuous arithmetic but not where a
step turns values into integers or truth values: Hugging Face DeBERTa-v2's relative-position buckets are
``ceil(log(|p| / mid) / log(c) * (mid - 1))``, whose argument falls on integers, so a log one ulp high moves
a bucket and the model's logits with it.

At plan build, each step of :data:`SOURCES` whose result reaches a :data:`ROUNDING` step, a Cast to a
non-float type, a :data:`COMPARING` step or a :data:`SELECTING` step through :data:`CONTINUOUS` steps gets a
kernel that computes float32 inputs in float64 and rounds once (the correctly rounded float32 but for
double-rounding ties, about one value in 2**29). numpy's loops keep the correctly rounded value's sign and
zeros, so a ``Sign`` or a comparison with a constant 0 of a value that passed only :data:`SIGN_KEEPING` steps
since a :data:`SIGN_EXACT_SOURCES` step (a ReLU, Abs or LeakyRelu gradient's mask of a Tanh's output) decides
nothing. The float64 route costs 3x (Exp) to 30x (Tanh) the float32 ufunc; the steps it marks compute
indices (position buckets, counts).

:data:`FORMULA_SOURCES` are the engine's float32 formulas over such functions (share of 1 M float32 inputs
off the float64 value rounded once, here; float64 route's cost on 1 M values in [-8, 8], two runs on a
loaded host): Sigmoid, 1 / (1 + exp(-x)) (44 %, up to 3 ulps; 1.1-3x); Erf, the engine's table (23 %, 1
ulp; 9-12x, its float64 erf within 3 float64 ulps of libm's, the same float32 roundings on 2.5 M inputs);
Softplus, exp and log1p (23 %; 2.6-3.7x); Elu, Selu and Celu, expm1 (19-32 %; 3-6x); Mish, softplus and
tanh (45 %; 3x); Gelu, erf or tanh (55 %; digits lost to cancellation from -4 down, -0.0 from -6 down
where the value is a normal float; 3-6x, 11-14x for the erf form, whose tail below -3 takes an erfc of its
own, over whole arrays: :mod:`~onnxtrain.engine.exact_kernels`). Their float32
zeros are not all the float64 route's (Gelu's), so any comparison they reach decides, but for Sigmoid's:
its route keeps the float32 kernel's 0 below -88.72284, where float32's exp(-x) overflows (torch's sigmoid
is 0 there too), and is positive above, as the float32 kernel is (NaNs, zeros and signs the same on every
float32 here), so a sign test of a Sigmoid's output does not mark it.
HardSigmoid, HardSwish, Softsign, LeakyRelu and Pow's cubes are float32 arithmetic, each operation rounded
as IEEE asks (HardSwish is off the float64 value on 27 % of inputs, as ``x * x * x`` is off x**3): their
results are the same on any host, so they are not sources; the walk passes through them
(:data:`EXACT_FORMULAS`), as a source's error before them reaches what comes after.

:data:`SELECTING` steps pick indices by comparing values with each other: one ulp turns two neighbours
into equals (ArgMax takes the first) or orders equals, as for 132 of 6,000 pairs of neighbours' numpy
exps here. A Softmax stops the walk as a ReduceSum does (its sum's last bit depends on the order of
addition, whatever its exps'): an ``ArgMax(Softmax(x))`` marks nothing and keeps its cost. The Softmax
itself is not a source: 67 % of its float32 values are off the float64 Softmax rounded once (a (1024,
1000) input), but the float64 route costs 3.3x (1.3 -> 4.3 ms there), and the argmax of those rows was
the same in both.

The walk follows a value into the bodies of :data:`BODIES` steps (read from the ONNX graphs, not the bodies'
plans): a value a body captures, a Loop's carried value (around the loop too: a state output is the next
iteration's input), a Scan's input, and through the bodies' outputs to the steps after the node. A source
inside a body whose result leaves it (or goes around a Loop) is found the other way round: before a plan
builds its control-flow steps' bodies, :func:`body_sinks` walks its ONNX graph (its own deciding outputs, if
it is a body, as sinks) and gives each body the outputs that decide after the node or in a later iteration,
which the body's plan marks as sinks of its own walk, and so on down nested bodies. A nested control-flow
node is read at the model's opset (Scan-8's inputs start with the sequence lengths).

MaxPool passes its values output on as :data:`SIGN_KEEPING` steps do (a max of each window); its Indices
output, when the node has one, is an argmax over each window, so a source that reaches MaxPool's input
decides then, as before a :data:`SELECTING` step. A training graph's MaxPool gradient reads the Indices, so
a Tanh before a MaxPool is marked there (a Conv-Tanh-MaxPool-Linear training step, batch 8: 1.01x, its
Tanh of 27,648 values 11 -> 56 us).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper

from onnxtrain.engine.exact_kernels import FLOAT64_KERNELS
from onnxtrain.engine.registry import Attrs, Kernel
from onnxtrain.ir.attrs import parse_attributes
from onnxtrain.ir.graphs import body_reads, captured_names, subgraphs

# numpy-ufunc ops whose float32 SIMD results are not correctly rounded (but have its sign and its zeros)
UFUNC_SOURCES = frozenset({"Exp", "Log", "Tanh", "Sin", "Cos", "Tan", "Atan", "Sinh", "Cosh", "Asinh", "Asin",
                           "Acos", "Acosh", "Atanh"})
# ops whose float32 kernels are formulas over an inexact exp, expm1, log1p, tanh or the engine's table erf,
# rounded after each step; their zeros are not all the float64 route's (Gelu's float32 kernel gives -0.0 from
# -6 down, where the value is a negative normal float), so a test of their sign decides, but for Sigmoid's
FORMULA_SOURCES = frozenset({"Sigmoid", "Erf", "Softplus", "Elu", "Selu", "Celu", "Mish", "Gelu"})
SOURCES = UFUNC_SOURCES | FORMULA_SOURCES
# sources whose float32 results have the float64 route's signs, zeros and NaNs, so that a sign test of their
# values decides nothing: numpy's ufuncs, and Sigmoid (0 where float32's exp(-x) overflows in both routes,
# positive elsewhere: the same on all 2**32 float32 inputs here)
SIGN_EXACT_SOURCES = UFUNC_SOURCES | {"Sigmoid"}
# float32 formulas of IEEE arithmetic only (the same bits on any host): not sources, but continuous in their
# input, so a source's one-ulp error passes through them to a decision; not sign-keeping (LeakyRelu's α·x of a
# tiny negative value may round to -0.0)
EXACT_FORMULAS = frozenset({"HardSigmoid", "HardSwish", "Softsign", "LeakyRelu"})
# steps that keep each value's sign and zeros (move, pick, clamp at 0 or negate values): the walk goes on, and
# a value that only passed these since its source still has the correctly rounded value's sign
SIGN_KEEPING = frozenset({
    "Relu", "Abs", "Neg", "ReduceMax", "ReduceMin", "Identity", "Reshape", "Unsqueeze", "Squeeze", "Flatten",
    "Expand", "Transpose", "Concat", "Slice", "Split", "Pad", "Gather", "GatherElements", "GatherND", "Where",
    "Tile"})
# other steps whose result is continuous in their float inputs: the walk goes on
CONTINUOUS = SOURCES | SIGN_KEEPING | EXACT_FORMULAS | frozenset({
    "Add", "Sub", "Mul", "Div", "Reciprocal", "Sqrt", "Pow", "Max", "Min", "Clip", "Sum", "Mean"})
# steps that map a real to an integer: a one-ulp change moves their result at their thresholds
ROUNDING = frozenset({"Ceil", "Floor", "Round"})
# steps that map a real to a truth value or a sign: a one-ulp change moves their result, unless they test the
# sign of a value that only passed SIGN_KEEPING steps since its source (a ReLU gradient's ``x > 0``)
COMPARING = frozenset({"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Sign"})
# steps that pick indices by comparing their input's values with each other (TopK's values pass on, but its
# indices are made all the same; Hardmax is a one-hot ArgMax)
SELECTING = frozenset({"ArgMax", "ArgMin", "TopK", "Hardmax"})
DISCRETE = ROUNDING | COMPARING | SELECTING
# control-flow ops whose bodies the walk follows a value into (passed in, or captured)
BODIES = frozenset({"If", "Loop", "Scan"})
_FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                          onnx.TensorProto.BFLOAT16})
# the float types a float32 cast to keeps its value (float16 and bfloat16 keep signs, not zeros)
_KEEPING_FLOATS = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE})
_ZERO_TEST_MAX = 64  # a constant of more values is not looked at for being all zeros

RawStep = tuple[onnx.NodeProto, Kernel, Attrs, list[int], list[int]]


def _is_zeros(value: Any) -> bool:
    """True for a small numeric constant all of whose values are 0."""
    size = getattr(value, "size", None)
    return (size is not None and 0 < size <= _ZERO_TEST_MAX and getattr(value, "dtype", None) is not None
            and value.dtype.kind in "fiub" and not np.any(value))


def zero_slots(steps: Sequence[RawStep], constants: dict[int, Any]) -> set[int]:
    """The slots holding a constant of zeros: of ``constants`` (slot → initializer value) and of the
    ``Constant`` steps (their values as the plan parsed them: a large one is not converted again)."""
    zeros = {s for s, v in constants.items() if _is_zeros(v)}
    for node, _, attrs, _, outs in steps:
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attribute) != 1:
            continue
        name = node.attribute[0].name
        value = attrs.get(name)
        if name == "value" and _is_zeros(value) or name in ("value_float", "value_int") and value == 0:
            zeros.update(o for o in outs if o >= 0)
    return zeros


_NO: tuple[bool, bool] = (False, False)
Reach = tuple[bool, bool]  # (general, signed): a value decides; it does with its correctly rounded sign


def _any(pairs: Sequence[Reach]) -> Reach:
    """(general, signed) of values read together: either decides."""
    return any(p[0] for p in pairs), any(p[1] for p in pairs)


def _reach(step: RawStep, value: int, exact_sign: bool, zeros: set[int], reach: dict[int, Reach], memo: dict
           ) -> bool:
    """Whether ``value`` read by ``step`` decides a discrete result: ``exact_sign`` when the value has its
    correctly rounded sign; ``reach``: (general, signed) of the slots the walk has passed; ``memo``: the
    bodies looked into so far."""
    node, attrs, ins, outs = step[0], step[2], step[3], step[4]
    op = node.op_type
    if node.domain not in ("", "ai.onnx"):
        return False
    if op in ROUNDING or op in SELECTING:
        return True
    if op in COMPARING:
        tests_sign = op == "Sign" or any(s in zeros for s in ins if s != value)
        return not (exact_sign and tests_sign)
    after = [reach.get(o, _NO) if o >= 0 else _NO for o in outs]
    general, signed = _any(after)
    if op == "MaxPool":
        # its Indices output is an argmax over each window; its values, a max (sign-keeping)
        if len(outs) > 1 and outs[1] >= 0 and ins and ins[0] == value:
            return True
        return after[0][1] if exact_sign else after[0][0]
    if op == "Cast":
        to = attrs.get("to")  # as the plan parsed it
        if to not in _FLOAT_TYPES:
            return True
        # float16, bfloat16: two float32 neighbours can round to 0 and to the type's smallest step
        return signed if exact_sign and to in _KEEPING_FLOATS else general
    if op in SIGN_KEEPING:
        return signed if exact_sign else general
    if op in BODIES:
        return _into_bodies(step, value, exact_sign, tuple(after), zeros, memo)
    return general if op in CONTINUOUS else False


def _slot_reach(steps: Sequence[RawStep], slot: int, zeros: set[int], reach: dict[int, Reach],
                readers: dict[int, list[int]], sinks: dict[int, Reach], memo: dict) -> Reach:
    """(general, signed) of ``slot``: what its readers in ``steps`` decide, or ``sinks`` says for it (what
    reads it outside ``steps``)."""
    rs = readers.get(slot, ())
    sink = sinks.get(slot, _NO)
    hit = sink[0] or any(_reach(steps[r], slot, False, zeros, reach, memo) for r in rs)
    return hit, hit and (sink[1] or any(_reach(steps[r], slot, True, zeros, reach, memo) for r in rs))


def _walk_back(steps: Sequence[RawStep], zeros: set[int], memo: dict, sinks: dict[int, Reach]
               ) -> tuple[dict[int, Reach], dict[int, list[int]]]:
    """(general, signed) of each slot a step makes: whether it reaches a discrete result, and whether it
    does when it has the correctly rounded sign; ``sinks``: the same for values read outside ``steps`` (a
    body's outputs); and the readers of each slot."""
    readers: dict[int, list[int]] = {}
    for k, (_, _, _, ins, _) in enumerate(steps):
        for s in ins:
            if s >= 0:
                readers.setdefault(s, []).append(k)
    # a step reads only earlier steps' outputs, so walking back from the last step finds each reader decided
    reach: dict[int, Reach] = {}
    for k in range(len(steps) - 1, -1, -1):
        for s in steps[k][4]:
            if s >= 0:
                reach[s] = _slot_reach(steps, s, zeros, reach, readers, sinks, memo)
    return reach, readers


def _into_bodies(step: RawStep, value: int, exact_sign: bool, after: tuple[Reach, ...], zeros: set[int],
                 memo: dict) -> bool:
    """Whether ``value``, passed by the control-flow ``step`` into its bodies (a Loop's carried value, a
    Scan's input, a value a body captures), decides a discrete result in a body or, through the node's
    outputs, after it (``after``: each node output's (general, signed))."""
    node, fn, attrs, ins = step[0], step[1], step[2], step[3]
    opset = getattr(attrs, "opset", 0) or onnx.defs.onnx_opset_version()
    captured = getattr(fn, "captures", None)
    if captured is None:
        captured = body_reads(node)
    n = len(node.input)
    zero_names = frozenset(captured[p - n] for p in range(n, len(ins)) if ins[p] in zeros)
    for p, s in enumerate(ins):
        if s != value:
            continue
        for g in subgraphs(node):
            body = _body_reach(g, node, opset, after, zero_names, memo)
            if p < n:
                i = _body_input_index(node, p, opset)
                hit = body[0][i] if i is not None and i < len(body[0]) else _NO
            else:
                hit = body[1].get(captured[p - n], _NO)
            if hit[1 if exact_sign else 0]:
                return True
    return False


def _body_input_index(node: onnx.NodeProto, p: int, opset: int) -> int | None:
    """The body input that the node's input ``p`` becomes (None for a Loop's trip count and condition and
    an If's condition)."""
    if node.op_type == "Loop":
        return p if p >= 2 else None
    if node.op_type == "Scan":
        if opset >= 9:
            return p
        return p - 1 if p >= 1 else None  # Scan-8's first input is the sequence lengths
    return None


def _body_output_index(node: onnx.NodeProto, j: int) -> int | None:
    """The node output that the body's output ``j`` becomes (None for a Loop's condition)."""
    if node.op_type == "Loop":
        return j - 1 if j >= 1 else None
    return j


def _carried(node: onnx.NodeProto, graph: onnx.GraphProto, opset: int) -> list[tuple[int, int]]:
    """(body output, body input) pairs of a Loop's or Scan's state: the output is the next iteration's
    input."""
    if node.op_type == "Loop":
        return [(1 + j, 2 + j) for j in range(len(node.input) - 2)]
    if node.op_type == "Scan":
        scans = next((a.i for a in node.attribute if a.name == "num_scan_inputs"), 0)
        states = len(node.input) - scans - (1 if opset < 9 else 0)
        return [(j, j) for j in range(states)]
    return []


def _graph_steps(graph: onnx.GraphProto, opset: int) -> tuple[list[RawStep], dict[str, int]]:
    """The raw steps of ``graph``'s nodes as the walk reads them (no kernels; the attributes parsed at
    ``opset``, which a control-flow node's bodies are read at), and the slot of each name (its inputs
    first)."""
    slots: dict[str, int] = {}
    for v in graph.input:
        slots.setdefault(v.name, len(slots))
    steps: list[RawStep] = []
    for nd in graph.node:
        ins = [slots.setdefault(x, len(slots)) if x else -1 for x in nd.input]
        ins += [slots.setdefault(x, len(slots)) for x in body_reads(nd)]
        outs = [slots.setdefault(x, len(slots)) if x else -1 for x in nd.output]
        try:
            values = parse_attributes(nd, opset)
        except Exception:  # an op of another domain, or none ONNX knows: the walk stops there anyway
            values = {}
        steps.append((nd, None, Attrs(values, nd.op_type, nd.name, opset), ins, outs))
    return steps, slots


def _graph_zeros(graph: onnx.GraphProto, steps: Sequence[RawStep], slots: dict[str, int],
                 zero_names: frozenset[str] | set[str]) -> set[int]:
    """The slots of ``graph`` holding constant zeros: its small initializers', its Constants' and those of
    ``zero_names``."""
    constants = {slots[t.name]: onnx.numpy_helper.to_array(t) for t in graph.initializer
                 if t.name in slots and 0 < np.prod(t.dims) <= _ZERO_TEST_MAX}
    return zero_slots(steps, constants) | {slots[z] for z in zero_names if z in slots}


def _body_reach(graph: onnx.GraphProto, node: onnx.NodeProto, opset: int, after: tuple[Reach, ...],
                zero_names: frozenset[str], memo: dict
                ) -> tuple[list[Reach], dict[str, Reach], list[Reach]]:
    """(general, signed) of each input of the body ``graph`` of ``node``, of each value it captures and of
    each of its outputs, its outputs reaching ``after`` (the node's outputs'), a state output also what its
    next iteration's input reaches; ``zero_names``: the captured values that are constant zeros."""
    key = (id(graph), after, zero_names)
    kept = memo.get(key)
    if kept is not None and kept[0] is graph:
        return kept[1]
    steps, slots = _graph_steps(graph, opset)
    for v in graph.output:
        slots.setdefault(v.name, len(slots))
    zeros = _graph_zeros(graph, steps, slots, zero_names)
    out_slots = [slots[v.name] for v in graph.output]
    sinks: dict[int, Reach] = {}
    for j, s in enumerate(out_slots):
        i = _body_output_index(node, j)
        if i is not None and i < len(after):
            sinks[s] = _any([sinks.get(s, _NO), after[i]])
    inputs = [slots[v.name] for v in graph.input]
    while True:
        reach, readers = _walk_back(steps, zeros, memo, sinks)
        reach_in = [_slot_reach(steps, s, zeros, reach, readers, sinks, memo) for s in inputs]
        changed = False
        for o, i in _carried(node, graph, opset):
            if o < len(out_slots) and i < len(reach_in):
                was = sinks.get(out_slots[o], _NO)
                now = _any([was, reach_in[i]])
                changed |= now != was
                sinks[out_slots[o]] = now
        if not changed:
            break
    free = {name: _slot_reach(steps, slots[name], zeros, reach, readers, sinks, memo)
            for name in captured_names(graph) if name in slots}
    outs = [sinks.get(s, _NO) for s in out_slots]
    result = (reach_in, free, outs)
    memo[key] = (graph, result)
    return result


def body_sinks(graph: onnx.GraphProto, opset: int, deciding: Mapping[str, Reach],
               constants: Mapping[str, Any]) -> dict[int, dict[str, dict[str, Reach]]]:
    """Per control-flow node of ``graph`` (by index), per body (by attribute name), the body's outputs that
    decide a discrete result after the node or, carried, in a later iteration (by name: their (general,
    signed)), for the plan to build the body with (``deciding`` of its own outputs). ``deciding``: the
    same for ``graph``'s outputs; ``constants``: its initializers' values by name (a feed may not
    override them)."""
    flows = [k for k, nd in enumerate(graph.node) if nd.op_type in BODIES and nd.domain in ("", "ai.onnx")
             and any(_holds_sources(g) for g in subgraphs(nd))]
    if not flows:
        return {}
    steps, slots = _graph_steps(graph, opset)
    sinks: dict[int, Reach] = {}
    for name, r in deciding.items():
        if name in slots:
            sinks[slots[name]] = _any([sinks.get(slots[name], _NO), r])
    zeros = zero_slots(steps, {slots[n]: v for n, v in constants.items() if n in slots})
    memo: dict = {}
    reach, _ = _walk_back(steps, zeros, memo, sinks)
    found: dict[int, dict[str, dict[str, Reach]]] = {}
    for k in flows:
        nd, _, attrs, ins, outs = steps[k]
        after = tuple(reach.get(o, _NO) if o >= 0 else _NO for o in outs)
        captured = body_reads(nd)
        n = len(nd.input)
        zero_names = frozenset(captured[p - n] for p in range(n, len(ins)) if ins[p] in zeros)
        for a in nd.attribute:
            if a.type != onnx.AttributeProto.GRAPH:
                continue
            outs_reach = _body_reach(a.g, nd, opset, after, zero_names, memo)[2]
            named = {v.name: r for v, r in zip(a.g.output, outs_reach) if r[0]}
            if named:
                found.setdefault(k, {})[a.name] = named
    return found


def _holds_sources(graph: onnx.GraphProto) -> bool:
    """Whether ``graph`` or a body in it has a :data:`SOURCES` step (else its bodies have nothing to mark)."""
    return any(nd.op_type in SOURCES or any(_holds_sources(g) for g in subgraphs(nd)) for nd in graph.node)


def deciding_sources(steps: Sequence[RawStep], zeros: set[int] = frozenset(),
                     sinks: Mapping[int, Reach] | None = None) -> set[int]:
    """Indices of the :data:`SOURCES` steps whose outputs reach a :data:`ROUNDING` step, a Cast to a
    non-float type, a :data:`COMPARING` or a :data:`SELECTING` step through :data:`CONTINUOUS` steps and
    into the bodies of :data:`BODIES` steps, but for comparisons with a constant of ``zeros`` (and ``Sign``)
    of values that passed :data:`SIGN_KEEPING` steps only; ``sinks``: the slots read after ``steps`` (a
    body's outputs) that decide, as (general, signed)."""
    if not any(node.op_type in SOURCES for node, *_rest in steps):
        return set()
    reach, _ = _walk_back(steps, zeros, {}, dict(sinks or {}))

    def of(k: int) -> Reach:
        return _any([reach.get(o, _NO) for o in steps[k][4] if o >= 0])

    # a source decides when its outputs do with their correctly rounded signs (a formula's float32 zeros
    # are not those: any reach counts)
    deciding = [k for k, (node, *_rest) in enumerate(steps) if node.domain in ("", "ai.onnx") and (
        of(k)[1] if node.op_type in SIGN_EXACT_SOURCES else node.op_type in SOURCES and of(k)[0])]
    if not deciding:
        return set()
    sources = [k for k, (node, *_rest) in enumerate(steps)
               if node.op_type in SOURCES and node.domain in ("", "ai.onnx")]
    # a step equal to a marked one (a recomputed copy of a forward step, whose result the backward compares)
    # is marked too: the copies must give the same bits
    same = _equal_steps(steps)
    marked = {same[k] for k in deciding}
    return {k for k in sources if same[k] in marked}


def _equal_steps(steps: Sequence[RawStep]) -> list[int]:
    """Per step, a number equal for the steps that compute the same op with the same attributes on the same
    values (numbered alike: a value equal to another computes from equal steps)."""
    number: dict[tuple, int] = {}
    value: dict[int, tuple] = {}  # slot → (the number of the step that makes it, which output)
    out = []
    for node, _, _, ins, outs in steps:
        attrs = b"".join(a.SerializeToString(deterministic=True) for a in node.attribute)
        key = (node.domain, node.op_type, attrs, tuple(value.get(s, ("slot", s)) for s in ins))
        n = number.setdefault(key, len(number))
        out.append(n)
        for i, s in enumerate(outs):
            if s >= 0:
                value[s] = (n, i)
    return out


# (kernel, float64 kernel) → its rounded_once wrapper: one per kernel, so that equal marked steps stay equal
# (the plan's common subexpression elimination compares kernels)
_WRAPPERS: dict[tuple[Kernel, Kernel | None], Kernel] = {}


def rounded_once(fn: Kernel, wide: Kernel | None = None) -> Kernel:
    """``fn`` computing a float32 input (an array, or the numpy scalar a one-element Gather gives) in
    float64 (by ``wide`` when given, else by ``fn`` itself), its result rounded to float32 once; the same
    wrapper for the same kernels."""
    made = _WRAPPERS.get((fn, wide))
    if made is not None:
        return made
    in_float64 = fn if wide is None else wide

    def run(inputs: Sequence[Any], attrs: Attrs) -> Sequence[Any]:
        x = inputs[0]
        if type(x) in (np.ndarray, np.float32) and x.dtype == np.float32:
            (r,) = in_float64([x.astype(np.float64)], attrs)
            return (np.asarray(r).astype(np.float32),)
        return fn(inputs, attrs)

    run.rounds_exactly = True  # type: ignore[attr-defined]  # read by the elementwise fusion: not a ufunc
    return _WRAPPERS.setdefault((fn, wide), run)


def round_deciding_steps(steps: list[RawStep], constants: dict[int, Any],
                         sinks: Mapping[int, tuple[bool, bool]] | None = None) -> list[RawStep]:
    """``steps`` with the kernel of each :func:`deciding_sources` step wrapped by :func:`rounded_once`;
    ``constants``: the initializers' values by slot; ``sinks``: the outputs that decide after them (a
    body's, by slot: see :func:`body_sinks`)."""
    marked = deciding_sources(steps, zero_slots(steps, constants), sinks)
    return [(node, rounded_once(fn, FLOAT64_KERNELS.get(node.op_type)), attrs, ins, outs) if k in marked
            else (node, fn, attrs, ins, outs) for k, (node, fn, attrs, ins, outs) in enumerate(steps)]


def rounds_exactly(fn: Callable[..., Any]) -> bool:
    """True for a kernel made by :func:`rounded_once`."""
    return bool(getattr(fn, "rounds_exactly", False))
