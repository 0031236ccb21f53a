"""onnxruntime operators translated by hand: forward fusions (``FusedMatMul``, ``BiasGelu`` ...), gradient
kernels without a rule to borrow, the in-place accumulator and ``BatchNormInternal``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
from onnx import helper

from onnxtrain.training.ort_artifacts.broadcast import BY_HAND as BROADCAST_BY_HAND
from onnxtrain.training.ort_artifacts.common import (
    Context,
    Emit,
    TranslationError,
    const,
    float_dtype,
    float_elem_type,
    node_label,
    rank_of,
)
from onnxtrain.training.ort_artifacts.quant import BY_HAND as QUANT_BY_HAND


def _operand_perm(rank: int, trans_batch: bool, trans: bool) -> list[int]:
    """FusedMatMul's view of an operand: with ``transBatch`` its first axis moves behind the other batch
    axes (to the row position), then with ``trans`` the last two axes swap."""
    perm = list(range(rank))
    if trans_batch:
        perm = perm[1 : rank - 1] + [0, rank - 1]
    if trans:
        perm[-2], perm[-1] = perm[-1], perm[-2]
    return perm


def _fused_matmul(node: onnx.NodeProto, ctx: Context, emit: Emit) -> None:
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    ops = [
        (node.input[0], bool(a.get("transA", 0)), bool(a.get("transBatchA", 0))),
        (node.input[1], bool(a.get("transB", 0)), bool(a.get("transBatchB", 0))),
    ]
    ranks = [rank_of(ctx, name) for name, _, _ in ops]
    if any(b for _, _, b in ops):
        if None in ranks:
            unknown = node.input[ranks.index(None)]
            raise TranslationError(
                f"{node_label(node)}: transBatch needs the rank of {unknown!r}, which the types do not give"
            )
        if ranks[0] != ranks[1] or ranks[0] < 3:
            raise TranslationError(
                f"{node_label(node)}: transBatch needs inputs of one rank >= 3, not {ranks[0]}, {ranks[1]}"
            )
    alpha = float(a.get("alpha", 1.0))
    out = node.output[0]
    if all(not (t or b) or (r is not None and r >= 2) for (_, t, b), r in zip(ops, ranks)):
        args = []
        for (name, t, b), r in zip(ops, ranks):
            perm = _operand_perm(r, b, t) if (t or b) else None
            args.append(emit("Transpose", name, perm=perm) if perm and perm != sorted(perm) else name)
        y = emit("MatMul", *args, output=None if alpha != 1.0 else out)
    else:  # a rank the types do not tell: Einsum's ellipsis takes any
        sa = "...ji" if ops[0][1] else "...ij"
        sb = "...kj" if ops[1][1] else "...jk"
        y = emit(
            "Einsum",
            node.input[0],
            node.input[1],
            equation=f"{sa},{sb}->...ik",
            output=None if alpha != 1.0 else out,
        )
    if alpha != 1.0:
        emit("Mul", y, const(emit, alpha, float_dtype(ctx, node.input[0])), output=out)
    if None not in ranks:
        ctx.types[out] = helper.make_tensor_type_proto(
            float_elem_type(ctx, node.input[0]), [None] * max(ranks)
        )


def _erf_gelu(emit: Emit, s: str, dt: Any, output: str | None = None) -> str:
    """0.5·s·(1 + erf(s/√2))"""
    e = emit("Erf", emit("Mul", s, const(emit, 1 / math.sqrt(2), dt)))
    return emit(
        "Mul", emit("Mul", s, const(emit, 0.5, dt)), emit("Add", e, const(emit, 1.0, dt)), output=output
    )


def _bias_gelu(node: onnx.NodeProto, ctx: Context, emit: Emit) -> None:
    s = emit("Add", node.input[0], node.input[1]) if len(node.input) > 1 and node.input[1] else node.input[0]
    _erf_gelu(emit, s, float_dtype(ctx, node.input[0]), node.output[0])


def _gelu_grad(node: onnx.NodeProto, ctx: Context, emit: Emit) -> None:
    # dX = dY·(Φ(s) + s·φ(s)), s = X (+ B)
    dy, x = node.input[0], node.input[1]
    dt = float_dtype(ctx, x)
    s = emit("Add", x, node.input[2]) if len(node.input) > 2 and node.input[2] else x
    cdf = emit(
        "Mul",
        const(emit, 0.5, dt),
        emit("Add", emit("Erf", emit("Mul", s, const(emit, 1 / math.sqrt(2), dt))), const(emit, 1.0, dt)),
    )
    pdf = emit(
        "Mul",
        emit("Exp", emit("Mul", emit("Mul", s, s), const(emit, -0.5, dt))),
        const(emit, 1 / math.sqrt(2 * math.pi), dt),
    )
    emit("Mul", dy, emit("Add", cdf, emit("Mul", s, pdf)), output=node.output[0])


def _concat_training(node: onnx.NodeProto, ctx: Context, emit: Emit) -> None:
    axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
    emit("Concat", *node.input, axis=axis, output=node.output[0])
    if len(node.output) > 1 and node.output[1]:  # each input's length along the axis
        lengths = []
        for x in node.input:
            lengths.append(emit("Gather", emit("Shape", x), const(emit, [axis], np.int64), axis=0))
        emit("Concat", *lengths, axis=0, output=node.output[1])


def _fast_gelu(node: onnx.NodeProto, ctx: Context, emit: Emit) -> None:
    # y = 0.5·s·(1 + tanh(s·(a + b·s²))), s = x (+ bias), a = √(2/π), b = 0.044715·a
    x = node.input[0]
    dt = float_dtype(ctx, x)
    s = emit("Add", x, node.input[1]) if len(node.input) > 1 and node.input[1] else x
    t = emit("Tanh", _tanh_argument(emit, s, dt))
    half_s = emit("Mul", s, const(emit, 0.5, dt))
    emit("Mul", half_s, emit("Add", t, const(emit, 1.0, dt)), output=node.output[0])


def _fast_gelu_grad(node: onnx.NodeProto, ctx: Context, emit: Emit) -> None:
    # dx = dy·(0.5·(1 + t) + 0.5·s·(1 − t²)·(a + 3b·s²)), t = tanh(s·(a + b·s²))
    dy, x = node.input[0], node.input[1]
    dt = float_dtype(ctx, x)
    s = emit("Add", x, node.input[2]) if len(node.input) > 2 and node.input[2] else x
    t = emit("Tanh", _tanh_argument(emit, s, dt))
    one, half = const(emit, 1.0, dt), const(emit, 0.5, dt)
    a = math.sqrt(2 / math.pi)
    s3b = emit("Mul", emit("Mul", s, s), const(emit, 3 * 0.044715 * a, dt))
    slope = emit("Add", const(emit, a, dt), s3b)
    inner = emit("Mul", emit("Mul", s, emit("Sub", one, emit("Mul", t, t))), slope)
    emit("Mul", dy, emit("Mul", half, emit("Add", emit("Add", one, t), inner)), output=node.output[0])


def _tanh_argument(emit: Emit, s: str, dt: Any) -> str:
    """s·(a + b·s²) of the tanh GELU."""
    a = math.sqrt(2 / math.pi)
    poly = emit("Add", const(emit, a, dt), emit("Mul", emit("Mul", s, s), const(emit, 0.044715 * a, dt)))
    return emit("Mul", s, poly)


def _norm_axes(node: onnx.NodeProto, ctx: Context) -> list[int]:
    """The normalised axes of a (Simplified)LayerNormalization: from ``axis`` to the last."""
    axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), -1)
    if axis < 0:
        return list(range(axis, 0))
    rank = rank_of(ctx, node.input[0])
    if rank is None:
        raise TranslationError(f"{node_label(node)}: axis {axis} with an input of unknown rank")
    return list(range(axis, rank))


def _reduce(emit: Emit, ctx: Context, op: str, x: str, axes: list[int], keepdims: int) -> str:
    if ctx.opset >= 18 or (op == "ReduceSum" and ctx.opset >= 13):
        return emit(op, x, const(emit, axes, np.int64), keepdims=keepdims)
    return emit(op, x, axes=axes, keepdims=keepdims)


def _softmax_grad_before_13(node: onnx.NodeProto, ctx: Context, emit: Emit) -> None:
    """``SoftmaxGrad`` / ``LogSoftmaxGrad`` (dY, Y) of a model before opset 13, whose (Log)Softmax normalises
    the input flattened to 2-D at its axis: the gradient over the rows of that view, reshaped back."""
    axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 1)
    dy = emit("Flatten", node.input[0], axis=axis)
    y = emit("Flatten", node.input[1], axis=axis)
    if node.op_type == "SoftmaxGrad":  # dX = Y·(dY − Σ dY·Y)
        s = _reduce(emit, ctx, "ReduceSum", emit("Mul", dy, y), [1], 1)
        dx = emit("Mul", y, emit("Sub", dy, s))
    else:  # dX = dY − exp(Y)·Σ dY
        dx = emit("Sub", dy, emit("Mul", emit("Exp", y), _reduce(emit, ctx, "ReduceSum", dy, [1], 1)))
    emit("Reshape", dx, emit("Shape", node.input[0]), output=node.output[0])


def _simplified_layer_norm(node: onnx.NodeProto, ctx: Context, emit: Emit) -> None:
    # y = x·r·scale, r = 1/√(mean(x²) + ε) over the normalised axes (saved as the second output)
    x, scale = node.input[0], node.input[1]
    dt = float_dtype(ctx, x)
    eps = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "epsilon"), 1e-5)
    mean_sq = _reduce(emit, ctx, "ReduceMean", emit("Mul", x, x), _norm_axes(node, ctx), 1)
    saved = node.output[1] if len(node.output) > 1 and node.output[1] else None
    r = emit("Reciprocal", emit("Sqrt", emit("Add", mean_sq, const(emit, eps, dt))), output=saved)
    emit("Mul", emit("Mul", x, r), scale, output=node.output[0])


def _simplified_layer_norm_grad(node: onnx.NodeProto, ctx: Context, emit: Emit) -> None:
    # x̂ = x·r, g = dy·scale: dx = r·(g − x̂·mean(g·x̂)), dscale = dy·x̂ summed over the other axes
    dy, x, scale, r = node.input[:4]
    xhat = emit("Mul", x, r)
    g = emit("Mul", dy, scale)
    mean_gx = _reduce(emit, ctx, "ReduceMean", emit("Mul", g, xhat), _norm_axes(node, ctx), 1)
    emit("Mul", r, emit("Sub", g, emit("Mul", xhat, mean_gx)), output=node.output[0])
    if len(node.output) > 1 and node.output[1]:
        rows = emit("Concat", const(emit, [-1], np.int64), emit("Shape", scale), axis=0)
        flat = emit("Reshape", emit("Mul", dy, xhat), rows)
        emit.nodes.append(
            helper.make_node(
                "ReduceSum",
                [flat, const(emit, [0], np.int64)],
                [node.output[1]],
                ctx.fresh(f"{emit.base}/ReduceSum"),
                keepdims=0,
            )
        )


def _split_training(node: onnx.NodeProto, ctx: Context, emit: Emit) -> None:
    axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
    x, split = node.input[0], node.input[1] if len(node.input) > 1 else ""
    outputs = list(node.output)
    name = ctx.fresh(node.name or "Split")
    if ctx.opset >= 13:
        extra = {} if split or ctx.opset < 18 else {"num_outputs": len(outputs)}
        ins = [x, split] if split else [x]
        emit.nodes.append(helper.make_node("Split", ins, outputs, name, axis=axis, **extra))
    elif not split or split in ctx.constants:
        extra = {"split": [int(v) for v in ctx.constants[split]]} if split else {}
        emit.nodes.append(helper.make_node("Split", [x], outputs, name, axis=axis, **extra))
    else:
        raise TranslationError(f"{node_label(node)}: split sizes known only at run time need opset 13")


def _quick_gelu(node: onnx.NodeProto, ctx: Context, emit: Emit) -> None:
    # y = x·σ(αx)
    x = node.input[0]
    emit("Mul", x, emit("Sigmoid", _alpha_times(node, ctx, emit, x)), output=node.output[0])


def _quick_gelu_grad(node: onnx.NodeProto, ctx: Context, emit: Emit) -> None:
    # dx = dy·σ(αx)·(1 + αx·(1 − σ(αx)))
    dy, x = node.input[0], node.input[1]
    dt = float_dtype(ctx, x)
    ax = _alpha_times(node, ctx, emit, x)
    s = emit("Sigmoid", ax)
    one = const(emit, 1.0, dt)
    inner = emit("Add", one, emit("Mul", ax, emit("Sub", one, s)))
    emit("Mul", emit("Mul", dy, s), inner, output=node.output[0])


def _alpha_times(node: onnx.NodeProto, ctx: Context, emit: Emit, x: str) -> str:
    alpha = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "alpha"), 1.702)
    return x if alpha == 1.0 else emit("Mul", x, const(emit, alpha, float_dtype(ctx, x)))


def _leaky_relu_grad(node: onnx.NodeProto, ctx: Context, emit: Emit) -> None:
    # dx = dy where y > 0, α·dy elsewhere (onnxruntime's definition, from the output)
    dy, y = node.input[0], node.input[1]
    dt = float_dtype(ctx, y)
    alpha = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "alpha"), 0.01)
    positive = emit("Greater", y, const(emit, 0.0, dt))
    emit("Where", positive, dy, emit("Mul", dy, const(emit, alpha, dt)), output=node.output[0])


def _recurrent_training(node: onnx.NodeProto, ctx: Context, emit: Emit) -> None:
    # LSTMTraining / GRUTraining: the standard node; the gates they also save are left to the gradient
    op = node.op_type[: -len("Training")]
    n_in, n_out = (7, 3) if op == "LSTM" else (6, 2)
    inputs = list(node.input[:n_in])
    outputs = [o or ctx.fresh(f"{node.name or op}/Y{k}") for k, o in enumerate(node.output[:n_out])]
    outputs += [ctx.fresh(f"{node.name or op}/Y{k}") for k in range(len(outputs), n_out)]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    emit.nodes.append(helper.make_node(op, inputs, outputs, ctx.fresh(node.name or op), **attrs))
    ctx.recurrent[outputs[0]] = (inputs, outputs)


def _trilu(node: onnx.NodeProto, ctx: Context, emit: Emit) -> None:
    """Its Trilu (the gradient of a Trilu): ONNX's Trilu-14, the same inputs and ``upper``."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    emit("Trilu", *node.input, output=node.output[0], **attrs)


def _scale(node: onnx.NodeProto, ctx: Context, emit: Emit) -> None:
    down = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "scale_down"), 0)
    x = node.input[0]
    s = emit("Cast", node.input[1], to=float_elem_type(ctx, x))
    emit("Div" if down else "Mul", x, s, output=node.output[0])


def _accumulator(node: onnx.NodeProto, ctx: Context, emit: Emit) -> None:
    # buffer = overwrite ? value : buffer + value; the model outputs the new buffer (onnxtrain's interface)
    buffer, value = node.input[0], node.input[1]
    out = node.output[0]
    if len(node.input) > 2 and node.input[2]:
        emit("Where", node.input[2], value, emit("Add", buffer, value), output=out)
    else:
        emit("Add", buffer, value, output=out)
    if buffer in ctx.types:
        ctx.types[out] = ctx.types[buffer]


def batch_norm_internal(node: onnx.NodeProto, ctx: Context, emit: Emit) -> list[str]:
    attrs = {
        a.name: helper.get_attribute_value(a) for a in node.attribute if a.name in ("epsilon", "momentum")
    }
    outs = [o for o in node.output[:3]]
    ctx_out = [o or ctx.fresh("bn") for o in outs]
    # standard BatchNormalization in training mode: Y and the running statistics
    return [
        helper.make_node(
            "BatchNormalization",
            list(node.input[:5]),
            ctx_out,
            training_mode=1,
            name=ctx.fresh(node.name or "BatchNormalization"),
            **attrs,
        )
    ]


# the standard opset a translation needs, where above the model's own (its standard nodes move there first)
MIN_OPSET = {"ReduceSumTraining": 13, "Trilu": 14}

BY_HAND: dict[str, Callable[[onnx.NodeProto, Context, Emit], None]] = {
    "FusedMatMul": _fused_matmul,
    "BiasGelu": _bias_gelu,
    "Gelu": _bias_gelu,
    "BiasGeluGrad_dX": _gelu_grad,
    "GeluGrad": _gelu_grad,
    "ConcatTraining": _concat_training,
    "Scale": _scale,
    "InPlaceAccumulatorV2": _accumulator,
    "SplitTraining": _split_training,
    "QuickGelu": _quick_gelu,
    "QuickGeluGrad": _quick_gelu_grad,
    "LeakyReluGrad": _leaky_relu_grad,
    "FastGelu": _fast_gelu,
    "FastGeluGrad": _fast_gelu_grad,
    "BiasFastGeluGrad_dX": _fast_gelu_grad,  # (dY, X, bias): the gradient at X + bias
    "SoftmaxGrad": _softmax_grad_before_13,
    "LogSoftmaxGrad": _softmax_grad_before_13,
    "SimplifiedLayerNormalization": _simplified_layer_norm,
    "SimplifiedLayerNormalizationGrad": _simplified_layer_norm_grad,
    "LSTMTraining": _recurrent_training,
    "GRUTraining": _recurrent_training,
    "Trilu": _trilu,
    **BROADCAST_BY_HAND,
    **QUANT_BY_HAND,
}
