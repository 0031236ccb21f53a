"""Gradient accumulation nodes (spec §4.3): buffer + gradient, and the averaged sum for the update."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from onnxtrain.ir.builder import NodeWriter, half_widened

GROUP_OUTPUT = "Group_Accumulated_Gradients"


def buffer_name(grad: str) -> str:
    return f"{grad}_accumulate_buffer"


def buffer_type(grad_type: int) -> int:
    """The element type of the buffer summing gradients of ``grad_type``: float32 for float16 and bfloat16
    gradients, as onnxruntime-training's buffers (spec §8.3); the gradient's own type otherwise."""
    return half_widened(grad_type)


def accumulate(w: NodeWriter, grad: str, grad_type: int = TensorProto.FLOAT) -> str:
    """``<grad>_accumulator_output`` = buffer + grad, in :func:`buffer_type` (a half gradient is widened)."""
    wide = buffer_type(grad_type)
    term = grad if wide == grad_type else w.one("Cast", grad, to=wide)
    return w.emit("Add", [buffer_name(grad), term], [w.names(f"{grad}_accumulator_output")])[0]


def averaged(w: NodeWriter, acc: str, steps: int, grad_type: int = TensorProto.FLOAT) -> str:
    """The accumulated gradient divided by the number of micro-steps, in the gradient's type ``grad_type``
    (a float32 sum of half gradients is cast back after the division)."""
    wide = buffer_type(grad_type)
    mean = w.emit("Mul", [acc, w.const(np.asarray(1.0 / steps), wide)], [w.names(f"{acc}_scaled")])[0]
    return mean if wide == grad_type else w.one("Cast", mean, to=grad_type)


def group_barrier(w: NodeWriter, accs: list[str], elem_type: int = 1) -> str:
    """``Group_Accumulated_Gradients``: true, of shape [1], as onnxruntime's ``Group`` made it; its value
    means nothing, fetching it marks a micro-step. ``elem_type``: the type of ``accs[0]``, a
    :func:`buffer_type` (never a half type, which IsInf takes from opset 20 only)."""
    first = w.one("ReduceMax", w.one("Reshape", accs[0], w.ints([-1])), keepdims=1) if accs else None
    if first is None:
        return w.emit("Constant", [], [GROUP_OUTPUT], value=_true())[0]
    zero_or_nan = w.one("Mul", first, w.const(0.0, elem_type))  # reads the sums; never infinite
    return w.emit("Not", [w.one("IsInf", zero_or_nan)], [GROUP_OUTPUT])[0]


def _true():
    from onnx import numpy_helper

    return numpy_helper.from_array(np.asarray([True]), "true")
