"""``onnxtrain.testing.gradcheck`` on a float32 model: a warning that says why finite differences fail and
how to convert the model, and the same check passing on ``to_float64`` of it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.testing import gradcheck, to_float64


def _mlp32():
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "W")
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Tanh", ["h"], ["t"]),
         helper.make_node("ReduceSum", ["t"], ["loss"], keepdims=0)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_float32_model_warns_and_its_float64_copy_matches_torch() -> None:
    model = _mlp32()
    x = np.random.default_rng(1).standard_normal((2, 3))
    with pytest.warns(UserWarning, match=r"'loss' is float, 'W' is float, not float64 .*to_float64"):
        try:  # (it may pass or fail here; when it fails, the error repeats the hint)
            gradcheck(model, "loss", ["W"], {"x": x.astype(np.float32)})
        except AssertionError as e:
            assert "to_float64" in str(e)
    grads = gradcheck(to_float64(model), "loss", ["W"], {"x": x})
    w = torch.tensor(numpy_helper.to_array(model.graph.initializer[0]).astype(np.float64), requires_grad=True)
    torch.tanh(torch.tensor(x) @ w).sum().backward()
    np.testing.assert_allclose(grads["W"], w.grad.numpy(), rtol=1e-12)
