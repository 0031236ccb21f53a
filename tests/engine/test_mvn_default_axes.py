"""MeanVarianceNormalization's default axes [0, 2, 3] on a 3-D input: onnxruntime normalises over the axes
the input has (0 and 2); onnxtrain (and onnx.reference) failed with "axis 3 is out of bounds". Values
against onnxruntime, the gradient against float64 central differences."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper

from onnxtrain.engine import compile_model
from onnxtrain.testing import gradcheck


def _model(elem: int, shape: list | None) -> onnx.ModelProto:
    g = helper.make_graph([helper.make_node("MeanVarianceNormalization", ["x"], ["y"]),
                           helper.make_node("Mul", ["y", "w"], ["p"]),
                           helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0)], "g",
                          [helper.make_tensor_value_info("x", elem, shape),
                           helper.make_tensor_value_info("w", elem, shape)],
                          [helper.make_tensor_value_info("y", elem, None),
                           helper.make_tensor_value_info("loss", elem, [])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("shape", [[2, 4, 3], None], ids=["static", "unknown-rank"])
def test_default_axes_on_a_3d_input_match_onnxruntime(shape: list | None) -> None:
    rng = np.random.default_rng(0)
    x, w = (rng.standard_normal((2, 4, 3)).astype(np.float32) for _ in range(2))
    m = _model(TensorProto.FLOAT, shape)
    want = onnxruntime.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["y"], {"x": x, "w": w})[0]
    np.testing.assert_allclose(compile_model(m).run({"x": x, "w": w}, ["y"])[0], want, rtol=1e-5, atol=1e-6)


def test_default_axes_gradient_on_a_3d_input() -> None:
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((2, 4, 3)), "w": rng.standard_normal((2, 4, 3))}
    gradcheck(_model(TensorProto.DOUBLE, [2, 4, 3]), "loss", ["x"], feeds, rtol=1e-6, atol=1e-8)
