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


def _matmul_model(w: np.ndarray, batch: int) -> onnx.ModelProto:
    """out = x · W, x of shape (batch, rows of W)."""
    return helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["out"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, w.shape[0]])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [batch, w.shape[1]])],
        [onnx.numpy_helper.from_array(w, "W")]),
        opset_imports=[helper.make_opsetid("", 17)])


def test_unknown_loss_input_is_a_lookup_error(tmp_path) -> None:
    model = _matmul_model(np.ones((3, 2), np.float32), 2)
    with pytest.raises(LookupError, match="loss input 'nope' is not a value of the model"):
        artifacts.generate_artifacts(model, requires_grad=["W"], loss=artifacts.LossType.MSELoss,
                                     loss_input_names=["nope"], artifact_directory=str(tmp_path))


def test_loss_inputs_the_loss_block_adds_itself(tmp_path) -> None:
    """``loss_input_names`` may name inputs the custom loss block adds to the graph (a distillation loss's
    teacher logits), as onnxruntime-training allows: the artifacts train on them (the loss checked against
    numpy); a name neither the model nor the block has is still refused by name."""
    w = np.random.default_rng(0).standard_normal((3, 2)).astype(np.float32)
    model = _matmul_model(w, 2)

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


def test_a_custom_loss_written_with_onnxruntime_trainings_graph_utils(tmp_path) -> None:
    """A Dice loss in the style of public on-device scripts, which copy onnxruntime-training's own loss
    blocks: ``_graph_utils`` to find the output's type, to ask whether the target exists and to name
    constants, and the loss and optimizer blocks imported from ``onnxblock.loss.loss`` and
    ``onnxblock.optim.optim``. Its loss is checked against numpy."""
    import copy

    from onnxtrain.training.api import CheckpointState, Module
    from onnxtrain.training.onnxblock import _graph_utils
    from onnxtrain.training.onnxblock.loss.loss import MSELoss
    from onnxtrain.training.onnxblock.optim.optim import AdamW

    assert MSELoss is onnxblock.loss.MSELoss and AdamW is onnxblock.optim.AdamW

    class DiceLoss(onnxblock.Block):
        def __init__(self) -> None:
            super().__init__()
            self._sum, self._mean = blocks.ReduceSum(keepdims=True), blocks.ReduceMean(keepdims=False)
            self._mul, self._add = blocks.Mul(), blocks.Add()
            self._div, self._sub = blocks.Div(), blocks.Sub()

        def build(self, out: str, target: str = "target") -> str:
            if not _graph_utils.node_arg_exists(self.base, target):
                declared = copy.deepcopy(_graph_utils.get_output_from_output_name(self.base, out))
                declared.name = target
                self.base.graph.input.append(declared)
            two = _graph_utils.generate_graph_name("dice.two")
            one = _graph_utils.generate_graph_name("dice.one")
            assert two != one and two.startswith("onnx::dice.two::")
            self.base.graph.initializer.extend([helper.make_tensor(two, TensorProto.FLOAT, [1], [2.0]),
                                                helper.make_tensor(one, TensorProto.FLOAT, [1], [1.0])])
            inter = self._mul(two, self._sum(self._mul(out, target)))
            return self._mean(self._sub(one, self._div(inter, self._add(self._sum(target), self._sum(out)))))

    w = np.random.default_rng(0).random((3, 2)).astype(np.float32)
    model = _matmul_model(w, 4)
    artifacts.generate_artifacts(model, requires_grad=["W"], loss=DiceLoss(),
                                 artifact_directory=str(tmp_path))
    module = Module(str(tmp_path / "training_model.onnx"),
                    CheckpointState.load_checkpoint(str(tmp_path / "checkpoint")))
    rng = np.random.default_rng(1)
    x, t = rng.random((4, 3)).astype(np.float32), rng.random((4, 2)).astype(np.float32)
    y = x @ w
    np.testing.assert_allclose(module(x, t), 1 - 2 * np.sum(y * t) / (np.sum(t) + np.sum(y)), rtol=1e-6)
    with pytest.raises(LookupError, match="'nope' is not a graph output"):
        _graph_utils.get_output_from_output_name(model, "nope")
    assert _graph_utils.get_input_from_input_name(model, "x").name == "x"
    assert not _graph_utils.node_arg_exists(model, "nope")
