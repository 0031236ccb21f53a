"""Small float32 graphs for the engine's tests."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper


def model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    """An opset-17 model of ``nodes`` whose named inputs and outputs are float32 of any shape."""
    f = TensorProto.FLOAT
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, f, None) for n in inputs],
        [helper.make_tensor_value_info(n, f, None) for n in outputs],
        list(inits),
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
