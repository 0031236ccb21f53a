"""The scikit-learn preprocessing and linear-model kernels of ``ai.onnx.ml`` (Scaler, Normalizer, Imputer,
LinearRegressor, LinearClassifier; engine/kernels/ml_linear.py) against onnxruntime, whose CPU provider runs
the domain, and torch's ndtri for PROBIT (onnxruntime approximates erfinv)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.engine import compile_model

RNG = np.random.default_rng(5)
X = RNG.standard_normal((6, 3)).astype(np.float32)
X_NAN = X.copy()
X_NAN[[1, 4], [2, 0]] = np.nan
ZERO_ROWS = np.array([[0, 0, 0], [-3, -1, 0], [1, 2, 3]], np.float32)  # L2 of 0, a max of 0

# (op, attributes, input, output type)
CASES: list[tuple[str, dict[str, Any], np.ndarray, int]] = [
    ("Scaler", {"offset": [0.5, -1.0, 2.0], "scale": [2.0, 3.0, 0.5]}, X, TensorProto.FLOAT),
    ("Scaler", {"offset": [0.5], "scale": [2.0]}, X.astype(np.float64), TensorProto.FLOAT),
    ("Scaler", {"offset": [1.5, 0.0, -2.0], "scale": [0.5, 1.0, 2.0]}, (X * 9).astype(np.int64),
     TensorProto.FLOAT),
    ("Scaler", {"offset": [0.0], "scale": [3.0]}, X[0], TensorProto.FLOAT),
    *[("Normalizer", {"norm": n}, x, TensorProto.FLOAT) for n in ("MAX", "L1", "L2")
      for x in (X, X.astype(np.float64), (X * 9).astype(np.int32), X[0], ZERO_ROWS)],
    ("Imputer", {"imputed_value_floats": [1.5, 2.5, 3.5]}, X_NAN, TensorProto.FLOAT),
    ("Imputer", {"imputed_value_floats": [9.0]}, X_NAN, TensorProto.FLOAT),
    ("Imputer", {"imputed_value_floats": [1.5, 2.5, 3.5], "replaced_value_float": float("nan")}, X_NAN,
     TensorProto.FLOAT),
    ("Imputer", {"imputed_value_floats": [7.0], "replaced_value_float": 0.0}, X.round(), TensorProto.FLOAT),
    ("Imputer", {"imputed_value_int64s": [5, 6, 7], "replaced_value_int64": 0}, (X * 2).astype(np.int64),
     TensorProto.INT64),
    ("LinearRegressor", {"coefficients": [0.5, -1.0, 2.0, 1.0, 1.0, 1.0], "intercepts": [0.1, -0.2],
                         "targets": 2}, X, TensorProto.FLOAT),
    ("LinearRegressor", {"coefficients": [0.5, -1.0, 2.0]}, X, TensorProto.FLOAT),
    ("LinearRegressor", {"coefficients": [0.5, -1.0, 2.0], "intercepts": [1.0]}, X[2], TensorProto.FLOAT),
]


def _model(op: str, attrs: dict[str, Any], x: np.ndarray, out_type: int) -> onnx.ModelProto:
    g = helper.make_graph([helper.make_node(op, ["x"], ["y"], name="n", domain="ai.onnx.ml", **attrs)], "g",
                          [helper.make_tensor_value_info("x", helper.np_dtype_to_tensor_dtype(x.dtype),
                                                         x.shape)],
                          [helper.make_tensor_value_info("y", out_type, [None] * max(x.ndim, 2))])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("ai.onnx.ml", 3)]
    return helper.make_model(g, opset_imports=opsets)


@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda i: f"{CASES[i][0]}-{i}")
def test_matches_onnxruntime(case: int) -> None:
    op, attrs, x, out_type = CASES[case]
    assert_like_onnxruntime(_model(op, attrs, x, out_type), x, 1e-6, 1e-7)


def assert_like_onnxruntime(model: onnx.ModelProto, x: np.ndarray, rtol: float, atol: float) -> None:
    """The model (checked in full) gives onnxruntime's one output on input ``x``: dtype, shape and values."""
    ort = pytest.importorskip("onnxruntime")
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,), (got,) = sess.run(None, {"x": x}), compile_model(model).run({"x": x})
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def test_linear_regressor_probit_is_the_normal_quantile() -> None:
    torch = pytest.importorskip("torch")
    coef, b = [0.05, -0.1, 0.2], 0.4
    model = _model("LinearRegressor", {"coefficients": coef, "intercepts": [b], "post_transform": "PROBIT"},
                   X, TensorProto.FLOAT)
    (got,) = compile_model(model).run({"x": X})
    p = X.astype(np.float64) @ np.asarray(coef, np.float32).astype(np.float64) + np.float32(b)
    want = torch.special.ndtri(torch.tensor(p)).numpy()
    np.testing.assert_allclose(got.reshape(-1), want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize(("op", "attrs", "match"), [
    ("Scaler", {"offset": [1.0, 2.0], "scale": [1.0]}, "offset has 2 values"),
    ("Normalizer", {"norm": "L3"}, "norm must be MAX, L1 or L2"),
    ("Imputer", {"imputed_value_floats": [1.0, 2.0]}, "one imputed value, or one per feature"),
    ("LinearRegressor", {"coefficients": [1.0, 2.0], "targets": 1}, "2 coefficients for 1 target"),
    ("LinearRegressor", {"coefficients": [1.0, 2.0, 3.0], "post_transform": "SOFTMAX"}, "SOFTMAX"),
])
def test_bad_attributes_are_refused_naming_the_node(op: str, attrs: dict, match: str) -> None:
    model = _model(op, attrs, X, TensorProto.FLOAT)
    with pytest.raises(Exception, match=rf"{op} 'n'.*{match}"):
        compile_model(model).run({"x": X})


def _classifier(attrs: dict[str, Any], x: np.ndarray) -> onnx.ModelProto:
    label = TensorProto.STRING if "classlabels_strings" in attrs else TensorProto.INT64
    node = helper.make_node("LinearClassifier", ["x"], ["y", "z"], name="n", domain="ai.onnx.ml", **attrs)
    outs = [helper.make_tensor_value_info("y", label, [None]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, [None, None])]
    x_info = helper.make_tensor_value_info("x", helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
    g = helper.make_graph([node], "g", [x_info], outs)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("ai.onnx.ml", 1)]
    return helper.make_model(g, opset_imports=opsets)


@pytest.mark.parametrize("post", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
@pytest.mark.parametrize("labels", ["ints", "strings"])
@pytest.mark.parametrize("classes", [3, 2, 1])  # 1: one set of coefficients for two labels (binary)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_linear_classifier_matches_onnxruntime(post: str, labels: str, classes: int, dtype) -> None:
    ort = pytest.importorskip("onnxruntime")
    x = (X * 4).astype(dtype)
    names = ([3, 7, 9] if labels == "ints" else ["a", "b", "c"])[: max(classes, 2)]
    attrs = {"coefficients": list(RNG.standard_normal(3 * classes)),
             "intercepts": list(RNG.standard_normal(classes)), f"classlabels_{labels}": names,
             "post_transform": post}
    model = _classifier(attrs, x)
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, {"x": x})
    got = compile_model(model).run({"x": x})
    assert list(got[0]) == list(want[0]) and got[1].dtype == want[1].dtype and got[1].shape == want[1].shape
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)


def test_linear_classifier_probit_and_bad_attributes() -> None:
    torch = pytest.importorskip("torch")
    coef, b = [0.05, -0.1, 0.2, 0.1, 0.0, -0.1], [0.4, 0.6]
    model = _classifier({"coefficients": coef, "intercepts": b, "classlabels_ints": [0, 1],
                         "post_transform": "PROBIT"}, X)
    got = compile_model(model).run({"x": X})
    p = X.astype(np.float64) @ np.asarray(coef, np.float32).reshape(2, 3).T.astype(np.float64)
    p += np.asarray(b, np.float32)
    np.testing.assert_allclose(got[1], torch.special.ndtri(torch.tensor(p)).numpy(), rtol=2e-6, atol=1e-6)
    binary_probit = _classifier({"coefficients": coef[:3], "classlabels_ints": [0, 1],
                                 "post_transform": "PROBIT"}, X)
    with pytest.raises(Exception, match="LinearClassifier 'n'.*PROBIT"):
        compile_model(binary_probit).run({"x": X})
    few_labels = _classifier({"coefficients": coef, "classlabels_ints": [0, 1, 2]}, X)
    with pytest.raises(Exception, match="LinearClassifier 'n': 3 class labels for 2 sets"):
        compile_model(few_labels).run({"x": X})
