"""torch's ONNXProgram (what torch.onnx.export returns with dynamo) passed where a model is expected: every
entry point raises a TypeError that says to pass its ``.model_proto`` (TrainingSession and
generate_artifacts did; build_gradient_model, GradientGraphBuilder and InferenceSession raised a bare
TypeError or AttributeError from inside onnx)."""

from __future__ import annotations

import pytest
from onnx import TensorProto, helper

import onnxtrain
from onnxtrain.autodiff import build_gradient_model


def _model():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [])
    w = helper.make_tensor("w", TensorProto.FLOAT, [2], [1.0, 2.0])
    nodes = [helper.make_node("Mul", ["x", "w"], ["p"]), helper.make_node("ReduceSum", ["p"], ["y"],
                                                                          keepdims=0)]
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y], [w]),
                             opset_imports=[helper.make_opsetid("", 17)])


class ONNXProgram:  # the attribute the hint looks for, as torch's class has it
    def __init__(self) -> None:
        self.model_proto = _model()


HINT = r"got ONNXProgram \(torch's ONNXProgram: pass its \.model_proto\)"


def test_build_gradient_model():
    with pytest.raises(TypeError, match=HINT):
        build_gradient_model(ONNXProgram(), "y", ["w"])
    grads = build_gradient_model(ONNXProgram().model_proto, "y", ["w"])
    assert "w_grad" in {o.name for o in grads.graph.output}


def test_gradient_graph_builder():
    with pytest.raises(TypeError, match=HINT):
        onnxtrain.GradientGraphBuilder(ONNXProgram(), {"y"}, {"w"}, "y")


def test_inference_session():
    with pytest.raises(TypeError, match=HINT):
        onnxtrain.InferenceSession(ONNXProgram())
    with pytest.raises(TypeError, match="got int$"):
        onnxtrain.InferenceSession(3)
