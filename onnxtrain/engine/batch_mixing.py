r"""Whether the samples of a batch meet in a graph, found by following the batch axis through it.

The batch split (:mod:`onnxtrain.engine.batch_split`) runs the two halves of a batch apart; it is right only
when no node combines samples. A run check on the first batch cannot show it (a maximum over the batch of
values that are zero but for outliers agrees on that batch and not on a later one), so
:func:`batch_mixing_node` proves it from the graph before any run. From the graph inputs' batch axes it
follows the axis through every value computed from them: ops whose effect on the axis is known (elementwise
ops, MatMul, Gemm, convolutions and pooling, Transpose, reductions, Softmax, LayerNormalization, Concat,
Split, Slice, Gather, Unsqueeze/Squeeze, Flatten, Expand, ...), and ``Reshape``\s whose target puts the
batch dimension (read with ``Shape`` from a value that carries it, possibly times a constant: heads merged
into it) after dims that multiply to those before it in the input, so that the batch stays the outer part
of its axis. The shapes read from values that carry the batch are followed too (``Shape``, ``Gather``,
``Slice``, ``Concat``, ``Unsqueeze``, ``Mul`` by a constant, ...). It names the first node that reduces,
normalises, concatenates, slices or gathers along the axis, and also one past which it cannot follow the
axis (an op it does not know, a ``Reshape`` that may mix samples, a control-flow body reading such a value):
either keeps the session from splitting.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from onnxtrain.engine.interface import KEPT_VALUES
from onnxtrain.ir.attrs import attribute_value, parse_attributes
from onnxtrain.ir.builder import quiet_value_types
from onnxtrain.ir.graphs import node_reads

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
    "InstanceNormalization", "LRN", "DepthToSpace", "SpaceToDepth", "BatchNormalization",
    "GroupNormalization",
})
_REDUCE = frozenset({"ReduceMax", "ReduceMin", "ReduceMean", "ReduceSum", "ReduceProd", "ReduceL1",
                     "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin"})
# ops whose "axis" (CumSum: its second input) picks the axis they combine or cut values along
_ALONG_AXIS = frozenset({"Concat", "Split", "Gather", "GatherElements", "TopK", "Compress", "Flatten",
                         "CumSum"})


_BATCH = "B"  # a shape entry that is the batch size (times a constant factor): ("B", factor)
Entry = Any  # an int (a known size), ("B", factor), or None (unknown)


def batch_mixing_node(model: onnx.ModelProto, input_axes: Mapping[str, int],
                      output_axes: Mapping[str, int] | None = None) -> str | None:
    """Why the batch of ``model`` may not be split (``input_axes``: graph input → its batch axis;
    ``output_axes``: graph output → the axis it is split along), as "'name' (op, what)": the first node that
    combines samples along the batch axis, or past which the axis is not followed; None when the graph is
    shown to keep the samples apart."""
    g = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    rank: dict[str, int] = {}
    dims: dict[str, list[Any]] = {}  # dims, declared or inferred: an int, a symbol (str) or None
    for name, tp in quiet_value_types(model).items():
        if tp.HasField("tensor_type") and tp.tensor_type.HasField("shape"):
            shape = tp.tensor_type.shape.dim
            rank[name] = len(shape)
            dims[name] = [int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or None)
                          for d in shape]
    for t in g.initializer:
        rank[t.name] = len(t.dims)
        dims[t.name] = [int(d) for d in t.dims]
    axis: dict[str, int] = dict(input_axes)  # value → its batch axis
    # value → (outer, inner) of its batch axis, of size outer · batch · inner with the batch in the middle
    # (outer > 1: rows of the samples interleaved, [L, B, E] laid out as [L·B, E]); inner None: not known
    factor: dict[str, tuple[int, int | None]] = {}
    shapes: dict[str, tuple[list[Entry], bool]] = {}  # value → (its entries, a scalar) for sizes of the batch
    # (a big one is data, as below; an inference session's model holds no values of those: without_values)
    consts = {t.name: numpy_helper.to_array(t) for t in g.initializer
              if len(t.dims) <= 1 and int(np.prod(t.dims, dtype=np.int64)) <= _FOLD_LIMIT}
    for k, node in enumerate(g.node):
        constant = _constant(node)
        if constant is not None:
            if constant.size <= _FOLD_LIMIT:  # (a big one is data: its rank and dims are what is read)
                consts[node.output[0]] = constant
            rank[node.output[0]], dims[node.output[0]] = constant.ndim, list(constant.shape)
            continue
        folded = _folded(node, consts)
        if folded is not None:
            consts[node.output[0]] = folded
            rank[node.output[0]], dims[node.output[0]] = folded.ndim, list(folded.shape)
            continue
        reads = node_reads(node)
        carried = [i for i in reads if i in axis]
        sized = [i for i in reads if i in shapes]
        if not carried and not sized:
            continue
        label = repr(node.name) if node.name else f"#{k} (unnamed)"
        if node.domain not in ("", "ai.onnx") or len(reads) > len([i for i in node.input if i]):
            return f"{label} ({node.op_type}, reads values of the batch the screen does not follow into)"
        attrs = _attributes(node, opset)
        if carried:
            why = _mixes(node, attrs, axis, rank, opset, consts)
            if why:
                return f"{label} ({node.op_type}, {why})"
            if len({factor.get(i, (1, 1)) for i in carried}) > 1:
                return f"{label} ({node.op_type}, combines values whose batch axes are laid out differently)"
            kept = factor.get(carried[0], (1, 1))
            valued = [i for k_in, i in enumerate(node.input) if i in shapes and _has_batch(shapes[i][0])
                      and (node.op_type, k_in) not in _SHAPE_ARGUMENTS]
            if valued:  # each half would see its own half of it
                return f"{label} ({node.op_type}, uses the batch size {valued[0]!r} as a value)"
        if node.op_type in _SIZE_OPS or (sized and not carried):
            made = _shape_entries(node, attrs, axis, rank, dims, shapes, consts, factor)
            if made is None:
                if not carried and not any(_has_batch(shapes[i][0]) for i in sized):
                    continue  # sizes that do not involve the batch: constants to the screen
                return f"{label} ({node.op_type}, the batch size is not followed past it)"
            if isinstance(made[0], int):  # a tensor whose batch axis the sizes give (ConstantOfShape, ...)
                axis[node.output[0]], rank[node.output[0]], factor[node.output[0]] = made
            elif all(isinstance(e, int) for e in made[0]):  # every size known: a constant
                value = np.array(made[0], bool if all(isinstance(e, bool) for e in made[0]) and made[0]
                                 else np.int64)
                consts[node.output[0]] = value.reshape(()) if made[1] else value
                rank[node.output[0]], dims[node.output[0]] = consts[node.output[0]].ndim, list(value.shape)
            else:
                shapes[node.output[0]] = made
            continue
        outs = _output_axes(node, attrs, axis, rank, dims, shapes, consts, factor)
        if isinstance(outs, str):
            return f"{label} ({node.op_type}, {outs})"
        if outs is None:
            return f"{label} ({node.op_type}, the batch axis is not followed past it)"
        for name, out in zip(node.output, outs):
            if name:
                axis[name], rank[name] = out[0], out[1]
                factor[name] = out[2] if len(out) > 2 else kept
    for name, a in (output_axes or {}).items():
        if axis.get(name, a) != a:
            return f"output {name!r} (its batch axis is {axis[name]}, not the declared {a})"
        if factor.get(name, (1, 1))[0] != 1:
            return f"output {name!r} (its samples' rows are interleaved along its batch axis)"
    return None


# (op, input index) where a size holding the batch's is a shape argument, not a value
_SHAPE_ARGUMENTS = frozenset({("Reshape", 1), ("Expand", 1)})


def _constant(node: onnx.NodeProto) -> np.ndarray | None:
    """The value of a Constant node (any of its attributes; a sparse one: None)."""
    if node.op_type != "Constant" or not node.output or not node.attribute:
        return None
    a = node.attribute[0]
    if a.name == "value":
        return numpy_helper.to_array(a.t)
    if a.name in ("value_int", "value_ints"):
        return np.asarray(attribute_value(a), np.int64)
    if a.name in ("value_float", "value_floats"):
        return np.asarray(attribute_value(a), np.float32)
    return None


_COMPARED = {"Equal": np.equal, "Less": np.less, "Greater": np.greater, "Not": np.logical_not,
             "And": np.logical_and, "Or": np.logical_or}
_FOLDED = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Mod": np.mod, "Neg": np.negative,
           "Max": np.maximum, "Min": np.minimum}


_FOLD_LIMIT = KEPT_VALUES  # values a folded constant may hold (shapes and axes are small; a big fill is data)


def _folded(node: onnx.NodeProto, consts: Mapping[str, Any]) -> np.ndarray | None:
    """The value of an integer op on small constants (a Slice's bounds computed from the rank, say), as ONNX
    computes it, else None."""
    ins = [i for i in node.input if i]
    if not ins or len(node.output) != 1 or not all(i in consts for i in ins):
        return None
    values = [np.asarray(consts[i]) for i in ins]
    if any(v.dtype.kind not in "iub" or v.size > 64 for v in values):
        return None
    op = node.op_type
    attrs = {a.name: attribute_value(a) for a in node.attribute}
    try:
        if op == "ConstantOfShape":
            shape = [int(d) for d in values[0].reshape(-1)]
            fill = numpy_helper.to_array(node.attribute[0].t).reshape(-1) if node.attribute else np.zeros(1)
            if fill.dtype.kind not in "iub" or int(np.prod(shape, dtype=np.int64)) > _FOLD_LIMIT:
                return None
            return np.full(shape, fill[0], fill.dtype)
        if op in _COMPARED:
            return _COMPARED[op](*values)
        if op == "Where" and len(values) == 3:
            return np.where(*values)
        if op == "Mod":
            return (np.fmod if attrs.get("fmod") else np.mod)(*values)
        if op in _FOLDED:
            return functools.reduce(_FOLDED[op], values) if op != "Neg" else np.negative(values[0])
        if op == "Identity":
            return values[0]
        if op == "Cast":
            return values[0].astype(onnx.helper.tensor_dtype_to_np_dtype(int(attrs["to"])))
        if op == "Reshape" and len(values) == 2 and 0 not in values[1]:  # (a 0 copies a dim: not folded)
            return values[0].reshape(values[1])
        if op in ("Unsqueeze", "Squeeze"):
            axes = attrs.get("axes") if "axes" in attrs else (values[1].reshape(-1).tolist()
                                                               if len(values) > 1 else None)
            if axes is None:
                return np.squeeze(values[0]) if op == "Squeeze" else None
            rank = values[0].ndim + (len(axes) if op == "Unsqueeze" else 0)
            axes = tuple(int(a) % rank if rank else int(a) for a in axes)
            return np.expand_dims(values[0], axes) if op == "Unsqueeze" else np.squeeze(values[0], axes)
        if op == "Concat":
            return np.concatenate(values, axis=int(attrs.get("axis", 0)))
    except (ValueError, TypeError, KeyError, IndexError, np.exceptions.AxisError):  # left to the run
        return None
    return None


def _has_batch(entries: list[Entry]) -> bool:
    return any(isinstance(e, tuple) and e[0] == _BATCH for e in entries)


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
    if op == "BatchNormalization" and (attrs.get("training_mode") or (opset < 14 and len(node.output) > 1)):
        # (before opset 14 a node with more than one output is in training mode, named or not)
        return "normalises with the batch's statistics (training mode)"
    if op in _REDUCE:
        if len(node.input) > 1 and node.input[1] and node.input[1] not in consts:
            return "reduces along axes computed at run time"
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
            if value is None:
                return "sums along an axis computed at run time"
            a = int(value.reshape(-1)[0])
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


def _one_output_axis(node: onnx.NodeProto, attrs: Mapping[str, Any], axis: dict[str, int],
                     rank: dict[str, int], consts: Mapping[str, Any]) -> tuple[int, int] | None:
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
    if op == "MatMul":  # the batch in A's rows, B's columns or the batch dims both share; never contracted
        ra, rb = rank.get(x), rank.get(node.input[1])
        if ra is None or rb is None or ra < 2 or rb < 2:
            return None
        out_rank = max(ra, rb)
        places = set()
        for name, r_in, last in ((x, ra, out_rank - 2), (node.input[1], rb, out_rank - 1)):
            if name in axis:
                a = axis[name]
                own = r_in - 2 if name == x else r_in - 1  # A's rows, B's columns
                if a < r_in - 2:
                    places.add(a + out_rank - r_in)
                elif a == own:
                    places.add(last)
                else:
                    return None  # contracted
        return (places.pop(), out_rank) if len(places) == 1 else None
    if b is None or r is None:
        return None
    if op in _PER_SAMPLE_NCHW:
        return (b, r) if b == 0 else None
    if op == "Gemm":  # A's rows (and C's, a per-row bias) carry it; B never
        if len(node.input) > 1 and node.input[1] in axis or b != 0 or attrs.get("transA"):
            return None
        c = node.input[2] if len(node.input) > 2 else ""
        return (0, 2) if c not in axis or (axis[c] == 0 and rank.get(c) == 2) else None
    if op == "Transpose":
        perm = attrs.get("perm")
        return (list(perm).index(b), r) if perm is not None and b in perm else None
    if op in _REDUCE and op not in ("ArgMax", "ArgMin"):
        axes = _axes(node, attrs, consts)  # the attribute, or a constant axes input
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
    return None


_SIZE_OPS = frozenset({"Shape", "Size"})
# ops whose outputs all have their first input's batch axis and rank
_SAME_FOR_ALL_OUTPUTS = frozenset({"Split", "TopK", "Dropout", "MaxPool"})


def _output_axes(node: onnx.NodeProto, attrs: Mapping[str, Any], axis: dict[str, int], rank: dict[str, int],
                 dims: Mapping[str, list[int | None]], shapes: Mapping[str, tuple[list[Entry], bool]],
                 consts: Mapping[str, Any], factor: Mapping[str, tuple[int, int | None]]
                 ) -> list[tuple] | str | None:
    """(batch axis, rank) of each output of ``node``, one of whose inputs carries the batch; a reason when the
    node combines samples along it (a Slice or Reshape of the batch axis); None when not known."""
    op, x = node.op_type, node.input[0] if node.input else ""
    b, r = axis.get(x), rank.get(x)
    outputs = [o for o in node.output if o]
    if op not in _SEVERAL_CARRY and any(i in axis for i in node.input[1:] if i):
        return None  # a weight, kernel or parameter input computed from the samples (Conv(x, x), ...)
    if op == "MaxPool" and len(node.output) > 1 and node.output[1]:
        return "its indices count the positions of the whole batch"
    if b is not None and r is not None and (op in _SAME_FOR_ALL_OUTPUTS or op == "LayerNormalization"):
        # (along other axes than the batch's: _mixes refused the rest; a pool's windows are per sample)
        return None if op == "MaxPool" and b != 0 else [(b, r)] * len(node.output)
    if op in _RECURRENT:
        return _recurrent_axes(node, attrs, axis, rank)
    if len(outputs) > 1:
        return None
    if op == "Slice":
        return _slice_axis(node, attrs, b, r, consts)
    if op == "Reshape":
        return _reshape_axis(node, attrs, axis, dims, shapes, consts, factor)
    if op == "Expand":
        return _expand_axis(node, axis, rank, shapes, consts, factor)
    if op == "Gather" and x not in axis and len(node.input) > 1 and node.input[1] in axis:
        rd = rank.get(x)  # an embedding lookup of indices that carry the batch
        if rd is None or node.input[1] not in rank:
            return None
        a = _norm(int(attrs.get("axis", 0)), rd)
        return None if a is None else [(a + axis[node.input[1]], rd - 1 + rank[node.input[1]])]
    if op == "Gather" and b is not None and r is not None:
        idx = node.input[1] if len(node.input) > 1 else ""
        ri = consts[idx].ndim if idx in consts else rank.get(idx)
        a = _norm(int(attrs.get("axis", 0)), r)
        if ri is None or a is None or idx in axis:
            return None
        return [(b if b < a else b - 1 + ri, r - 1 + ri)]
    if op in ("Pad", "LpNormalization", "Resize", "Upsample"):
        return _per_sample_axis(node, attrs, b, r, consts)
    one = _one_output_axis(node, attrs, axis, rank, consts)
    return None if one is None else [one]


def _per_sample_axis(node: onnx.NodeProto, attrs: Mapping[str, Any], b: int | None, r: int | None,
                     consts: Mapping[str, Any]) -> list[tuple[int, int]] | str | None:
    """Pad, LpNormalization, Resize and Upsample keep the samples apart when they leave the batch axis alone:
    no padding there, a norm along another axis, a scale of 1 on it (constants read here)."""
    if b is None or r is None:
        return None
    op = node.op_type
    if op == "LpNormalization":
        a = _norm(int(attrs.get("axis", -1)), r)
        return [(b, r)] if a is not None and a != b else "normalises along the batch axis"
    if op == "Pad":
        pads = attrs.get("pads")
        if pads is None and len(node.input) > 1 and node.input[1]:
            value = consts.get(node.input[1])
            pads = None if value is None else value.reshape(-1).tolist()
        axes = consts.get(node.input[3]).reshape(-1).tolist() if len(node.input) > 3 and node.input[3] \
            and node.input[3] in consts else None
        if pads is None or (len(node.input) > 3 and node.input[3] and axes is None):
            return None
        axes = [_norm(int(a), r) for a in axes] if axes is not None else list(range(r))
        n = len(axes)
        padded = {a for k, a in enumerate(axes) if int(pads[k]) or int(pads[k + n])}
        return "pads along the batch axis" if b in padded else [(b, r)]
    if attrs.get("coordinate_transformation_mode") == "tf_crop_and_resize":
        return None  # its roi may crop along the batch axis
    scales = attrs.get("scales")  # Upsample-7's attribute, else the scales input (Resize 2, Upsample 1)
    index = 2 if op == "Resize" and len(node.input) > 2 else 1  # (Resize-10: X, scales; later X, roi, scales)
    if scales is None and len(node.input) > index and node.input[index]:
        value = consts.get(node.input[index])
        scales = None if value is None or value.size == 0 else value.reshape(-1).tolist()
    if op == "Resize" and len(node.input) > 3 and node.input[3]:
        return None  # sizes: not read here
    axes = attrs.get("axes")
    if axes is not None and b not in {_norm(int(a), r) for a in axes}:
        return [(b, r)]
    if scales is None or axes is not None or len(scales) != r:
        return None
    return [(b, r)] if float(scales[b]) == 1.0 else "resizes the batch axis"


_RECURRENT = frozenset({"LSTM", "GRU", "RNN"})
# ops of which inputs other than the first may carry the batch (each checked where its axis is placed)
_SEVERAL_CARRY = frozenset({*_ELEMENTWISE, "MatMul", "Gemm", "Concat", "Gather", *_RECURRENT})


def _recurrent_axes(node: onnx.NodeProto, attrs: Mapping[str, Any], axis: Mapping[str, int],
                    rank: Mapping[str, int]) -> list[tuple[int, int]] | None:
    """An LSTM, GRU or RNN runs each sample apart when its inputs carry the batch where the layout puts it
    (X's axis 1, the states' 1 and sequence_lens' 0 for layout 0; 0 for all with layout 1, the weights
    never): Y then has it at 2 (layout 0) or 0, Y_h and Y_c at 1 or 0."""
    layout = int(attrs.get("layout", 0) or 0)
    wanted = {0: 1 - layout, 5: 1 - layout, 6: 1 - layout, 4: 0}  # X, initial_h, initial_c, sequence_lens
    for k, name in enumerate(node.input):
        if name in axis and wanted.get(k) != axis[name]:
            return None
    if node.input[0] not in axis:
        return None
    return [(2 if layout == 0 else 0, 4), *[(1 if layout == 0 else 0, 3)] * (len(node.output) - 1)]


def _slice_axis(node: onnx.NodeProto, attrs: Mapping[str, Any], b: int | None, r: int | None,
                consts: Mapping[str, Any]) -> list[tuple[int, int]] | str | None:
    if b is None or r is None:
        return None
    if "starts" in attrs:  # opset < 10
        axes = attrs.get("axes")
        axes = list(range(len(attrs["starts"]))) if axes is None else [int(a) for a in axes]
    elif len(node.input) > 3 and node.input[3]:
        value = consts.get(node.input[3])
        if value is None:
            return None
        axes = [int(a) for a in value.reshape(-1)]
    else:
        value = consts.get(node.input[1]) if len(node.input) > 1 else None
        if value is None:
            return None
        axes = list(range(value.size))
    if b in {_norm(a, r) for a in axes}:
        return f"slices along the batch axis {b}"
    return [(b, r)]


def _reshape_axis(node: onnx.NodeProto, attrs: Mapping[str, Any], axis: Mapping[str, int],
                  dims: Mapping[str, list[Any]], shapes: Mapping[str, tuple[list[Entry], bool]],
                  consts: Mapping[str, Any], factor: Mapping[str, tuple[int, int | None]]
                  ) -> list[tuple] | str | None:
    """A Reshape keeps the samples apart when its target holds the batch size (times a factor: heads merged
    into it, or the rows of a sequence-first layout [L, B, E] → [L·B, E]) where the values before the batch
    in the input's layout end on a multiple of the output's leading sizes: the batch stays one axis, of
    size outer · batch · inner (a -1 there, with known sizes after it, takes the same place). Sizes may be
    symbols (a sequence length read with Shape): those before the batch must cancel out."""
    x, target = node.input[0], node.input[1] if len(node.input) > 1 else ""
    b = axis.get(x)
    if b is None:
        return None  # only the target carries the batch size
    entries = _entries(target, shapes, consts)
    if entries is None:
        return None
    before = [_entry(d) for d in dims.get(x, [])]
    outer, inner = factor.get(x, (1, 1))
    if not attrs.get("allowzero"):  # a 0 copies the input's dim there
        own = (_BATCH, None) if inner is None else (_BATCH, outer * inner)
        entries = [(own if i == b else (before[i] if i < len(before) else None)) if e == 0 else e
                   for i, e in enumerate(entries)]
    places = [j for j, e in enumerate(entries) if _is_batch(e)]
    if not places and entries.count(-1) == 1:  # a -1 that takes the batch with the dims after it, when the
        j = entries.index(-1)  # sizes after it are known (a batch-major merge: [B, T, V] → [-1, V])
        if all(_known(e) for e in entries[j + 1:]):
            places = [j]
    if len(places) != 1:
        return "merges the batch axis with others" if not places else None
    j = places[0]
    lead_in, lead_out = before[:b], entries[:j]
    if len(lead_in) < b or not all(_known(d) for d in (*lead_in, *lead_out)):
        return None
    (n_in, sym_in), (n_out, sym_out) = _size_product(lead_in), _size_product(lead_out)
    start = n_in * outer  # values before the batch, in the input's layout
    if sym_in != sym_out:
        return None  # sizes known only at run time on one side: not compared
    if start % n_out:
        return "moves samples across the batch axis"
    new_outer = start // n_out
    size = entries[j]
    if size == -1:
        return _minus_one_rows(before[b + 1:], entries[j + 1:], inner, j, len(entries), new_outer)
    if size[1] is None:
        return None
    if size[1] % new_outer:
        return "moves samples across the batch axis"
    return [(j, len(entries), (new_outer, size[1] // new_outer))]


def _minus_one_rows(after_in: Sequence[Entry], after_out: Sequence[Entry], inner: int | None, j: int,
                    rank: int, new_outer: int) -> list[tuple] | str | None:
    """The batch axis of a Reshape whose -1 takes the batch (axis ``j`` of ``rank``): nothing fixes its rows'
    length to the samples', so a row (the values after the axis, ``after_out``) must lie within the values
    of one sample at one outer position (``inner`` times the input's ``after_in``); a row that takes more
    ([L·B, E] → [-1, L·E] after a sequence-first layout, [B, 4] → [-1, 8]) holds several samples."""
    if not all(_known(e) for e in (*after_in, *after_out)):
        return None
    (n_in, sym_in), (n_out, sym_out) = _size_product(after_in), _size_product(after_out)
    left = list(sym_in)
    for sym in sym_out:  # the row's symbols must be the sample's (they cancel)
        if sym not in left:
            return None
        left.remove(sym)
    chunk = n_in * (inner if inner is not None else 1)
    if chunk % n_out:
        return "moves samples across the batch axis" if inner is not None and not sym_in else None
    rows = None if inner is None or left else chunk // n_out
    return [(j, rank, (new_outer, rows))]


def _is_batch(e: Entry) -> bool:
    return isinstance(e, tuple) and e[0] == _BATCH


def _known(e: Entry) -> bool:
    """A size known before the run: a positive int or a symbol."""
    return (isinstance(e, int) and e > 0) or (isinstance(e, tuple) and e[0] == "D")


def _size_product(entries: Sequence[Entry]) -> tuple[int, list[str]]:
    """The product of known sizes: (the ints' product, the symbols, sorted)."""
    ints = [e for e in entries if isinstance(e, int)]
    return int(np.prod(ints, dtype=np.int64)), sorted(e[1] for e in entries if isinstance(e, tuple))


def _expand_axis(node: onnx.NodeProto, axis: Mapping[str, int], rank: Mapping[str, int],
                 shapes: Mapping[str, tuple[list[Entry], bool]], consts: Mapping[str, Any],
                 factor: Mapping[str, tuple[int, int | None]]) -> list[tuple] | None:
    """The batch axis of an Expand of a value that carries it (its size kept, or 1 there), or of a constant
    to sizes that hold the batch size."""
    x = node.input[0]
    entries = _entries(node.input[1], shapes, consts) if len(node.input) > 1 else None
    if entries is None or x not in rank:
        return None
    out_rank = max(rank[x], len(entries))
    if x in axis:
        pos = axis[x] + out_rank - rank[x]
        e = entries[pos - (out_rank - len(entries))] if pos >= out_rank - len(entries) else 1
        outer, inner = factor.get(x, (1, 1))
        same = inner is not None and e == (_BATCH, outer * inner)
        others = [f for k, f in enumerate(entries) if k != pos - (out_rank - len(entries))]
        return [(pos, out_rank)] if (e in (1, -1) or same) and not any(_is_batch(f) for f in others) else None
    places = [j for j, e in enumerate(entries) if _is_batch(e)]
    if len(places) == 1 and entries[places[0]][1] is not None:
        return [(places[0] + out_rank - len(entries), out_rank, (1, entries[places[0]][1]))]
    return None


def _entries(name: str, shapes: Mapping[str, tuple[list[Entry], bool]],
             consts: Mapping[str, Any]) -> list[Entry] | None:
    """The entries of a 1-D size value: followed (``shapes``) or constant; None when not known."""
    if name in shapes:
        return list(shapes[name][0])
    value = consts.get(name)
    if value is None or value.dtype.kind not in "iub":
        return None
    return [bool(v) if value.dtype.kind == "b" else int(v) for v in value.reshape(-1)]


def _shape_entries(node: onnx.NodeProto, attrs: Mapping[str, Any], axis: Mapping[str, int],
                   rank: Mapping[str, int], dims: Mapping[str, list[int | None]],
                   shapes: Mapping[str, tuple[list[Entry], bool]], consts: Mapping[str, Any],
                   factor: Mapping[str, tuple[int, int | None]]) -> tuple | None:
    """The entries (and whether a scalar) of the size value ``node`` makes from the batch size, or the
    (batch axis, rank) of a tensor it makes of such sizes (ConstantOfShape, Expand of a constant); None when
    not followed."""
    op = node.op_type
    ins = list(node.input)
    if op == "Shape":
        x = ins[0]
        if x in shapes:  # the length of a size vector: known
            return ([] if shapes[x][1] else [len(shapes[x][0])]), False
        b, r = axis.get(x), rank.get(x)
        if b is None or r is None:
            return None
        known = [_entry(d) for d in dims.get(x, [None] * r)]
        outer, inner = factor.get(x, (1, 1))
        own = (_BATCH, None) if inner is None else (_BATCH, outer * inner)
        entries: list[Entry] = [own if i == b else known[i] for i in range(r)]
        start, end = attrs.get("start", 0), attrs.get("end")
        return entries[slice(int(start), None if end is None else int(end))], False
    if op in ("Cast", "Identity"):
        return shapes.get(ins[0])
    if op == "Unsqueeze":
        got = shapes.get(ins[0])
        return (got[0], False) if got is not None and got[1] else None
    if op == "Squeeze":
        got = shapes.get(ins[0])
        return (got[0], True) if got is not None and len(got[0]) == 1 and not got[1] else None
    if op == "Reshape":  # a size vector to [n] or a one-entry one to a scalar ([-1] of torch's expand)
        got, target = shapes.get(ins[0]), consts.get(ins[1]) if len(ins) > 1 else None
        if got is None or target is None:
            return None
        flat = [int(t) for t in target.reshape(-1)]
        if flat in ([-1], [len(got[0])]) or (not flat and len(got[0]) == 1):
            return got[0], not flat
        return None
    if op == "Gather":
        got, idx = shapes.get(ins[0]), consts.get(ins[1]) if len(ins) > 1 else None
        if got is None or idx is None or int(attrs.get("axis", 0)) != 0:
            return None
        picked = [got[0][int(i)] for i in idx.reshape(-1)]
        return picked, idx.ndim == 0
    if op == "Slice":
        got = shapes.get(ins[0])
        if got is None:
            return None
        bounds = [consts.get(i) if i else None for i in ins[1:5]] + [None] * 4
        starts, ends, axes, steps = bounds[:4]
        if starts is None or ends is None or (axes is not None and list(axes.reshape(-1)) != [0]):
            return None
        step = 1 if steps is None else int(steps.reshape(-1)[0])
        if step == 0:
            return None
        n = len(got[0])
        lo, hi = (int(v.reshape(-1)[0]) for v in (starts, ends))
        lo, hi = (v + n if v < 0 else v for v in (lo, hi))
        if step > 0:  # ONNX's clamping (a Python slice clamps a negative step's bounds otherwise)
            lo, hi = min(max(lo, 0), n), min(max(hi, 0), n)
        else:
            lo, hi = min(max(lo, 0), n - 1), min(max(hi, -1), n - 1)
        return [got[0][i] for i in range(lo, hi, step)], False
    if op == "Concat":
        out: list[Entry] = []
        for i in ins:
            part = _entries(i, shapes, consts)
            if part is None:
                size = dims.get(i)
                if size is None or len(size) != 1 or size[0] is None:
                    return None
                part = [None] * size[0]
            out += part
        return out, False
    if op == "Equal" and len(ins) == 2:  # torch's expand(B, -1): which target sizes are -1
        a, c = (_entries(i, shapes, consts) for i in ins)
        if a is None or c is None or (len(a) != len(c) and 1 not in (len(a), len(c))):
            return None
        n = max(len(a), len(c))
        a, c = (v * n if len(v) == 1 else v for v in (a, c))
        return [_equal(x, y) for x, y in zip(a, c)], False
    if op == "Where" and len(ins) == 3:
        cond, a, c = (_entries(i, shapes, consts) for i in ins)
        if cond is None or a is None or c is None:
            return None
        n = max(len(cond), len(a), len(c))
        if any(len(v) not in (1, n) for v in (cond, a, c)):
            return None
        cond, a, c = (v * n if len(v) == 1 else v for v in (cond, a, c))
        picked = [x if k is True else y if k is False else (_BATCH, None) if _is_batch(k) or _is_batch(x)
                  or _is_batch(y) else None for k, x, y in zip(cond, a, c)]
        return picked, False
    if op in ("Mul", "Div") and len(ins) == 2:
        a, b = (_entries(i, shapes, consts) for i in ins)
        if a is None or b is None or (len(a) != len(b) and 1 not in (len(a), len(b))):
            return None
        n = max(len(a), len(b))
        a, b = (v * n if len(v) == 1 else v for v in (a, b))
        scalar = all(shapes[i][1] if i in shapes else consts[i].ndim == 0 for i in ins)
        return [_product(x, y, op == "Div") for x, y in zip(a, b)], scalar
    if op == "ConstantOfShape":
        got = shapes.get(ins[0])
        if got is None:
            return None
        places = [j for j, e in enumerate(got[0]) if _is_batch(e)]
        if len(places) != 1 or got[0][places[0]][1] is None:
            return None
        return places[0], len(got[0]), (1, got[0][places[0]][1])
    if op == "Expand" and ins[0] not in shapes:
        got = _expand_axis(node, axis, rank, shapes, consts, factor)
        return got[0] if got and len(got[0]) == 3 else None
    return None


def _product(e: Entry, c: Entry, divide: bool) -> Entry:
    """Entry ``e`` times (or divided exactly by) entry ``c``: a multiple of the batch size stays one; a
    value that depends on the batch otherwise is ``(B, None)``; None when not known."""
    if isinstance(c, tuple) and not divide and isinstance(e, int):
        e, c = c, e
    batch = isinstance(e, tuple) and e[0] == _BATCH or isinstance(c, tuple) and c[0] == _BATCH
    if not isinstance(e, (int, tuple)) or not isinstance(c, int) or c <= 0 or \
            (isinstance(e, tuple) and (e[0] != _BATCH or e[1] is None)):
        return (_BATCH, None) if batch else None
    if isinstance(e, tuple):
        f = e[1]
        if divide:
            return (_BATCH, f // c) if f % c == 0 else (_BATCH, None)
        return (_BATCH, f * c)
    return e // c if divide else e * c


def _equal(x: Entry, y: Entry) -> Entry:
    """Whether two size entries are equal, where known (the batch size is never 0 or negative)."""
    if isinstance(x, tuple) and isinstance(y, int) and not isinstance(y, bool):
        x, y = y, x
    if isinstance(x, int) and not isinstance(x, bool) and isinstance(y, int) and not isinstance(y, bool):
        return x == y
    if isinstance(x, int) and _is_batch(y) and x <= 0:
        return False
    return (_BATCH, None) if _is_batch(x) or _is_batch(y) else None  # depends on the batch size


def _entry(d: Any) -> Entry:
    """A dim as a size entry: an int, ``("D", symbol)`` for a symbolic one, or None."""
    return ("D", d) if isinstance(d, str) else d
