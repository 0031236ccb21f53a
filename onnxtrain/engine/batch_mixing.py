"""Nodes that combine the samples of a batch, found by following the batch axis through a graph.

The batch split (:mod:`onnxtrain.engine.batch_split`) checks that the two halves of a batch give the whole
run's outputs, on the first batch of each size. A node that combines the samples only for some data (a
maximum over the batch of values that are zero but for outliers) passes that check and later gives wrong
results: :func:`batch_mixing_node` finds the explicit ones before any run. From the graph inputs' batch axes
it follows the axis through ops whose effect on it is known (elementwise ops, MatMul, Gemm, convolutions and
pooling, Transpose, reductions, Softmax, LayerNormalization, Concat, Gather, ...), and names the first node
that reduces, normalises, concatenates or gathers along it. Past an op it does not know (Reshape, whose
target is computed at run time, or a constant one that does not copy the batch dimension) a value's batch
axis is unknown and nothing after it is screened: the run check remains the only guard there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import onnx
from onnx import numpy_helper

from onnxtrain.ir.attrs import attribute_value, parse_attributes

# ops that keep each input's axes where they are (broadcasting aligns from the right)
_ELEMENTWISE = frozenset({
    "Abs", "Acos", "Acosh", "Add", "And", "Asin", "Asinh", "Atan", "Atanh", "BitShift", "Cast", "CastLike",
    "Ceil", "Celu", "Clip", "Cos", "Cosh", "Div", "Dropout", "Elu", "Equal", "Erf", "Exp", "Floor", "Gelu",
    "Greater", "GreaterOrEqual", "HardSigmoid", "HardSwish", "Identity", "IsInf", "IsNaN", "LeakyRelu",
    "Less", "LessOrEqual", "Log", "Max", "Mean", "Min", "Mish", "Mod", "Mul", "Neg", "Not", "Or", "PRelu",
    "Pow", "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sign", "Sin", "Sinh", "Softplus", "Softsign",
    "Sqrt", "Sub", "Sum", "Tan", "Tanh", "ThresholdedRelu", "Where", "Xor", "QuantizeLinear",
    "DequantizeLinear",
})
# ops of (N, C, ...) tensors that treat each sample apart (BatchNormalization in inference mode)
_PER_SAMPLE_NCHW = frozenset({
    "Conv", "ConvTranspose", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "LpPool",
    "InstanceNormalization", "LpNormalization", "LRN", "Resize", "Upsample", "DepthToSpace", "SpaceToDepth",
    "BatchNormalization", "GroupNormalization", "Pad",
})
_REDUCE = frozenset({"ReduceMax", "ReduceMin", "ReduceMean", "ReduceSum", "ReduceProd", "ReduceL1",
                     "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin"})
# ops whose "axis" (CumSum: its second input) picks the axis they combine or cut values along
_ALONG_AXIS = frozenset({"Concat", "Split", "Gather", "GatherElements", "TopK", "Compress", "Flatten",
                         "CumSum"})


def batch_mixing_node(model: onnx.ModelProto, input_axes: Mapping[str, int]) -> str | None:
    """The first node of ``model``'s graph that combines samples along the batch axis (``input_axes``: graph
    input → its batch axis), as "'name' (op, what)"; None when none is found where the axis is known."""
    g = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    rank: dict[str, int] = {}
    axis: dict[str, int] = {}  # value → its batch axis, where known
    for v in (*g.input, *g.value_info, *g.output):
        if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape"):
            rank[v.name] = len(v.type.tensor_type.shape.dim)
    for t in g.initializer:
        rank[t.name] = len(t.dims)
    axis.update({n: a for n, a in input_axes.items()})
    consts = {t.name: numpy_helper.to_array(t) for t in g.initializer if len(t.dims) <= 1}
    for k, node in enumerate(g.node):
        value = next((a for a in node.attribute if a.name == "value"), None)
        if node.op_type == "Constant" and node.output and value is not None:
            consts[node.output[0]] = numpy_helper.to_array(value.t)
            rank[node.output[0]] = len(value.t.dims)
        if node.domain not in ("", "ai.onnx"):
            continue
        ins = [i for i in node.input if i]
        carried = [i for i in ins if i in axis]
        if not carried:
            continue
        attrs = _attributes(node, opset)
        why = _mixes(node, attrs, axis, rank, opset, consts)
        if why:
            label = repr(node.name) if node.name else f"#{k} (unnamed)"
            return f"{label} ({node.op_type}, {why})"
        out = _output_axis(node, attrs, axis, rank, consts)
        if out is not None and node.output and node.output[0]:
            axis[node.output[0]], rank[node.output[0]] = out
    return None


def _attributes(node: onnx.NodeProto, opset: int) -> dict[str, Any]:
    """The node's attributes with its schema's defaults (``parse_attributes``); its own alone when the
    schema cannot be read."""
    try:
        return parse_attributes(node, opset)
    except Exception:  # noqa: BLE001 - an op without a schema, an attribute reference
        return {a.name: attribute_value(a) for a in node.attribute}


def _norm(a: int, r: int | None) -> int | None:
    if a >= 0:
        return a
    return None if r is None else a + r


def _axes(node: onnx.NodeProto, attrs: Mapping[str, Any], consts: Mapping[str, Any]) -> list[int] | None:
    """A reduction's axes: its attribute, or its second input when that is a constant (opset 18 on); None
    when not given, [] when given empty."""
    axes = attrs.get("axes")
    if axes is not None:
        return [int(a) for a in axes]
    if len(node.input) > 1 and node.input[1]:
        value = consts.get(node.input[1])
        return None if value is None else [int(a) for a in value.reshape(-1)]
    return None


def _mixes(node: onnx.NodeProto, attrs: Mapping[str, Any], axis: dict[str, int], rank: dict[str, int],
           opset: int, consts: Mapping[str, Any]) -> str | None:
    """Why ``node`` combines samples along its first input's batch axis, or None."""
    op, x = node.op_type, node.input[0] if node.input else ""
    if op == "Concat":  # any of its inputs may carry the batch
        x = next((i for i in node.input if i in axis), x)
    b, r = axis.get(x), rank.get(x)
    if b is None:
        return None
    if op == "BatchNormalization" and attrs.get("training_mode"):
        return "normalises with the batch's statistics (training mode)"
    if op in _REDUCE:
        if len(node.input) > 1 and node.input[1] and node.input[1] not in consts:
            return None  # axes computed at run time: not read here
        axes = [int(attrs["axis"])] if op in ("ArgMax", "ArgMin") else _axes(node, attrs, consts)
        if not axes:
            return None if attrs.get("noop_with_empty_axes") else "reduces every axis, the batch's too"
        if b in {_norm(int(a), r) for a in axes}:
            return f"reduces along the batch axis {b}"
    elif op in ("Softmax", "LogSoftmax", "Hardmax"):
        a = _norm(int(attrs["axis"]), r)  # the schema's default: -1 from opset 13, 1 before
        if a is not None and (a == b or (opset < 13 and a <= b)):
            return f"normalises along the batch axis {b}"
    elif op == "LayerNormalization":
        a = _norm(int(attrs["axis"]), r)
        if a is not None and b >= a:
            return f"normalises over the batch axis {b}"
    elif op in _ALONG_AXIS:
        if op == "CumSum":
            value = consts.get(node.input[1]) if len(node.input) > 1 else None
            a = None if value is None else int(value.reshape(-1)[0])
        else:
            a = attrs.get("axis")  # the schema's default (TopK's -1, Flatten's 1; Compress: none)
        if a is None:  # Compress without an axis flattens the input first: the samples mix
            return "flattens the batch axis with others" if op == "Compress" else None
        a = _norm(int(a), r)
        if op == "Flatten":
            return "flattens the batch axis with others" if a is not None and a <= b else None
        if a == b and not (op == "Gather" and x not in axis):
            return f"{op.lower()}s along the batch axis {b}"
    return None


def _output_axis(node: onnx.NodeProto, attrs: Mapping[str, Any], axis: dict[str, int], rank: dict[str, int],
                 consts: Mapping[str, Any]) -> tuple[int, int] | None:
    """(batch axis, rank) of ``node``'s first output when the op's effect on them is known, else None."""
    op = node.op_type
    x = node.input[0] if node.input else ""
    b, r = axis.get(x), rank.get(x)
    if op in _ELEMENTWISE:
        ranks = [rank.get(i) for i in node.input if i]
        if any(q is None for q in ranks):
            return None
        out_rank = max(ranks)  # type: ignore[type-var]
        positions = {axis[i] + out_rank - rank[i] for i in node.input if i in axis}
        return (positions.pop(), out_rank) if len(positions) == 1 else None
    if b is None or r is None:
        return None
    if op in _PER_SAMPLE_NCHW:
        return (b, r) if b == 0 else None
    if op == "Gemm":
        return (0, 2) if b == 0 and not attrs.get("transA") else None
    if op == "MatMul":
        rb = rank.get(node.input[1])
        if rb is None or node.input[1] in axis or r < 2 or b >= r - 1:
            return None
        out_rank = max(r, rb)
        return b + out_rank - r, out_rank
    if op == "Transpose":
        perm = attrs.get("perm")
        return (list(perm).index(b), r) if perm is not None and b in perm else None
    if op in _REDUCE and op not in ("ArgMax", "ArgMin"):
        axes = attrs.get("axes")  # the attribute only (opset < 18): with an axes input, not followed
        if not axes:
            return None
        if attrs.get("keepdims", 1):
            return b, r
        gone = {_norm(int(a), r) for a in axes}
        return b - sum(1 for a in gone if a is not None and a < b), r - len(gone)
    if op in ("Softmax", "LogSoftmax", "Hardmax", "LayerNormalization", "Concat", "Split", "CumSum"):
        return b, r
    if op == "Flatten":  # axes before ``axis`` become the first: the batch axis stays first when it is
        a = _norm(int(attrs["axis"]), r)
        return (0, 2) if b == 0 and a is not None and a > 0 else None
    if op in ("Unsqueeze", "Squeeze"):
        axes = _axes(node, attrs, consts)
        if axes is None:
            return None
        if op == "Unsqueeze":
            out_rank = r + len(axes)
            placed = sorted(a + out_rank if a < 0 else a for a in axes)
            pos = b
            for a in placed:  # each inserted axis at or before the batch's position pushes it right
                if a <= pos:
                    pos += 1
            return pos, out_rank
        gone = {a + r if a < 0 else a for a in axes}
        if not axes or b in gone:  # Squeeze of every size-1 axis: which ones is not known here
            return None
        return b - sum(1 for a in gone if a < b), r - len(gone)
    if op == "Reshape":  # a constant target that copies the dims up to the batch's (0s) keeps it in place
        target = consts.get(node.input[1]) if len(node.input) > 1 else None
        if target is None or attrs.get("allowzero"):
            return None
        dims = [int(d) for d in target.reshape(-1)]
        return (b, len(dims)) if b < len(dims) and all(d == 0 for d in dims[:b + 1]) else None
    return None
