"""Refusals of the on-device API are ``RuntimeError``\\ s, as onnxruntime-training 1.19.2 raised them (each
case was run there: a plain ``RuntimeError`` from its binding), and keep the Python class onnxtrain raised
before (``ValueError``, ``TypeError``, ``FileNotFoundError``, ``IsADirectoryError``), so both kinds of
``except`` clause catch them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module, Optimizer
from onnxtrain.training.ort_artifacts import translate_optimizer_model
from onnxtrain.training.ort_artifacts.common import TranslationError


def _linear() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "W")
    b = numpy_helper.from_array(np.zeros(3, np.float32), "b")
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])], "lin",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])], [w, b])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("arts")
    artifacts.generate_artifacts(_linear(), requires_grad=["W", "b"], loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=str(folder))
    state = CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    module = Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"))
    return folder, state, module


def _refused(call, python_class: type) -> BaseException:
    with pytest.raises(RuntimeError) as info:
        call()
    assert isinstance(info.value, python_class), type(info.value).__mro__
    return info.value


def test_module_refusals_are_runtime_errors(setup):
    folder, _, module = setup
    n = module.get_parameters_size(True)
    _refused(lambda: module.copy_buffer_to_parameters(np.zeros(n + 1, np.float32), True), ValueError)
    _refused(lambda: module.copy_buffer_to_parameters(np.zeros(n, np.float64), True), TypeError)
    _refused(lambda: module.export_model_for_inferencing(str(folder / "inf.onnx"), []), ValueError)
    _refused(lambda: module.export_model_for_inferencing(str(folder / "inf.onnx"), ["nope"]), ValueError)
    e = _refused(lambda: module.export_model_for_inferencing(str(folder / "no" / "inf.onnx"), ["y"]),
                 FileNotFoundError)
    assert "no" in str(e)
    x = np.ones((4, 4), np.float32)
    _refused(lambda: module(x, np.ones((5, 3), np.float32)), ValueError)  # batch sizes differ
    _refused(lambda: Module(str(folder / "missing.onnx"), module.state), FileNotFoundError)


def test_optimizer_refusals_are_runtime_errors(setup):
    folder, _, module = setup
    e = _refused(lambda: Optimizer(str(folder / "missing.onnx"), module), FileNotFoundError)
    assert "missing.onnx" in str(e)
    e = _refused(lambda: Optimizer(str(folder / "training_model.onnx"), module), ValueError)
    assert "not an optimizer model" in str(e)
    opt = Optimizer(str(folder / "optimizer_model.onnx"), module)
    _refused(lambda: opt.set_learning_rate("fast"), TypeError)


def test_checkpoint_on_a_folder_is_a_runtime_error(setup):
    folder, state, _ = setup
    _refused(lambda: CheckpointState.load_checkpoint(str(folder)), IsADirectoryError)
    _refused(lambda: CheckpointState.save_checkpoint(state, str(folder)), IsADirectoryError)


def test_training_model_of_onnxruntime_as_optimizer_names_the_mistake():
    """An onnxruntime-training model (here one com.microsoft node) given as the optimizer model: the error
    says it is not an optimizer model, rather than naming its first node as an unknown optimizer op."""
    node = helper.make_node("Scale", ["x"], ["y"], domain="com.microsoft")
    g = helper.make_graph([node], "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(g, opset_imports=opsets)
    with pytest.raises(TranslationError, match="not an optimizer model") as info:
        translate_optimizer_model(model, model)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)
