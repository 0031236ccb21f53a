"""scikit-learn classifiers as skl2onnx exports them by default (probabilities through ZipMap), run through
``onnxtrain.InferenceSession``: labels equal scikit-learn's own ``predict`` and onnxruntime's, probabilities
scikit-learn's ``predict_proba`` (1e-5) and onnxruntime's dicts (same keys and order, 1e-6). The models are
fixtures written by ``tools/make_sklearn_pipeline_fixtures.py`` (scikit-learn and skl2onnx are not needed
here): a scaled logistic regression, a binary one with string labels, an MLP, a Gaussian naive Bayes, and a
column transformer one-hot encoding string columns beside scaled numeric ones."""

from __future__ import annotations

import os

import numpy as np
import pytest

import onnxtrain

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "sklearn_pipelines")
NAMES = sorted(f[:-5] for f in os.listdir(HERE) if f.endswith(".onnx"))


def _inputs(saved: np.lib.npyio.NpzFile) -> dict[str, np.ndarray]:
    """The fixture's feeds: strings as object arrays of str, as onnxruntime takes them."""
    return {k[3:]: (v.astype(object) if v.dtype.kind == "U" else v) for k, v in saved.items()
            if k.startswith("in_")}


def test_every_fixture_is_here() -> None:
    assert NAMES == ["gaussian_nb_3c", "logreg_strings_2c", "mlp_3c", "onehot_logreg_3c", "scaled_logreg_3c"]


@pytest.mark.parametrize("name", NAMES)
def test_matches_scikit_learn_and_onnxruntime(name: str) -> None:
    ort = pytest.importorskip("onnxruntime")
    with open(os.path.join(HERE, f"{name}.onnx"), "rb") as f:
        model = f.read()
    saved = np.load(os.path.join(HERE, f"{name}.npz"))
    feeds = _inputs(saved)
    label, proba = onnxtrain.InferenceSession(model).run(None, feeds)
    want_label, want_proba = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    classes = saved["classes"].tolist()
    assert label.tolist() == saved["label"].tolist() == want_label.tolist()
    assert isinstance(proba, list) and len(proba) == len(label)
    for got, want in zip(proba, want_proba):
        assert list(got) == list(want) == sorted(classes)
        np.testing.assert_allclose([got[k] for k in got], [want[k] for k in want], rtol=1e-6, atol=1e-7)
    by_class = np.array([[row[c] for c in classes] for row in proba])
    np.testing.assert_allclose(by_class, saved["proba"], rtol=1e-5, atol=1e-6)
