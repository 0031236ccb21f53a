"""Einsum's implicit-mode empty equation on a scalar (the identity, as numpy and onnxruntime read it), and
its gradient; onnx.reference cannot run it, so onnxruntime and float64 differences are the oracles."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnxtrain
from onnxtrain.autodiff import build_gradient_model


def _model(shape: list[int]):
    g = helper.make_graph([helper.make_node("Einsum", ["x"], ["y"], equation=""),
                           helper.make_node("Mul", ["y", "y"], ["loss"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.DOUBLE, shape)],
                          [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, shape)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def test_a_scalar_with_the_empty_equation_is_itself_and_has_a_gradient() -> None:
    x = np.array(2.5)
    m = _model([]).SerializeToString()
    want = ort.InferenceSession(m, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(onnxtrain.InferenceSession(m).run(None, {"x": x}), want)
    gm = build_gradient_model(_model([]), "loss", ["x"])
    loss, grad = onnxtrain.InferenceSession(gm.SerializeToString()).run(None, {"x": x})
    eps = 1e-6
    np.testing.assert_allclose(grad, ((x + eps) ** 2 - (x - eps) ** 2) / (2 * eps), rtol=1e-9)


def test_the_empty_equation_on_a_tensor_is_refused_by_name() -> None:
    sess = onnxtrain.InferenceSession(_model([2]).SerializeToString())
    with pytest.raises(Exception, match="empty equation takes one scalar operand, got shapes"):
        sess.run(None, {"x": np.ones(2)})
