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
    """The hint's advice works: the builder takes the ``.model_proto`` (it took bytes or a path only, so
    following the hint failed); its gradient of y = Σ x·w is x."""
    import numpy as np
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    with pytest.raises(TypeError, match=HINT):
        onnxtrain.GradientGraphBuilder(ONNXProgram(), {"y"}, {"w"}, "y")
    builder = onnxtrain.GradientGraphBuilder(ONNXProgram().model_proto, {"y"}, {"w"}, "y")
    builder.build()
    built = onnxtrain.GradientGraphBuilder(builder.get_model(), {"y"}, {"w"}, "y")._model  # bytes still taken
    x = np.array([3.0, -1.5], np.float32)
    outs = dict(zip([o.name for o in built.graph.output], ReferenceEvaluator(built).run(None, {"x": x})))
    np.testing.assert_array_equal(outs["w_grad"], x)
    assert numpy_helper.to_array(built.graph.initializer[0]).tolist() == [1.0, 2.0]


def test_gradient_graph_builder_names_an_unknown_y_as_a_y():
    """A y that is no value of the graph is named as one of y_node_arg_names, not as "the loss" (when the
    builder is made, as onnxruntime's refused it)."""
    from onnxtrain.autodiff import GradientError

    with pytest.raises(GradientError, match=r"y_node_arg_names: \['nosuchy'\] are not values"):
        onnxtrain.GradientGraphBuilder(_model(), {"nosuchy"}, {"w"}, "y")


def test_inference_session():
    with pytest.raises(TypeError, match=HINT):
        onnxtrain.InferenceSession(ONNXProgram())
    with pytest.raises(TypeError, match="got int$"):
        onnxtrain.InferenceSession(3)
