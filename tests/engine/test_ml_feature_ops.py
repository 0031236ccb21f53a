"""ai.onnx.ml CategoryMapper and FeatureVectorizer (engine/kernels/category_mapper.py, feature_vectorizer.py)
against onnxruntime: both directions of the mapping with defaults and a repeated category, no rows; inputs
cut and padded to their widths, trailing axes flattened, [C] inputs, the four input types, a zero width;
bad attributes and inputs refused naming the node."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper

from onnxtrain.engine import compile_model

RNG = np.random.default_rng(8)
OPSETS = [helper.make_opsetid("", 18), helper.make_opsetid("ai.onnx.ml", 1)]
CATS = {"cats_strings": ["a", "b", "c", "b"], "cats_int64s": [1, 2, 3, 4]}  # "b" twice: its last pair counts


def _same_as_onnxruntime(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    ort = pytest.importorskip("onnxruntime")
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,), (got,) = sess.run(None, feeds), compile_model(model).run(feeds)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tolist() == want.tolist()
    return got


def _mapper(x: np.ndarray, **attrs: Any) -> onnx.ModelProto:
    xt, yt = (T.STRING, T.INT64) if x.dtype == object else (T.INT64, T.STRING)
    node = helper.make_node("CategoryMapper", ["x"], ["y"], domain="ai.onnx.ml", name="cm", **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", xt, x.shape)],
                          [helper.make_tensor_value_info("y", yt, x.shape)])
    return helper.make_model(g, opset_imports=OPSETS)


@pytest.mark.parametrize(("x", "defaults", "want"), [
    (np.array([["a", "b"], ["z", "c"]], object), {}, [[1, 4], [-1, 3]]),
    (np.array(["q", "a"], object), {"default_int64": -7}, [-7, 1]),
    (np.array([1, 4, 9, 2]), {}, ["a", "b", "_Unused", "b"]),
    (np.array([[1, 4], [9, 2]]), {"default_string": "?"}, [["a", "b"], ["?", "b"]]),
    (np.zeros((0, 3), np.int64), {}, np.zeros((0, 3)).tolist()),
])
def test_category_mapper_matches_onnxruntime(x: np.ndarray, defaults: dict, want: list) -> None:
    assert _same_as_onnxruntime(_mapper(x, **CATS, **defaults), {"x": x}).tolist() == want


def test_category_mapper_lists_must_pair_up() -> None:
    x = np.array(["a"], object)
    with pytest.raises(Exception, match="CategoryMapper 'cm': 2 cats_strings for 1 cats_int64s"):
        compile_model(_mapper(x, cats_strings=["a", "b"], cats_int64s=[1])).run({"x": x})


def _vectorizer(xs: list[np.ndarray], widths: list[int]) -> onnx.ModelProto:
    names = [f"x{i}" for i in range(len(xs))]
    node = helper.make_node("FeatureVectorizer", names, ["y"], domain="ai.onnx.ml", name="fv",
                            inputdimensions=widths)
    code = {np.dtype(np.float32): T.FLOAT, np.dtype(np.float64): T.DOUBLE, np.dtype(np.int64): T.INT64,
            np.dtype(np.int32): T.INT32}[xs[0].dtype]
    ins = [helper.make_tensor_value_info(n, code, x.shape) for n, x in zip(names, xs)]
    out = helper.make_tensor_value_info("y", T.FLOAT, [None, sum(widths)])
    g = helper.make_graph([node], "g", ins, [out])
    return helper.make_model(g, opset_imports=OPSETS)


A = RNG.standard_normal((3, 4)).astype(np.float32)
B = RNG.standard_normal((3, 2)).astype(np.float32)
C = RNG.standard_normal((3, 2, 2)).astype(np.float32)


@pytest.mark.parametrize(("xs", "widths"), [
    ([A, B], [4, 2]),
    ([A, B], [2, 5]),  # A cut to 2 columns, B padded to 5
    ([A, C, B], [3, 4, 2]),  # C's trailing axes flattened
    ([A[0], B[0]], [4, 2]),  # [C] inputs: one row
    ([A, B], [0, 2]),
    ([A[:0]], [4]),  # an empty batch
    ([A[:0]], [6]),
])
def test_feature_vectorizer_matches_onnxruntime(xs: list[np.ndarray], widths: list[int]) -> None:
    got = _same_as_onnxruntime(_vectorizer(xs, widths), {f"x{i}": x for i, x in enumerate(xs)})
    assert got.shape == (1 if xs[0].ndim == 1 else len(xs[0]), sum(widths))


def test_feature_vectorizer_of_empty_batches() -> None:
    """Several inputs of no rows give [0, the widths' sum] (onnxruntime 1.32 aborts the process there; one
    such input it runs, in the test above)."""
    xs = [A[:0], C[:0], B[:0]]
    got = compile_model(_vectorizer(xs, [2, 4, 3])).run({f"x{i}": x for i, x in enumerate(xs)})[0]
    assert got.dtype == np.float32 and got.shape == (0, 9)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.float64])
def test_feature_vectorizer_casts_to_float32_as_onnxruntime(dtype: type) -> None:
    big = 1e8 if dtype == np.int32 else 1e12  # past float32's 2**24: rounded as onnxruntime rounds
    small, large = RNG.standard_normal((3, 3)) * 1e3, RNG.standard_normal((3, 2)) * big
    xs = [small.astype(dtype), large.astype(dtype)]
    _same_as_onnxruntime(_vectorizer(xs, [3, 3]), {"x0": xs[0], "x1": xs[1]})


@pytest.mark.parametrize(("xs", "widths", "match"), [
    ([A, B[:2]], [4, 2], r"the inputs have \[3, 2\] rows; they must have as many"),
    ([A, B], [4], "2 inputs for 1 inputdimensions"),
    ([A, B], [4, -1], r"inputdimensions \[4, -1\] holds a negative width"),
])
def test_feature_vectorizer_refuses_naming_the_node(xs: list[np.ndarray], widths: list[int],
                                                    match: str) -> None:
    model = _vectorizer(xs, widths)
    with pytest.raises(Exception, match=f"FeatureVectorizer 'fv': {match}"):
        compile_model(model).run({f"x{i}": x for i, x in enumerate(xs)})
