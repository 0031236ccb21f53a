"""onnxruntime-training's spellings that scripts use: the blocks' keyword argument names
(``Linear()(linear_input_name=...)``, ``Pow``, ``Clip``, ``Cast``, ``LabelEncoder``), an OrtValue's
``_ortvalue`` (passed on to ``copy_buffer_to_parameters``), and a LookupError for an unknown loss input."""

from __future__ import annotations

import inspect

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain import OrtValue
from onnxtrain.training import artifacts, onnxblock
from onnxtrain.training.onnxblock import blocks


@pytest.mark.parametrize("cls, keyword", [
    (blocks.Linear, "linear_input_name"), (blocks.Pow, "pow_input_name"), (blocks.Clip, "clip_input_name"),
    (blocks.Cast, "cast_input_name"), (blocks.LabelEncoder, "label_encoder_input_name"),
])
def test_build_keywords_are_onnxruntime_trainings(cls: type, keyword: str) -> None:
    assert list(inspect.signature(cls.build).parameters)[1] == keyword


def test_linear_and_pow_by_keyword_compute_the_block() -> None:
    class Block(onnxblock.ForwardBlock):
        def __init__(self) -> None:
            super().__init__()
            self.linear = blocks.Linear(4, 2)
            self.pow = blocks.Pow(2.0)

        def build(self, x: str) -> str:
            return self.pow(pow_input_name=self.linear(linear_input_name=x))

    base = helper.make_model(helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])]),
        opset_imports=[helper.make_opsetid("", 17)])
    block = Block()
    with onnxblock.base(base):
        block("y")
    model = block.to_model_proto()
    onnx.checker.check_model(model, full_check=True)
    assert [n.op_type for n in model.graph.node][-2:] == ["Gemm", "Pow"]


def test_ortvalue_wrapper_attribute() -> None:
    v = OrtValue.ortvalue_from_numpy(np.ones(3, np.float32))
    assert v._ortvalue is v


def test_unknown_loss_input_is_a_lookup_error(tmp_path) -> None:
    model = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["out"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 2])],
        [onnx.numpy_helper.from_array(np.ones((3, 2), np.float32), "W")]),
        opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(LookupError, match="loss input 'nope' is not a value of the model"):
        artifacts.generate_artifacts(model, requires_grad=["W"], loss=artifacts.LossType.MSELoss,
                                     loss_input_names=["nope"], artifact_directory=str(tmp_path))


def test_loss_inputs_the_loss_block_adds_itself(tmp_path) -> None:
    """``loss_input_names`` may name inputs the custom loss block adds to the graph (a distillation loss's
    teacher logits), as onnxruntime-training allows: the artifacts train on them (the loss checked against
    numpy); a name neither the model nor the block has is still refused by name."""
    w = np.random.default_rng(0).standard_normal((3, 2)).astype(np.float32)
    model = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["out"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 2])],
        [onnx.numpy_helper.from_array(w, "W")]),
        opset_imports=[helper.make_opsetid("", 17)])

    class Distance(onnxblock.Block):
        """Mean squared distance to a ``teacher`` input the block declares when the graph lacks it."""

        def build(self, out: str, teacher: str) -> str:
            g = self.base.graph
            if teacher not in {v.name for v in g.input}:
                g.input.append(helper.make_tensor_value_info(teacher, TensorProto.FLOAT, [2, 2]))
            g.node.extend([helper.make_node("Sub", [out, teacher], ["kd_diff"]),
                           helper.make_node("Mul", ["kd_diff", "kd_diff"], ["kd_sq"]),
                           helper.make_node("ReduceMean", ["kd_sq"], ["kd_loss"], keepdims=0)])
            return "kd_loss"

    from onnxtrain.training.api import CheckpointState, Module

    artifacts.generate_artifacts(model, requires_grad=["W"], loss=Distance(),
                                 loss_input_names=["out", "teacher"], artifact_directory=str(tmp_path))
    module = Module(str(tmp_path / "training_model.onnx"),
                    CheckpointState.load_checkpoint(str(tmp_path / "checkpoint")))
    assert module.input_names() == ["x", "teacher"]
    rng = np.random.default_rng(1)
    x, t = rng.standard_normal((2, 3)).astype(np.float32), rng.standard_normal((2, 2)).astype(np.float32)
    np.testing.assert_allclose(module(x, t), np.mean((x @ w - t) ** 2), rtol=1e-6)
    with pytest.raises(LookupError, match="loss input 'typo' is not a value of the model"):
        artifacts.generate_artifacts(model, requires_grad=["W"], loss=artifacts.LossType.MSELoss,
                                     loss_input_names=["typo", "target"], artifact_directory=str(tmp_path))
