"""Gradient accumulation nodes (spec §4.3): buffer + gradient, and the averaged sum for the update."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from onnxtrain.ir.builder import NodeWriter

GROUP_OUTPUT = "Group_Accumulated_Gradients"


def buffer_name(grad: str) -> str:
    return f"{grad}_accumulate_buffer"


def accumulate(w: NodeWriter, grad: str) -> str:
    """``<grad>_accumulator_output`` = buffer + grad."""
    return w.emit("Add", [buffer_name(grad), grad], [w.names(f"{grad}_accumulator_output")])[0]


def averaged(w: NodeWriter, acc: str, steps: int, elem_type: int = 1) -> str:
    """The accumulated gradient divided by the number of micro-steps."""
    return w.emit("Mul", [acc, w.const(np.asarray(1.0 / steps), elem_type)], [w.names(f"{acc}_scaled")])[0]


def group_barrier(w: NodeWriter, accs: list[str], elem_type: int = 1) -> str:
    """``Group_Accumulated_Gradients``: true, of shape [1], as onnxruntime's ``Group`` made it; its value
    means nothing, fetching it marks a micro-step. ``elem_type``: the type of ``accs[0]``."""
    first = w.one("ReduceMax", w.one("Reshape", accs[0], w.ints([-1])), keepdims=1) if accs else None
    if first is None:
        return w.emit("Constant", [], [GROUP_OUTPUT], value=_true())[0]
    if elem_type not in (TensorProto.FLOAT, TensorProto.DOUBLE):  # IsInf takes halves from opset 20 only
        first, elem_type = w.one("Cast", first, to=TensorProto.FLOAT), TensorProto.FLOAT
    zero_or_nan = w.one("Mul", first, w.const(0.0, elem_type))  # reads the sums; never infinite
    return w.emit("Not", [w.one("IsInf", zero_or_nan)], [GROUP_OUTPUT])[0]


def _true():
    from onnx import numpy_helper

    return numpy_helper.from_array(np.asarray([True]), "true")
