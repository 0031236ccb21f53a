"""A block call inside ``onnxblock.base``/``empty_base`` must leave a model onnx.checker accepts (full check),
as onnxruntime-training's Block.__call__ required: a custom block that writes a bad node fails at its call,
named, instead of at generate_artifacts' end."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.training import onnxblock
from onnxtrain.training.onnxblock import BlockError


def _model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    i = helper.make_tensor_value_info("i", TensorProto.INT64, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x, i], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


class FloatOnInts(onnxblock.Block):
    """Writes Sigmoid on an int64 input: a type the op does not take (shape inference refuses it)."""

    def build(self, name: str) -> str:
        self.base.graph.node.append(helper.make_node("Sigmoid", [name], ["bad"]))
        return "bad"


class Outer(onnxblock.Block):
    """Leaves the model incomplete between its inner calls: only the outermost call is checked."""

    def __init__(self) -> None:
        super().__init__()
        self.add = onnxblock.blocks.Add()

    def build(self, name: str) -> str:
        self.base.graph.node.append(helper.make_node("Neg", ["later"], ["neg"]))  # reads a value made below
        out = self.add("neg", name)  # the model is invalid here (Neg reads "later" before it exists)
        self.base.graph.node.insert(0, helper.make_node("Identity", ["x"], ["later"]))
        return out


def test_the_checker_refusal_is_raised_at_the_call_naming_the_block():
    # the oracle: onnx.checker refuses the model the block leaves
    bad = _model()
    bad.graph.node.append(helper.make_node("Sigmoid", ["i"], ["bad"]))
    with pytest.raises((onnx.checker.ValidationError, onnx.shape_inference.InferenceError)):
        onnx.checker.check_model(bad, full_check=True)
    with onnxblock.base(_model()), pytest.raises(BlockError, match="after block FloatOnInts"):
        FloatOnInts()("i")


def test_a_valid_call_passes_and_nested_calls_are_checked_once_at_the_end():
    with onnxblock.base(_model()) as acc:
        out = Outer()("y")
        onnx.checker.check_model(acc.model, full_check=True)
    assert out in {o for n in acc.model.graph.node for o in n.output}


def test_empty_base_calls_are_checked_too():
    with onnxblock.empty_base(), pytest.raises(BlockError, match="after block FloatOnInts"):
        FloatOnInts()("nothing")
