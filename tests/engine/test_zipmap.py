"""ai.onnx.ml ZipMap (engine/kernels/zipmap.py) against onnxruntime: int64 and string labels, a [C] input,
no rows, a repeated label; the dicts' key order and Python types, and the output's declared type through
``InferenceSession``; bad input and attributes refused by name."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxtrain

X = np.random.default_rng(5).standard_normal((4, 3)).astype(np.float32)


def _model(labels: list, strings: bool, shape: list, dtype: int = TensorProto.FLOAT) -> onnx.ModelProto:
    kw = {"classlabels_strings" if strings else "classlabels_int64s": labels}
    node = helper.make_node("ZipMap", ["x"], ["z"], domain="ai.onnx.ml", name="zm", **kw)
    value = helper.make_tensor_type_proto(TensorProto.FLOAT, [])
    key = TensorProto.STRING if strings else TensorProto.INT64
    z_type = helper.make_sequence_type_proto(helper.make_map_type_proto(key, value))
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", dtype, shape)],
                          [helper.make_value_info("z", z_type)])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("ai.onnx.ml", 1)]
    return helper.make_model(g, opset_imports=opsets)


@pytest.mark.parametrize(("labels", "strings"), [([5, 1, 3], False), (["b", "a", "c"], True),
                                                 ([-2, 7, -2], False), (["y", "x", "y"], True)])
@pytest.mark.parametrize("rows", ["matrix", "vector", "none"])
def test_matches_onnxruntime(labels: list, strings: bool, rows: str) -> None:
    ort = pytest.importorskip("onnxruntime")
    x = {"matrix": X[:, :3], "vector": X[0, :3], "none": X[:0, :3]}[rows]
    model = _model(labels, strings, list(x.shape))
    onnx.checker.check_model(model, full_check=True)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sess = onnxtrain.InferenceSession(model.SerializeToString())
    (want,), (got,) = ref.run(None, {"x": x}), sess.run(None, {"x": x})
    assert sess.get_outputs()[0].type == ref.get_outputs()[0].type
    assert isinstance(got, list) and len(got) == len(want) == (1 if x.ndim == 1 else len(x))
    for g, w in zip(got, want):
        assert list(g.items()) == list(w.items())  # same keys, in the same order, and exactly the same values
        assert all(type(k) is type(kw) and type(v) is float for (k, v), kw in zip(g.items(), w))


def test_scores_of_a_fitted_classifier_keep_their_float32_values() -> None:
    sess = onnxtrain.InferenceSession(_model([0, 1, 2], False, [None, 3]).SerializeToString())
    (got,) = sess.run(None, {"x": X[:, :3]})
    np.testing.assert_array_equal(np.array([[d[k] for k in (0, 1, 2)] for d in got], np.float32), X[:, :3])


@pytest.mark.parametrize(("labels", "strings", "x", "match"), [
    ([0, 1], False, X[:, :3], "3 scores per row for 2 class labels"),
    ([0, 1, 2], False, X[:, :3].reshape(2, 2, 3), r"must be \[N, C\] or \[C\], got shape \[2, 2, 3\]"),
    ([0, 1, 2], False, np.asarray(X[0, 0]), r"must be \[N, C\] or \[C\], got shape \[\]"),
])
def test_bad_input_is_refused_naming_the_node(labels: list, strings: bool, x: np.ndarray, match: str) -> None:
    sess = onnxtrain.InferenceSession(_model(labels, strings, list(x.shape)).SerializeToString())
    with pytest.raises(Exception, match=f"ZipMap 'zm': (the input )?{match}"):
        sess.run(None, {"x": x})


@pytest.mark.parametrize("kinds", ["none", "both"])
def test_one_label_kind_is_required(kinds: str) -> None:
    model = _model([0, 1, 2], False, [None, 3])
    if kinds == "none":
        del model.graph.node[0].attribute[:]
    else:
        model.graph.node[0].attribute.append(helper.make_attribute("classlabels_strings", ["a", "b", "c"]))
    with pytest.raises(Exception, match="ZipMap 'zm': give classlabels_strings or classlabels_int64s, one"):
        onnxtrain.InferenceSession(model.SerializeToString()).run(None, {"x": X[:, :3]})


def test_each_run_gives_the_caller_dicts_of_its_own() -> None:
    """The dicts are made anew by every run (the engine neither copies nor counts them item by item: a
    scikit-learn classifier's 1,000-row run spent 5 of its 8 ms there): changing one run's result leaves the
    next run's as it was."""
    sess = onnxtrain.InferenceSession(_model([0, 1, 2], False, [None, 3]).SerializeToString())
    (first,) = sess.run(None, {"x": X[:, :3]})
    first[0][0] = 99.0
    (second,) = sess.run(None, {"x": X[:, :3]})
    assert second[0][0] == float(X[0, 0]) and first[0] is not second[0]
