"""onnxruntime-training's fake quantisation: the ``FakeQuant`` its generator fuses from a QuantizeLinear →
DequantizeLinear pair (quantisation-aware training), and its gradient ``FakeQuantGrad``."""

from __future__ import annotations

import onnx
from onnx import helper

from onnxtrain.training.ort_artifacts.common import Context, Emit, const, float_dtype


def _fake_quant(node: onnx.NodeProto, ctx: Context, emit: Emit) -> None:
    """(x, scale, zero point) → x quantised to [quant_min, quant_max] (default [0, 255]) and back, rounding
    half to even; and the mask of the values that the clamp left alone."""
    x, scale, zero = node.input[:3]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    dt = float_dtype(ctx, x)
    low = const(emit, attrs.get("quant_min", 0), dt)
    high = const(emit, attrs.get("quant_max", 255), dt)
    q = emit("Add", emit("Round", emit("Div", x, scale)), zero)
    clamped = emit("Min", emit("Max", q, low), high)
    emit("Mul", emit("Sub", clamped, zero), scale, output=node.output[0])
    if len(node.output) > 1 and node.output[1]:
        emit("And", emit("GreaterOrEqual", q, low), emit("LessOrEqual", q, high), output=node.output[1])


def _fake_quant_grad(node: onnx.NodeProto, ctx: Context, emit: Emit) -> None:
    """(dY, mask) → dY where the mask is set, else 0 (the straight-through estimator)."""
    dy, mask = node.input[:2]
    emit("Where", mask, dy, const(emit, 0, float_dtype(ctx, dy)), output=node.output[0])


BY_HAND = {"FakeQuant": _fake_quant, "FakeQuantGrad": _fake_quant_grad}
