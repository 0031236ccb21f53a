"""ai.onnx.ml SVMRegressor (engine/kernels/ml_svm.py) against onnxruntime: the four kernels, one_class, the
support-vector-free (linear) form, a [C] input; bad attributes refused by name."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import AttributeProto, TensorProto, helper

from onnxtrain.engine import compile_model
from tests.engine.test_ml_linear import assert_like_onnxruntime

RNG = np.random.default_rng(11)
X = RNG.standard_normal((7, 3)).astype(np.float32)


def _model(attrs: dict[str, Any], x: np.ndarray, empty: tuple[str, ...] = ()) -> onnx.ModelProto:
    node = helper.make_node("SVMRegressor", ["x"], ["y"], name="svr", domain="ai.onnx.ml", **attrs)
    node.attribute.extend(helper.make_attribute(k, [], attr_type=AttributeProto.FLOATS) for k in empty)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 1])])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("ai.onnx.ml", 1)]
    return helper.make_model(g, opset_imports=opsets)


def _supports(kind: str, params: list[float], one_class: int) -> dict[str, Any]:
    return {"kernel_type": kind, "kernel_params": params, "n_supports": 4, "one_class": one_class,
            "support_vectors": [float(v) for v in RNG.standard_normal(12)],
            "coefficients": [float(v) for v in RNG.standard_normal(4)], "rho": [0.25]}


@pytest.mark.parametrize("one_class", [0, 1])
@pytest.mark.parametrize(("kind", "params"), [("LINEAR", [0.1, 0.0, 1.0]), ("POLY", [0.5, 1.0, 3.0]),
                                              ("RBF", [0.7, 0.0, 0.0]), ("SIGMOID", [0.3, 0.2, 0.0])])
def test_kernels_match_onnxruntime(kind: str, params: list[float], one_class: int) -> None:
    for x in (X, X[0]):
        assert_like_onnxruntime(_model(_supports(kind, params, one_class), x), x, 1e-5, 1e-5)


@pytest.mark.parametrize("one_class", [0, 1])
def test_the_linear_form_without_support_vectors_matches_onnxruntime(one_class: int) -> None:
    attrs = {"n_supports": 0, "kernel_type": "LINEAR", "coefficients": [0.5, -1.0, 2.0], "rho": [0.1],
             "one_class": one_class}
    assert_like_onnxruntime(_model(attrs, X, empty=("support_vectors", "kernel_params")), X, 1e-6, 1e-6)


@pytest.mark.parametrize(("attrs", "match"), [
    ({**_supports("RBF", [0.7], 0)}, "kernel_params holds 1 values"),
    ({**_supports("CUBIC", [0.7, 0.0, 0.0], 0)}, "kernel_type must be LINEAR, POLY, RBF or SIGMOID"),
    ({**_supports("RBF", [0.7, 0.0, 0.0], 0), "n_supports": 5}, "5 support vectors need 15"),
    ({"n_supports": 0, "coefficients": [1.0, 2.0], "rho": [0.0]}, "2 coefficients for 3 features"),
])
def test_bad_attributes_are_refused_naming_the_node(attrs: dict, match: str) -> None:
    with pytest.raises(Exception, match=f"SVMRegressor 'svr': {match}"):
        compile_model(_model(attrs, X)).run({"x": X})
