"""ai.onnx.ml TreeEnsembleClassifier (engine/kernels/tree_classifier.py) against onnxruntime on random
forests of three classes or more: every node mode, missing values, partial leaves, base values, int64 and
string labels and the four post transforms. A forest of two classes is refused by name."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.engine import compile_model
from tests.engine.test_tree_ensemble import features, random_forest


def classifier(attrs: dict[str, Any], n_features: int, strings: bool) -> onnx.ModelProto:
    node = helper.make_node("TreeEnsembleClassifier", ["X"], ["Y", "Z"], domain="ai.onnx.ml", name="trees",
                            **attrs)
    label = TensorProto.STRING if strings else TensorProto.INT64
    outs = [helper.make_tensor_value_info("Y", label, [None]),
            helper.make_tensor_value_info("Z", TensorProto.FLOAT, [None, None])]
    x_info = helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, n_features])
    g = helper.make_graph([node], "g", [x_info], outs)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)]
    m = helper.make_model(g, opset_imports=opsets)
    m.ir_version = 9
    return m


def _class_attrs(rng: np.random.Generator, classes: int, every: bool) -> dict[str, Any]:
    """A random forest whose leaves score classes (class_* for target_*)."""
    a = random_forest(rng, 4, 4, 5, classes, every_target=every)
    return {k.replace("target_", "class_"): v for k, v in a.items()}


@pytest.mark.parametrize("post", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
@pytest.mark.parametrize("classes", [3, 5])
@pytest.mark.parametrize("strings", [False, True])
@pytest.mark.parametrize("base", [False, True])
@pytest.mark.parametrize("every", [True, False])
def test_matches_onnxruntime(post: str, classes: int, strings: bool, base: bool, every: bool) -> None:
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng([classes, strings, base, every, len(post)])
    attrs = {**_class_attrs(rng, classes, every), "post_transform": post}
    attrs["classlabels_strings" if strings else "classlabels_int64s"] = (
        [f"c{i}" for i in range(classes)] if strings else list(range(7, 7 + classes)))
    if base:
        attrs["base_values"] = list(rng.uniform(-0.5, 0.5, classes))
    model = classifier(attrs, 5, strings)
    onnx.checker.check_model(model, full_check=True)
    x = features(rng, 64, 5)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, {"X": x})
    got = compile_model(model).run({"X": x})
    assert list(got[0]) == list(want[0])
    assert got[1].dtype == want[1].dtype and got[1].shape == want[1].shape
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)


def test_two_classes_and_bad_base_values_are_refused_by_name() -> None:
    rng = np.random.default_rng(3)
    binary = classifier({**_class_attrs(rng, 2, True), "classlabels_int64s": [0, 1]}, 5, False)
    with pytest.raises(Exception, match="TreeEnsembleClassifier 'trees': 2 class labels; .*binary"):
        compile_model(binary).run({"X": features(rng, 4, 5)})
    bad_base = classifier({**_class_attrs(rng, 3, True), "classlabels_int64s": [0, 1, 2],
                           "base_values": [0.5]}, 5, False)
    with pytest.raises(Exception, match="TreeEnsembleClassifier 'trees': 1 base values for 3 classes"):
        compile_model(bad_base).run({"X": features(rng, 4, 5)})
