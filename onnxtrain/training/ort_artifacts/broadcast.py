"""The nodes onnxruntime-training's gradients use to undo a broadcast when the shapes are known only at run
time: ``BroadcastGradientArgs`` (which axes each operand was broadcast along) and ``ReduceSumTraining``
(ReduceSum with its axes as an input, before opset 13)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxtrain.training.ort_artifacts.common import Context, Emit, const


def _broadcast_gradient_args(node: onnx.NodeProto, ctx: Context, emit: Emit) -> None:
    """For the shapes ``a`` and ``b`` of a broadcasting op's operands, the axes of its output each one was
    broadcast along, last axis first (onnxruntime's order): every leading axis the shorter shape lacks, and
    each axis where one operand has size 1 and the other does not."""
    a, b = node.input[0], node.input[1]
    one = const(emit, [1], np.int64)
    ra, rb = emit("Shape", a), emit("Shape", b)
    r = emit("Max", ra, rb)
    axes = emit("Range", const(emit, 0, np.int64), emit("Reshape", r, const(emit, [], np.int64)),
                const(emit, 1, np.int64))
    missing = {a: emit("Sub", r, ra), b: emit("Sub", r, rb)}  # how many leading axes each shape lacks
    fill = helper.make_tensor("", TensorProto.INT64, [1], [1])
    padded = {s: emit("Concat", emit("ConstantOfShape", missing[s], value=fill), s, axis=0) for s in (a, b)}
    ones = {s: emit("Equal", padded[s], one) for s in (a, b)}
    for s, other, out in ((a, b, node.output[0]), (b, a, node.output[1] if len(node.output) > 1 else "")):
        if not out:
            continue
        lacks = emit("Less", axes, missing[s])
        spread = emit("And", ones[s], emit("Not", ones[other]))
        chosen = emit("Compress", axes, emit("Or", lacks, spread), axis=0)
        emit("Slice", chosen, const(emit, [-1], np.int64), const(emit, [np.iinfo(np.int64).min], np.int64),
             const(emit, [0], np.int64), const(emit, [-1], np.int64), output=out)


def _reduce_sum_training(node: onnx.NodeProto, ctx: Context, emit: Emit) -> None:
    """ReduceSum of opset 13, whose axes are an input (the model is at opset 13 or later by now)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    emit("ReduceSum", *node.input, output=node.output[0], **attrs)


BY_HAND = {
    "BroadcastGradientArgs": _broadcast_gradient_args,
    "ReduceSumTraining": _reduce_sum_training,
}
