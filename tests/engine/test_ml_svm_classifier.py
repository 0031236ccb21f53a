"""ai.onnx.ml SVMClassifier (engine/kernels/ml_svm_classifier.py) against onnxruntime: the four kernels, two
to four classes, int64 and string labels, raw scores and Platt probabilities with pairwise coupling, the
post transforms, the form without support vectors, a [C] input and other input types; bad attributes
refused by name; scikit-learn's SVC and NuSVC as skl2onnx exports them (tests/data/sklearn_svm/, written by
tools/make_sklearn_svm_fixtures.py)."""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import AttributeProto, TensorProto, helper

from onnxtrain.engine import compile_model

RNG = np.random.default_rng(13)
X = RNG.standard_normal((40, 3)).astype(np.float32)
KERNELS = [("LINEAR", [0.1, 0.0, 1.0]), ("POLY", [0.4, 0.5, 3.0]), ("RBF", [0.6, 0.0, 0.0]),
           ("SIGMOID", [0.3, 0.1, 0.0])]
FIXTURES = os.path.join(os.path.dirname(__file__), "..", "data", "sklearn_svm")


def _model(attrs: dict[str, Any], x: np.ndarray, check: bool = True) -> onnx.ModelProto:
    """One SVMClassifier node ``svc`` of the attributes (``kernel_params`` given empty when absent:
    onnxruntime requires the attribute, though the spec does not)."""
    node = helper.make_node("SVMClassifier", ["x"], ["y", "z"], name="svc", domain="ai.onnx.ml", **attrs)
    if "kernel_params" not in attrs:
        node.attribute.append(helper.make_attribute("kernel_params", [], attr_type=AttributeProto.FLOATS))
    label = TensorProto.STRING if "classlabels_strings" in attrs else TensorProto.INT64
    g = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)],
        [helper.make_tensor_value_info("y", label, [None]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [None, None])])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("ai.onnx.ml", 1)]
    m = helper.make_model(g, opset_imports=opsets)
    if check:
        onnx.checker.check_model(m, full_check=True)
    return m


def _both(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> tuple[list[Any], list[Any]]:
    """(onnxruntime's outputs, ours)."""
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds), list(compile_model(model).run(feeds))


def _assert_like_onnxruntime(attrs: dict[str, Any], x: np.ndarray, rtol: float = 1e-5,
                             atol: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """Labels equal to onnxruntime's and scores close, dtypes and shapes included; onnxruntime's (y, z)."""
    (want_y, want_z), (got_y, got_z) = _both(_model(attrs, x), {"x": x})
    assert got_y.dtype == want_y.dtype and got_y.shape == want_y.shape
    assert got_y.tolist() == want_y.tolist()
    assert got_z.dtype == want_z.dtype == np.float32 and got_z.shape == want_z.shape
    # atol per unit of the largest score: a score near 0 among scores of 10 carries their rounding (POLY
    # degree 4 on the AMD EPYC host: 0.0457 off by 1.6e-6 where the largest is 11.8)
    scale = max(1.0, float(np.abs(want_z).max(initial=0.0)))
    np.testing.assert_allclose(got_z, want_z, rtol=rtol, atol=atol * scale)
    return want_y, want_z


def _floats(a: np.ndarray) -> list[float]:
    return [float(v) for v in np.ravel(a)]


def _svc(k: int, kind: str = "RBF", params: list[float] | None = None, proba: bool = False,
         strings: bool = False, seed: int = 0, features: int = 3, **extra: Any) -> dict[str, Any]:
    """Random support vectors (1 to 3 per class) of ``k`` classes; Platt coefficients if ``proba``."""
    r = np.random.default_rng(seed)
    per_class = [int(v) for v in r.integers(1, 4, k)]
    n, pairs = sum(per_class), k * (k - 1) // 2
    attrs: dict[str, Any] = {
        "kernel_type": kind, "kernel_params": params if params is not None else dict(KERNELS)[kind],
        "vectors_per_class": per_class, "support_vectors": _floats(r.standard_normal(n * features)),
        "coefficients": _floats(r.standard_normal((k - 1) * n)),
        "rho": _floats(0.3 * r.standard_normal(pairs))}
    attrs.update({"classlabels_strings": [f"c{i}" for i in range(k)]} if strings
                 else {"classlabels_ints": [10 + 3 * i for i in range(k)]})
    if proba:
        attrs["prob_a"] = _floats(-r.uniform(0.5, 4.0, pairs))
        attrs["prob_b"] = _floats(0.3 * r.standard_normal(pairs))
    attrs.update(extra)
    return attrs


@pytest.mark.parametrize("strings", [False, True], ids=["ints", "strings"])
@pytest.mark.parametrize("proba", [False, True], ids=["scores", "proba"])
@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize(("kind", "params"), KERNELS, ids=[k for k, _ in KERNELS])
def test_kernels_match_onnxruntime(kind: str, params: list[float], k: int, proba: bool,
                                   strings: bool) -> None:
    for seed in range(3):
        attrs = _svc(k, kind, params, proba, strings, seed=seed)
        for x in (X, X[0]):
            _, z = _assert_like_onnxruntime(attrs, x)
            # raw scores: a column per pair of classes (two for two classes); probabilities: one per class
            assert z.shape == (len(x) if x.ndim == 2 else 1, k if proba else max(2, k * (k - 1) // 2))


@pytest.mark.parametrize("proba", [False, True], ids=["scores", "proba"])
@pytest.mark.parametrize("k", [2, 3, 5])
@pytest.mark.parametrize("post", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
def test_post_transforms_match_onnxruntime(post: str, k: int, proba: bool) -> None:
    for kind, params in KERNELS:
        _assert_like_onnxruntime(_svc(k, kind, params, proba, seed=k, post_transform=post), X)


def test_two_classes_score_columns_follow_onnxruntime() -> None:
    """Raw scores of two classes: [-s, s] for the pair's decision value s, whose positive sign is a vote for
    the FIRST class (so the label is the first class where the second column is > 0)."""
    attrs = _svc(2, seed=4)
    y, z = _assert_like_onnxruntime(attrs, X)
    np.testing.assert_array_equal(z[:, 0], -z[:, 1])
    first, second = attrs["classlabels_ints"]
    np.testing.assert_array_equal(y, np.where(z[:, 1] > 0, first, second))
    assert 0 < (z[:, 1] > 0).sum() < len(X)
    for post, other in [("LOGISTIC", None), ("SOFTMAX", 1 - z[:, 1]), ("SOFTMAX_ZERO", 1 - z[:, 1])]:
        _, zt = _assert_like_onnxruntime({**attrs, "post_transform": post}, X)
        if other is None:  # [σ(−s), σ(s)]
            np.testing.assert_allclose(zt, 1 / (1 + np.exp(-np.stack([-z[:, 1], z[:, 1]], 1))), rtol=1e-6)
        else:  # [1 − s, s], untransformed
            np.testing.assert_allclose(zt, np.stack([other, z[:, 1]], 1), rtol=1e-6)


def test_tied_votes_go_to_the_first_class() -> None:
    attrs = _svc(3, "LINEAR", seed=1)
    y, z = _assert_like_onnxruntime(attrs, X)
    ahead = (z > 0).astype(int)  # a win of the pair's first class, pairs (0, 1), (0, 2), (1, 2)
    votes = np.stack([ahead[:, 0] + ahead[:, 1], 1 - ahead[:, 0] + ahead[:, 2],
                      2 - ahead[:, 1] - ahead[:, 2]], 1)
    tied = (votes == 1).all(axis=1)
    assert tied.any() and not tied.all()
    assert (y[tied] == attrs["classlabels_ints"][0]).all()


def test_probabilities_of_two_classes_are_onnxruntimes_coupling() -> None:
    """With two classes onnxruntime still runs the coupling iteration, which stops short of LIBSVM's exact
    [r, 1 − r] (r the pair's Platt probability): ours does too, and matches it closely."""
    attrs = _svc(2, proba=True, seed=5)
    _, z = _assert_like_onnxruntime(attrs, X, rtol=1e-6, atol=1e-7)
    plain = {k: v for k, v in attrs.items() if not k.startswith("prob_")}
    raw = compile_model(_model(plain, X)).run({"x": X})[1]
    s = raw[:, 1].astype(np.float64)  # the pair's decision value
    r = 1 - 1 / (1 + np.exp(-(s * attrs["prob_a"][0] + attrs["prob_b"][0])))
    assert np.abs(z[:, 0] - r).max() > 1e-4


@pytest.mark.parametrize("k", [2, 3])
def test_probit_is_the_normal_quantile(k: int) -> None:
    """PROBIT is the exact normal quantile of the scores, as in the other ml kernels (onnxruntime approximates
    erfinv: a few 1e-3 off); labels and NaN places (scores outside (0, 1)) are onnxruntime's. On the raw
    scores of two classes it is refused (see the bad attributes)."""
    torch = pytest.importorskip("torch")
    coef = 0.2 * np.random.default_rng(k).standard_normal(3 * k)
    linear = {"classlabels_ints": list(range(k)), "coefficients": _floats(coef), "rho": [0.5]}
    for attrs in [_svc(k, proba=True, seed=6), linear] + ([_svc(k, seed=6)] if k > 2 else []):
        model = _model({**attrs, "post_transform": "PROBIT"}, X)
        (want_y, want_z), (got_y, got_z) = _both(model, {"x": X})
        (_, plain) = compile_model(_model(attrs, X)).run({"x": X})
        assert got_y.tolist() == want_y.tolist() and got_z.dtype == np.float32
        np.testing.assert_array_equal(np.isnan(got_z), np.isnan(want_z))
        np.testing.assert_allclose(got_z, want_z, atol=2e-2)
        quantile = torch.special.ndtri(torch.tensor(plain.astype(np.float64))).numpy()
        np.testing.assert_allclose(got_z, quantile, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("strings", [False, True], ids=["ints", "strings"])
@pytest.mark.parametrize("signs", ["mixed", "positive"])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_the_linear_form_without_support_vectors_matches_onnxruntime(k: int, signs: str,
                                                                     strings: bool) -> None:
    r = np.random.default_rng(k)
    coef = r.standard_normal((k, 3))
    if signs == "positive":
        coef = np.abs(coef) * np.linspace(1.0, 0.2, k)[:, None]  # the first class scores highest most often
    labels: dict[str, list[Any]] = ({"classlabels_strings": [f"c{i}" for i in range(k)]} if strings
                                    else {"classlabels_ints": list(range(k))})
    attrs = {**labels, "coefficients": _floats(coef), "rho": [0.2]}
    for post in ("NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"):
        for x in (X, X[0]):
            y, z = _assert_like_onnxruntime({**attrs, "post_transform": post}, x)
            assert z.shape == (len(x) if x.ndim == 2 else 1, k)
    if k == 2:  # onnxruntime's binary rule: the second class on a score > 0 (≥ 0.5 if no weight is < 0)
        y, z = _assert_like_onnxruntime(attrs, X)
        label = labels.get("classlabels_strings") or labels["classlabels_ints"]
        assert (y != np.array(label, dtype=y.dtype)[np.argmax(z, axis=1)]).any()


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.int64])
def test_other_input_types_are_computed_in_float32(dtype: type) -> None:
    x = (X * 3).astype(dtype)
    _assert_like_onnxruntime(_svc(3, proba=True, seed=7), x)
    _assert_like_onnxruntime(_svc(2, "POLY", seed=7), x)


def test_an_empty_batch() -> None:
    for proba in (False, True):
        y, z = _assert_like_onnxruntime(_svc(3, proba=proba, seed=8), X[:0])
        assert y.shape == (0,) and z.shape == (0, 3)


_GOOD = _svc(3, seed=9)
_N = sum(_GOOD["vectors_per_class"])
_LINEAR = {"classlabels_ints": [0, 1], "coefficients": [1.0] * 6, "rho": [0.0]}


@pytest.mark.parametrize(("attrs", "message"), [
    ({**_GOOD, "classlabels_strings": ["a", "b", "c"]}, "give classlabels_strings or classlabels_ints, one"),
    ({**_GOOD, "classlabels_ints": [4]}, "1 class label; a classifier needs two or more"),
    ({**_GOOD, "kernel_type": "CUBIC"}, "kernel_type must be LINEAR, POLY, RBF or SIGMOID, got 'CUBIC'"),
    ({**_GOOD, "kernel_params": [0.5]}, "kernel_params holds 1 values"),
    ({**_GOOD, "post_transform": "SQUASH"}, "post_transform must be one of"),
    ({**_GOOD, "prob_a": [1.0, 1.0, 1.0], "prob_b": [1.0]}, "prob_a has 3 values and prob_b 1"),
    ({**_GOOD, "prob_a": [1.0], "prob_b": [1.0]}, "3 classes make 3 pairs; give prob_a and prob_b for each"),
    ({**_GOOD, "vectors_per_class": [1, 1]}, "vectors_per_class has 2 counts for 3 class labels"),
    ({**_GOOD, "vectors_per_class": [3, -1, 2]}, "vectors_per_class holds a negative count"),
    ({**_GOOD, "support_vectors": [1.0] * 7}, f"7 support_vectors values do not make {_N} support vectors"),
    ({**_GOOD, "coefficients": [1.0]}, f"{_N} support vectors and 3 classes need {2 * _N} coefficients"),
    ({**_GOOD, "rho": [0.0]}, "3 classes make 3 pairs, each with a rho; got 1"),
    ({**_svc(2, seed=9), "post_transform": "PROBIT"}, "post_transform 'PROBIT' on the raw scores of two"),
    ({**_GOOD, "support_vectors": [1.0] * (4 * _N)}, "the input has 3 features, the model 4"),
    ({**_LINEAR, "prob_a": [1.0], "prob_b": [0.0]}, "prob_a/prob_b without support vectors are not"),
    ({**_LINEAR, "rho": [0.0, 1.0]}, "without support vectors rho is one value"),
    ({**_LINEAR, "coefficients": [1.0] * 5}, "without support vectors the coefficients are one set per"),
    ({**_LINEAR, "coefficients": [1.0] * 8}, "the input has 3 features, the model 4"),
    ({**_LINEAR, "support_vectors": [1.0] * 3}, "3 support_vectors values but no vectors_per_class"),
])
def test_bad_attributes_are_refused_naming_the_node(attrs: dict[str, Any], message: str) -> None:
    with pytest.raises(Exception) as caught:
        compile_model(_model(attrs, X, check=False)).run({"x": X})
    cause = caught.value if isinstance(caught.value, ValueError) else caught.value.__cause__
    assert isinstance(cause, ValueError), caught.value
    assert re.match(re.escape(f"SVMClassifier 'svc': {message}"), str(cause)), str(cause)


def _fixtures() -> list[str]:
    return sorted(f for f in os.listdir(FIXTURES) if f.endswith(".onnx")) if os.path.isdir(FIXTURES) else []


def test_the_sklearn_fixtures_are_there() -> None:
    assert len(_fixtures()) == 20, "run tools/make_sklearn_svm_fixtures.py"


@pytest.mark.parametrize("name", _fixtures())
def test_sklearn_exports_match_onnxruntime(name: str) -> None:
    """scikit-learn's SVC (each kernel) and NuSVC of 2 and 3 classes, with and without probability=True, as
    skl2onnx exports them (no ZipMap): the SVMClassifier node and the ops around it."""
    model = onnx.load(os.path.join(FIXTURES, name))
    assert any(n.op_type == "SVMClassifier" for n in model.graph.node)
    x = np.load(os.path.join(FIXTURES, f"x_{name.rsplit('_', 1)[1].split('.')[0]}.npy"))
    (want_y, want_z), (got_y, got_z) = _both(model, {model.graph.input[0].name: x})
    assert got_y.dtype == want_y.dtype and got_y.tolist() == want_y.tolist()
    assert got_z.dtype == want_z.dtype and got_z.shape == want_z.shape
    np.testing.assert_allclose(got_z, want_z, rtol=1e-5, atol=1e-6)
