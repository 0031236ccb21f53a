"""ai.onnx.ml TreeEnsembleClassifier (engine/kernels/tree_classifier.py) against onnxruntime 1.32.

Three classes or more: random forests over every node mode, missing values, partial leaves, base values,
int64 and string labels and the four post transforms.

Two classes (binary classifiers): random forests whose leaves score class 0 only, class 1 only, both
classes, or some of them each, with all-positive and mixed-sign weights, no, one or two base values, int64
labels [0, 1] and [3, 9] (refused where the leaves score both classes) and string labels, and every post
transform (PROBIT within onnxruntime's approximation of erfinv); double thresholds and inputs; a [C] input.
The rows for which onnxruntime leaves the second score unwritten are refused by name (which rows those are,
an onnxruntime regressor tells). One test pins onnxruntime's departures from the spec with literal values;
one runs scikit-learn's binary DecisionTree, RandomForest, ExtraTrees and GradientBoosting classifiers as
skl2onnx exports them (tests/data/sklearn_trees/, written by tools/make_sklearn_tree_fixtures.py)."""

from __future__ import annotations

import os
import zlib
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.engine import compile_model
from onnxtrain.engine.interface import EngineError
from tests.engine.test_tree_ensemble import features, random_forest, regressor

ort = pytest.importorskip("onnxruntime")
FIXTURES = os.path.join(os.path.dirname(__file__), "..", "data", "sklearn_trees")
POSTS = ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO", "PROBIT"]


def classifier(attrs: dict[str, Any], n_features: int | None, strings: bool,
               x_type: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """A model of one TreeEnsembleClassifier node (``n_features`` None: an input of no declared shape)."""
    node = helper.make_node("TreeEnsembleClassifier", ["X"], ["Y", "Z"], domain="ai.onnx.ml", name="trees",
                            **attrs)
    label = TensorProto.STRING if strings else TensorProto.INT64
    outs = [helper.make_tensor_value_info("Y", label, [None]),
            helper.make_tensor_value_info("Z", TensorProto.FLOAT, [None, None])]
    x_info = helper.make_tensor_value_info("X", x_type, None if n_features is None else [None, n_features])
    g = helper.make_graph([node], "g", [x_info], outs)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)]
    m = helper.make_model(g, opset_imports=opsets)
    m.ir_version = 9
    return m


def _both(model: onnx.ModelProto, x: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(onnxruntime's outputs, onnxtrain's)."""
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {model.graph.input[0].name: x}), compile_model(model).run(
        {model.graph.input[0].name: x})


def _same(got: list[np.ndarray], want: list[np.ndarray], post: str) -> None:
    """The same labels, and the same scores: to the bit without a transform, within float32 rounding of the
    exp with one, within onnxruntime's approximation of erfinv with PROBIT."""
    assert got[0].dtype == want[0].dtype and got[0].tolist() == want[0].tolist()
    assert got[1].dtype == want[1].dtype == np.float32 and got[1].shape == want[1].shape
    if post == "NONE":
        np.testing.assert_array_equal(got[1], want[1])
    elif post == "PROBIT":
        np.testing.assert_allclose(got[1], want[1], rtol=1e-2, atol=5e-3)
    else:
        np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=3e-7)


def _class_attrs(rng: np.random.Generator, classes: int, every: bool, n_trees: int = 4,
                 n_features: int = 5) -> dict[str, Any]:
    """A random forest whose leaves score classes (class_* for target_*)."""
    a = random_forest(rng, n_trees, 4, n_features, classes, every_target=every)
    return {k.replace("target_", "class_"): v for k, v in a.items()}


@pytest.mark.parametrize("post", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
@pytest.mark.parametrize("classes", [3, 5])
@pytest.mark.parametrize("strings", [False, True])
@pytest.mark.parametrize("base", [False, True])
@pytest.mark.parametrize("every", [True, False])
def test_matches_onnxruntime(post: str, classes: int, strings: bool, base: bool, every: bool) -> None:
    rng = np.random.default_rng([classes, strings, base, every, len(post)])
    attrs = {**_class_attrs(rng, classes, every), "post_transform": post}
    attrs["classlabels_strings" if strings else "classlabels_int64s"] = (
        [f"c{i}" for i in range(classes)] if strings else list(range(7, 7 + classes)))
    if base:
        attrs["base_values"] = list(rng.uniform(-0.5, 0.5, classes))
    model = classifier(attrs, 5, strings)
    onnx.checker.check_model(model, full_check=True)
    want, got = _both(model, features(rng, 64, 5))
    assert list(got[0]) == list(want[0])
    assert got[1].dtype == want[1].dtype and got[1].shape == want[1].shape
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)


def _binary_attrs(rng: np.random.Generator, scored: str, sign: str, n_features: int = 5) -> dict[str, Any]:
    """A random forest of two classes whose leaves score class 0, class 1, both, or some of them class 0
    alone and the others both."""
    if scored in ("class 0", "class 1"):
        a = _class_attrs(rng, 1, True, n_features=n_features)
        a["class_ids"] = [int(scored[-1])] * len(a["class_ids"])
    elif scored == "both":
        a = _class_attrs(rng, 2, True, n_features=n_features)
    else:  # two trees, half their leaves scoring class 0 alone: rows reaching no class-1 leaf are common
        a = _class_attrs(rng, 2, True, n_trees=2, n_features=n_features)
        keep = [c == 0 or rng.random() < 0.5 for c in a["class_ids"]]
        a.update({k: [v for v, kept in zip(a[k], keep) if kept] for k in a if k.startswith("class_")})
    if sign == "positive":  # sums on both sides of 0.5, where the label of such a forest turns
        a["class_weights"] = [abs(w) / 3 for w in a["class_weights"]]
    return a


def _reach_class_1(attrs: dict[str, Any], x: np.ndarray) -> np.ndarray:
    """Whether each row reaches a leaf scoring class 1: onnxruntime's regressor on the forest, each class-1
    entry weighing 1 and each class-0 entry 0."""
    a = {k: v for k, v in attrs.items() if k.startswith("nodes_")}
    a.update(target_treeids=attrs["class_treeids"], target_nodeids=attrs["class_nodeids"],
             target_ids=attrs["class_ids"], target_weights=[float(c == 1) for c in attrs["class_ids"]])
    model = regressor(a, x.shape[1], 2)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"X": x})[0][:, 1] > 0


@pytest.mark.parametrize("post", POSTS)
@pytest.mark.parametrize("base", [0, 1, 2])
@pytest.mark.parametrize("sign", ["positive", "mixed"])
@pytest.mark.parametrize("scored", ["class 0", "class 1", "both", "some"])
def test_two_classes_match_onnxruntime(scored: str, sign: str, base: int, post: str) -> None:
    """Each kind of labels on the same forest. Where onnxruntime leaves a row's second score unwritten (no
    leaf of the row scores class 1, and PROBIT, or one base value with leaves scoring both classes),
    onnxtrain refuses by name."""
    rng = np.random.default_rng(zlib.crc32(f"{scored} {sign} {base} {post}".encode()))
    attrs = {**_binary_attrs(rng, scored, sign), "post_transform": post}
    if base:
        attrs["base_values"] = [float(v) for v in np.round(rng.uniform(-0.6, 0.6, base), 2)]
    x = features(rng, 40, 5)  # (up to 50 rows onnxruntime adds the trees in order, as onnxtrain does)
    single = ~_reach_class_1(attrs, x) & (base < 2)
    one_class = scored in ("class 0", "class 1")
    unwritten = single.any() and (post == "PROBIT" or (base == 1 and not one_class))
    for labels in ([0, 1], [3, 9], ["no", "yes"]):
        strings = isinstance(labels[0], str)
        model = classifier({**attrs, "classlabels_strings" if strings else "classlabels_int64s": labels}, 5,
                           strings)
        onnx.checker.check_model(model, full_check=True)
        if labels == [3, 9] and not one_class:  # onnxruntime labels the rows 1 and 0 there
            with pytest.raises(EngineError, match=r"'trees': int64 class labels \[3, 9\] on leaves scoring "
                                                  "both classes: onnxruntime labels such rows 1 or 0"):
                compile_model(model).run({"X": x})
            continue
        if unwritten:
            with pytest.raises(EngineError, match=f"'trees': row {int(np.argmax(single))} reaches no leaf "
                                                  "scoring class 1; .*unwritten"):
                compile_model(model).run({"X": x})
            continue
        want, got = _both(model, x)
        _same(got, want, post)


def test_two_classes_where_onnxruntime_departs_from_the_spec() -> None:
    """Literal values, which onnxruntime gives too: with both classes scored the label follows the class-1
    score alone (against 0; refused with int64 labels other than [0, 1], where onnxruntime's labels are
    still 1 and 0); two base values make the scores (−t, t) with
    t = b1 + (class-0 sum); with class 0 scored alone (scikit-learn's form) the second column is made from
    the first, and the label follows the raw score against 0.5, not the larger probability."""
    x = np.array([[-1.0], [1.0]], np.float32)  # leaf A, leaf B

    def forest(a: list[tuple[int, float]], b: list[tuple[int, float]], labels: tuple[int, int] = (3, 9),
               **extra: Any) -> onnx.ModelProto:
        entries = [(1, c, w) for c, w in a] + [(2, c, w) for c, w in b]
        attrs = dict(nodes_treeids=[0, 0, 0], nodes_nodeids=[0, 1, 2], nodes_featureids=[0, 0, 0],
                     nodes_values=[0.0, 0.0, 0.0], nodes_modes=["BRANCH_LEQ", "LEAF", "LEAF"],
                     nodes_truenodeids=[1, 0, 0], nodes_falsenodeids=[2, 0, 0],
                     class_treeids=[0] * len(entries), class_nodeids=[n for n, _, _ in entries],
                     class_ids=[c for _, c, _ in entries], class_weights=[w for _, _, w in entries],
                     classlabels_int64s=list(labels), **extra)
        return classifier(attrs, 1, False)

    both = [(0, 0.25), (1, 0.75)], [(0, 0.5), (1, -0.125)]
    with pytest.raises(EngineError, match=r"int64 class labels \[3, 9\] on leaves scoring both classes"):
        compile_model(forest(*both)).run({"X": x})
    cases = [
        (forest(*both, labels=(0, 1)), [1, 0], [[0.25, 0.75], [0.5, -0.125]]),
        (forest(*both, labels=(0, 1), base_values=[0.5, 0.125]), [1, 1], [[-0.375, 0.375], [-0.625, 0.625]]),
        (forest([(0, 0.25)], [(0, 0.75)]), [3, 9], [[0.75, 0.25], [0.25, 0.75]]),
    ]
    for model, labels, scores in cases:
        want, got = _both(model, x)
        _same(got, want, "NONE")
        assert got[0].tolist() == labels
        np.testing.assert_array_equal(got[1], np.float32(scores))
    logistic = forest([(0, 0.25)], [(0, 0.75)], post_transform="LOGISTIC")
    want, got = _both(logistic, x)
    _same(got, want, "LOGISTIC")
    assert got[0].tolist() == [3, 9] and got[1][0, 1] > 0.5  # label 3 although class 9 scores 0.56


def test_two_classes_of_double_trees_and_inputs() -> None:
    """Double thresholds, weights and base values (``*_as_tensor``) on a double input, and a double input to
    float trees: the scores are made in double and written as float32."""
    rng = np.random.default_rng(21)
    for scored, base in (("class 0", 1), ("some", 2), ("class 1", 0)):
        a = _binary_attrs(rng, scored, "mixed")
        x = features(rng, 30, 5, np.float64) / 3
        plain = {**a, "classlabels_int64s": [0, 1], "post_transform": "LOGISTIC"}
        if base:
            plain["base_values"] = [0.25, -0.5][:base]
        tensors = dict(plain)
        tensors["nodes_values_as_tensor"] = numpy_helper.from_array(
            np.asarray(tensors.pop("nodes_values")) + 1e-9, "v")
        for name in ("class_weights", "base_values")[: 1 + bool(base)]:
            tensors[f"{name}_as_tensor"] = numpy_helper.from_array(np.asarray(tensors.pop(name)), name)
        for attrs in (plain, tensors):
            want, got = _both(classifier(attrs, 5, False, TensorProto.DOUBLE), x)
            _same(got, want, "LOGISTIC")


@pytest.mark.parametrize("classes", [2, 3])
def test_a_vector_input_is_one_row(classes: int) -> None:
    """onnxruntime takes a [C] input (of no declared shape) as one row when the forest reads feature 0
    only."""
    rng = np.random.default_rng(classes)
    a = {**_class_attrs(rng, classes, False, n_features=1), "classlabels_int64s": list(range(classes))}
    for v in (-0.5, 0.3, 1.5):
        x = np.array([v, 2.0, -2.0], np.float32)
        want, got = _both(classifier(a, None, False), x)
        _same(got, want, "NONE")
        assert got[1].shape == (1, classes)


def test_refusals_name_the_node() -> None:
    rng = np.random.default_rng(3)
    x = features(rng, 4, 5)
    only_0 = {**_binary_attrs(rng, "class 0", "positive"), "classlabels_int64s": [0, 1]}
    with pytest.raises(EngineError, match="'trees': row 0 reaches no leaf scoring class 1; with PROBIT"):
        compile_model(classifier({**only_0, "post_transform": "PROBIT"}, 5, False)).run({"X": x})
    one_leaf_of_class_0 = dict(  # leaf A scores class 0 only, leaf B both
        nodes_treeids=[0, 0, 0], nodes_nodeids=[0, 1, 2], nodes_featureids=[0, 0, 0],
        nodes_values=[0.0, 0.0, 0.0], nodes_modes=["BRANCH_LEQ", "LEAF", "LEAF"], nodes_truenodeids=[1, 0, 0],
        nodes_falsenodeids=[2, 0, 0], class_treeids=[0, 0, 0], class_nodeids=[1, 2, 2], class_ids=[0, 0, 1],
        class_weights=[0.5, 0.25, 0.75], classlabels_int64s=[0, 1], base_values=[0.5])
    model = classifier(one_leaf_of_class_0, 1, False)
    rows = np.array([[1.0], [-1.0]], np.float32)
    with pytest.raises(EngineError, match="'trees': row 1 reaches no leaf .* one base value and leaves"):
        compile_model(model).run({"X": rows})
    compile_model(model).run({"X": rows[:1]})  # a row reaching class 1 is fine
    three = classifier({**only_0, "base_values": [0.1, 0.2, 0.3]}, 5, False)
    with pytest.raises(EngineError, match="'trees': 3 base values for 2 classes"):
        compile_model(three).run({"X": x})
    with pytest.raises(Exception, match="base_values should have 0, 1, or 2 values"):  # so does onnxruntime
        ort.InferenceSession(three.SerializeToString(), providers=["CPUExecutionProvider"])
    one_label = classifier({**only_0, "classlabels_int64s": [5]}, 5, False)
    with pytest.raises(EngineError, match="'trees': 1 class label"):
        compile_model(one_label).run({"X": x})
    bad_base = classifier({**_class_attrs(rng, 3, True), "classlabels_int64s": [0, 1, 2],
                           "base_values": [0.5]}, 5, False)
    with pytest.raises(EngineError, match="TreeEnsembleClassifier 'trees': 1 base values for 3 classes"):
        compile_model(bad_base).run({"X": x})


def _fixtures() -> list[str]:
    return sorted(n for n in os.listdir(FIXTURES) if n.endswith(".onnx")) if os.path.isdir(FIXTURES) else []


def test_the_fixtures_are_there() -> None:
    assert len(_fixtures()) == 6, "run tools/make_sklearn_tree_fixtures.py"


@pytest.mark.parametrize("name", _fixtures())
def test_sklearn_exports_match_onnxruntime(name: str) -> None:
    """scikit-learn's binary DecisionTree, RandomForest, ExtraTrees and GradientBoosting classifiers (labels
    0/1, and "no"/"yes") as skl2onnx exports them without ZipMap, on their training rows and rows with a
    missing feature."""
    model = onnx.load(os.path.join(FIXTURES, name))
    x = np.load(os.path.join(FIXTURES, "x.npy"))
    want, got = _both(model, x)
    post = "LOGISTIC" if name.startswith("gradient_boosting") else "NONE"
    _same(got, want, post)


@pytest.mark.parametrize("classes", [2, 3])
@pytest.mark.parametrize("strings", [False, True])
def test_an_empty_batch_gives_no_labels(classes: int, strings: bool) -> None:
    """A [0, C] input gives [0] labels and [0, classes] scores, as onnxruntime does."""
    rng = np.random.default_rng([classes, strings])
    attrs = {**_class_attrs(rng, classes, True), "post_transform": "LOGISTIC"}
    attrs["classlabels_strings" if strings else "classlabels_int64s"] = (
        [f"c{i}" for i in range(classes)] if strings else list(range(classes)))
    want, got = _both(classifier(attrs, 5, strings), np.zeros((0, 5), np.float32))
    assert got[0].shape == want[0].shape == (0,) and got[0].dtype == want[0].dtype
    assert got[1].shape == want[1].shape == (0, classes) and got[1].dtype == want[1].dtype
