"""Eval and inference models put the Dropout and BatchNormalization nodes inside If/Loop bodies in inference
mode too (TorchScript writes a scripted model's ``nn.Dropout`` under an ``if`` into the branch, in training
mode when exported for training): they stayed in training mode, so ``Module.eval()``, the exported model,
``onnxtrain eval`` and the CLI's ``model.onnx`` dropped values at random (two runs on one input differed).
Oracle: the inference-mode result in numpy, relu(x)·W; the exported model run by plain onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.train.model import inference_model
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module

F = TensorProto.FLOAT


def _model(layer: str) -> onnx.ModelProto:
    """x → Relu → If(always true: a training-mode ``layer`` in the then branch) → MatMul W → out."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "W")
    if layer == "Dropout":
        half = numpy_helper.from_array(np.array(0.5, np.float32))
        body = [helper.make_node("Constant", [], ["ratio"], value=half),
                helper.make_node("Constant", [], ["on"], value=numpy_helper.from_array(np.array(True))),
                helper.make_node("Dropout", ["h", "ratio", "on"], ["hd", "mask"])]
    else:  # a BatchNormalization over the 8 features whose statistics (0, 1) leave h unchanged
        stats = {"scale": np.ones(8), "bias": np.zeros(8), "mean": np.zeros(8), "var": np.ones(8)}
        body = [helper.make_node("Constant", [], [k], value=numpy_helper.from_array(v.astype(np.float32)))
                for k, v in stats.items()]
        body.append(helper.make_node("BatchNormalization", ["h", "scale", "bias", "mean", "var"],
                                     ["hd", "m_out", "v_out"], training_mode=1, epsilon=0.0))
    then_g = helper.make_graph(body, "then", [], [helper.make_tensor_value_info("hd", F, None)])
    else_g = helper.make_graph([helper.make_node("Identity", ["h"], ["he"])], "else", [],
                               [helper.make_tensor_value_info("he", F, None)])
    g = helper.make_graph([
        helper.make_node("Relu", ["x"], ["h"]),
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        helper.make_node("Constant", [], ["lim"], value=numpy_helper.from_array(np.array(-1e9, np.float32))),
        helper.make_node("Greater", ["s", "lim"], ["c"]),
        helper.make_node("If", ["c"], ["hh"], then_branch=then_g, else_branch=else_g),
        helper.make_node("MatMul", ["hh", "W"], ["out"])], "g",
        [helper.make_tensor_value_info("x", F, ["b", 8])],
        [helper.make_tensor_value_info("out", F, ["b", 4])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("layer", ["Dropout", "BatchNormalization"])
def test_eval_and_exported_models_are_in_inference_mode_inside_bodies(layer: str, tmp_path) -> None:
    model = _model(layer)
    x = np.random.default_rng(1).standard_normal((6, 8)).astype(np.float32)
    want = np.maximum(x, 0) @ numpy_helper.to_array(model.graph.initializer[0])
    artifacts.generate_artifacts(model, requires_grad=["W"], loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    module = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    module.eval()
    target = np.zeros((6, 4), np.float32)
    np.testing.assert_allclose(float(module(x, target)), float(np.mean(want ** 2)), rtol=1e-5)
    module.export_model_for_inferencing(str(tmp_path / "inference.onnx"), ["out"])
    onnx.checker.check_model(str(tmp_path / "inference.onnx"), full_check=True)
    s = ort.InferenceSession(str(tmp_path / "inference.onnx"), providers=["CPUExecutionProvider"])
    for _ in range(2):
        np.testing.assert_allclose(s.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-6)
    cli = inference_model(model, ["out"])  # what `onnxtrain export` / `eval` run
    onnx.checker.check_model(cli, full_check=True)
    s = ort.InferenceSession(cli.SerializeToString(), providers=["CPUExecutionProvider"])
    for _ in range(2):
        np.testing.assert_allclose(s.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-6)
