"""A training model whose labels come through an ``ai.onnx.ml`` LabelEncoder (string class names → indices):
artifacts, Module and Optimizer run it; the first loss and gradient are checked against numpy in float64."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.training import api, artifacts


def test_string_labels_encoded_in_the_graph_train(tmp_path) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["logits"]),
             helper.make_node("LabelEncoder", ["names"], ["labels"], domain="ai.onnx.ml",
                              keys_strings=["cat", "dog", "eel"], values_int64s=[0, 1, 2]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
                                       helper.make_tensor_value_info("names", TensorProto.STRING, ["N"])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          [numpy_helper.from_array(w, "W")])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 2)]
    model = helper.make_model(g, opset_imports=opsets)
    model.ir_version = 9
    artifacts.generate_artifacts(model, requires_grad=["W"], loss=None, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=str(tmp_path))
    state = api.CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    module = api.Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    x = rng.standard_normal((3, 4)).astype(np.float32)
    names = np.array(["dog", "eel", "cat"], dtype=object)
    loss = module(x, names)

    # the oracle: softmax cross-entropy of x·W against the classes' indices, in float64
    labels = np.array([1, 2, 0])
    z = x.astype(np.float64) @ w.astype(np.float64)
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    want = -np.log(p[np.arange(3), labels]).mean()
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    onehot = np.eye(3)[labels]
    grad = x.astype(np.float64).T @ (p - onehot) / 3
    np.testing.assert_allclose(state.parameters["W"].grad, grad, rtol=1e-4, atol=1e-6)
    optimizer = api.Optimizer(str(tmp_path / "optimizer_model.onnx"), module)
    optimizer.step()
    assert float(module(x, names)) < float(loss)
