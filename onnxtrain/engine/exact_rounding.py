"""Transcendental float32 steps whose last bit decides a discrete result, computed correctly rounded.

numpy's float32 exp, log, sin, tanh, ... are SIMD approximations (SVML's on AVX-512 hosts) that differ from
the correctly rounded float32 by one ulp on 10-48 % of inputs; torch's differ on under 1 % for most of them,
and both are within the accuracy ONNX asks. That ulp vanishes in continuous arithmetic but not where a
step turns values into integers or truth values: Hugging Face DeBERTa-v2's relative-position buckets are
``ceil(log(|p| / mid) / log(c) * (mid - 1))``, whose argument falls on integers, so a log one ulp high moves
a bucket and the model's logits with it.

At plan build, each step of :data:`SOURCES` whose result reaches one of :data:`DISCRETE` through steps of
:data:`CONTINUOUS` gets a kernel that computes float32 inputs in float64 and rounds once (the correctly
rounded float32 but for double-rounding ties, about one value in 2**29). The float64 route costs 3x (Exp)
to 30x (Tanh) the float32 ufunc. Most steps it marks compute indices (position buckets, counts), but an
activation is marked too when a comparison reads it: a Tanh before a Relu, an Abs or a LeakyRelu in a
training graph, whose gradients compare the Tanh's output with 0 (a Tanh-Relu MLP's step ~1.1x slower).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx

from onnxtrain.engine.registry import Attrs, Kernel

# numpy-ufunc ops whose float32 SIMD results are not correctly rounded
SOURCES = frozenset({"Exp", "Log", "Tanh", "Sin", "Cos", "Tan", "Atan", "Sinh", "Cosh", "Asinh", "Asin",
                     "Acos", "Acosh", "Atanh"})
# steps whose result is continuous in their float inputs (or moves or picks them unchanged): the walk goes on
CONTINUOUS = SOURCES | frozenset({
    "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Reciprocal", "Sqrt", "Pow", "Max", "Min", "Clip", "Relu",
    "Sum", "Mean", "ReduceMax", "ReduceMin",
    "Identity", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Expand", "Transpose", "Concat", "Slice",
    "Split", "Pad", "Gather", "GatherElements", "GatherND", "Where", "Tile"})
# steps that map a real to a discrete value
DISCRETE = frozenset({"Ceil", "Floor", "Round", "Sign", "Equal", "Less", "Greater", "LessOrEqual",
                      "GreaterOrEqual"})
_FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                          onnx.TensorProto.BFLOAT16})

RawStep = tuple[onnx.NodeProto, Kernel, Attrs, list[int], list[int]]


def _cast_to(node: onnx.NodeProto) -> int | None:
    for a in node.attribute:
        if a.name == "to":
            return int(a.i)
    return None


def _kind(node: onnx.NodeProto) -> str:
    """'discrete', 'continuous' or 'stop' for a step reading a value a source's result reaches."""
    op = node.op_type
    if node.domain not in ("", "ai.onnx"):
        return "stop"
    if op in DISCRETE:
        return "discrete"
    if op == "Cast":
        to = _cast_to(node)
        return "continuous" if to in _FLOAT_TYPES else "discrete"
    return "continuous" if op in CONTINUOUS else "stop"


def deciding_sources(steps: Sequence[RawStep]) -> set[int]:
    """Indices of the :data:`SOURCES` steps whose outputs reach a :data:`DISCRETE` step (or a Cast to a
    non-float type) through :data:`CONTINUOUS` steps only."""
    readers: dict[int, list[int]] = {}
    for k, (_, _, _, ins, _) in enumerate(steps):
        for s in ins:
            if s >= 0:
                readers.setdefault(s, []).append(k)
    # a step reads only earlier steps' outputs, so walking back from the last step finds each reader decided
    decides = [False] * len(steps)  # step index → its outputs reach a discrete step
    for k in range(len(steps) - 1, -1, -1):
        decides[k] = any(
            kind == "discrete" or (kind == "continuous" and decides[r])
            for s in steps[k][4] for r in readers.get(s, ()) for kind in (_kind(steps[r][0]),))
    sources = [k for k, (node, *_rest) in enumerate(steps)
               if node.op_type in SOURCES and node.domain in ("", "ai.onnx")]
    if not any(decides[k] for k in sources):
        return set()
    # a step equal to a marked one (a recomputed copy of a forward step, whose result the backward compares)
    # is marked too: the copies must give the same bits
    same = _equal_steps(steps)
    marked = {same[k] for k in sources if decides[k]}
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


# kernel → its rounded_once wrapper: one per kernel, so that equal marked steps stay equal (the plan's common
# subexpression elimination compares kernels)
_WRAPPERS: dict[Kernel, Kernel] = {}


def rounded_once(fn: Kernel) -> Kernel:
    """``fn`` computing a float32 input (an array, or the numpy scalar a one-element Gather gives) in
    float64, its result rounded to float32 once; the same wrapper for the same ``fn``."""
    made = _WRAPPERS.get(fn)
    if made is not None:
        return made

    def run(inputs: Sequence[Any], attrs: Attrs) -> Sequence[Any]:
        x = inputs[0]
        if type(x) in (np.ndarray, np.float32) and x.dtype == np.float32:
            (r,) = fn([x.astype(np.float64)], attrs)
            return (np.asarray(r).astype(np.float32),)
        return fn(inputs, attrs)

    run.rounds_exactly = True  # type: ignore[attr-defined]  # read by the elementwise fusion: not a ufunc
    return _WRAPPERS.setdefault(fn, run)


def round_deciding_steps(steps: list[RawStep]) -> list[RawStep]:
    """``steps`` with the kernel of each :func:`deciding_sources` step wrapped by :func:`rounded_once`."""
    marked = deciding_sources(steps)
    return [(node, rounded_once(fn), attrs, ins, outs) if k in marked else (node, fn, attrs, ins, outs)
            for k, (node, fn, attrs, ins, outs) in enumerate(steps)]


def rounds_exactly(fn: Callable[..., Any]) -> bool:
    """True for a kernel made by :func:`rounded_once`."""
    return bool(getattr(fn, "rounds_exactly", False))
