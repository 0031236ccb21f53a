"""ai.onnx.ml OneHotEncoder (engine/kernels/onehot_encoder.py) against onnxruntime: string, int64, float and
double inputs (truncated to integers), repeated categories, unknown values with zeros = 1 and 0, NaN and inf,
no rows, a scalar; a rank-3 input against the spec's shape; bad attributes and inputs refused by name."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.engine import compile_model

T = TensorProto
_TYPES = {np.dtype(np.int64): T.INT64, np.dtype(np.float32): T.FLOAT, np.dtype(np.float64): T.DOUBLE,
          np.dtype(np.int32): T.INT32, np.dtype(object): T.STRING}


def _model(cats: list, x: np.ndarray, zeros: int = 1) -> onnx.ModelProto:
    kw = {"cats_strings" if isinstance(cats[0], str) else "cats_int64s": cats}
    node = helper.make_node("OneHotEncoder", ["x"], ["y"], domain="ai.onnx.ml", name="ohe", zeros=zeros, **kw)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", _TYPES[x.dtype], x.shape)],
                          [helper.make_tensor_value_info("y", T.FLOAT, [*x.shape, len(cats)])])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("ai.onnx.ml", 1)]
    return helper.make_model(g, opset_imports=opsets)


_CASES = [
    ([3, 1, 7], np.array([[1, 7], [3, 5]], np.int64)),
    ([3, 1, 7, 1], np.array([[1, 7], [3, 1]], np.int64)),  # 1 repeated: its last position
    ([3, -1, 7], np.array([[1.9, -1.5], [7.2, np.nan], [np.inf, -0.5], [3.0, -np.inf]], np.float32)),
    ([3, 1, 7], np.array([1.9, 3.0, 7.99], np.float64)),
    (["a", "b", "c"], np.array([["b", "z"], ["c", "a"]], dtype=object)),
    (["a", "b", "a"], np.array(["a", "b", ""], dtype=object)),
    ([3, 1, 7], np.zeros((0, 2), np.int64)),
    ([3, 1, 7], np.array(7, np.int64)),
]


@pytest.mark.parametrize("zeros", [1, 0])
@pytest.mark.parametrize(("cats", "x"), _CASES)
def test_matches_onnxruntime(cats: list, x: np.ndarray, zeros: int) -> None:
    ort = pytest.importorskip("onnxruntime")
    model = _model(cats, x, zeros)
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    try:
        (want,) = sess.run(None, {"x": x})
    except Exception as e:  # zeros = 0 and a value of no category
        assert "Unknown Category and zeros = 0" in str(e)
        with pytest.raises(Exception, match="OneHotEncoder 'ohe': .* is of no category, and zeros = 0"):
            compile_model(model).run({"x": x})
        return
    (got,) = compile_model(model).run({"x": x})
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_any_rank_and_int32_as_the_spec_says(dtype: type) -> None:
    """onnxruntime caps X at rank 2 and has no int32 kernel; the spec's Y is X's shape and one more axis."""
    x = np.array([[[1, 2], [3, 9]], [[2, 2], [1, 3]]], dtype)
    (got,) = compile_model(_model([1, 2, 3], x)).run({"x": x})
    want = (x[..., None] == np.array([1, 2, 3])).astype(np.float32)
    np.testing.assert_array_equal(got, want)


def test_the_unknown_value_is_named() -> None:
    x = np.array([["b", "zz"]], dtype=object)
    with pytest.raises(Exception, match="OneHotEncoder 'ohe': 'zz' is of no category, and zeros = 0"):
        compile_model(_model(["a", "b"], x, zeros=0)).run({"x": x})
    y = np.array([4.5], np.float32)
    with pytest.raises(Exception, match="OneHotEncoder 'ohe': 4.5 is of no category, and zeros = 0"):
        compile_model(_model([1], y, zeros=0)).run({"x": y})


@pytest.mark.parametrize("attrs", ["none", "both"])
def test_one_category_kind_is_required(attrs: str) -> None:
    x = np.array([1, 2], np.int64)
    model = _model([1, 2], x)
    if attrs == "none":
        kept = [a for a in model.graph.node[0].attribute if a.name == "zeros"]
        del model.graph.node[0].attribute[:]
        model.graph.node[0].attribute.extend(kept)
    else:
        model.graph.node[0].attribute.append(helper.make_attribute("cats_strings", ["a"]))
    with pytest.raises(Exception, match="OneHotEncoder 'ohe': give cats_strings or cats_int64s, one and not"):
        compile_model(model).run({"x": x})


def test_an_input_of_the_other_kind_is_refused() -> None:
    x = np.array(["a"], dtype=object)
    model = _model([1, 2], x)
    want = "OneHotEncoder 'ohe': a string input is looked up in cats_strings; the node gives cats_int64s"
    with pytest.raises(Exception, match=want):
        compile_model(model).run({"x": x})
