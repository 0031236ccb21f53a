"""``ai.onnx.ml`` TreeEnsembleClassifier (versions 1 and 3; inference only): the forest of
:mod:`onnxtrain.engine.kernels.trees` with one score column per class label.

Each row's class scores are the sums of its leaves' ``class_weights`` plus ``base_values``, returned after
``post_transform``; its label is the class of the largest score (the first of ties), among the classes its
leaves score when there are no base values, as onnxruntime gives them for three classes or more. A forest
of two class labels is refused by name: there onnxruntime departs from the spec in ways that depend on
which classes the leaves score (labels that are no class label, base values added to one column, a second
column left at 0), and no oracle says what it should be.
"""

from __future__ import annotations

import numpy as np

from onnxtrain.engine.kernels.ml import ML
from onnxtrain.engine.kernels.trees import (
    _Forest,
    _logistic,
    _predict,
    _probit,
    _regressor_forest,
    _softmax,
    _tensor_or_list,
    _text,
)
from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel


@kernel("TreeEnsembleClassifier", domain=ML)
def tree_ensemble_classifier(inputs: Inputs, attrs: Attrs) -> Outputs:
    op = f"TreeEnsembleClassifier {attrs.name!r}"
    strings = attrs.get("classlabels_strings")
    labels = [_text(v) for v in strings] if strings else list(attrs.get("classlabels_int64s") or [])
    if len(labels) < 3:
        raise ValueError(f"{op}: {len(labels)} class labels; a forest of two classes (a binary classifier) "
                         "is not supported yet (three classes or more are)")
    forest: _Forest = attrs.cached(
        "forest", lambda: _regressor_forest(attrs, "class", len(labels), "TreeEnsembleClassifier"))
    post = _text(attrs.get("post_transform") or "NONE")
    base = _tensor_or_list(attrs, "base_values", np.float32)
    if base is not None and len(base) not in (0, len(labels)):
        raise ValueError(f"{op}: {len(base)} base values for {len(labels)} classes (give none, or one each)")
    x = np.asarray(inputs[0])
    s = _predict(forest, x, "SUM", base, "NONE")
    # the label: the largest score among the classes some leaf of the row scored (all, with base values)
    ranked = s if base is not None and len(base) else np.where(_scored(forest, x), s, -np.inf)
    y = np.array([labels[int(i)] for i in np.argmax(ranked, axis=1)], dtype=object if strings else np.int64)
    return y, _transformed(s, post, op)


def _scored(forest: _Forest, x: np.ndarray) -> np.ndarray:
    """(rows, classes): whether a leaf the row reaches scores the class (rows scoring none: every class)."""
    x = x.reshape(1, -1) if x.ndim == 1 else x.reshape(len(x), -1)
    compare = np.float64 if x.dtype == np.float64 or forest.threshold.dtype == np.float64 else np.float32
    at = forest.leaves(x.astype(compare, copy=False))
    hit = forest.scores[at].any(axis=1)
    hit[~hit.any(axis=1)] = True
    return hit


def _transformed(s: np.ndarray, post: str, op: str) -> np.ndarray:
    """The class scores after ``post``, float32."""
    if post == "LOGISTIC":
        s = _logistic(s)
    elif post in ("SOFTMAX", "SOFTMAX_ZERO"):
        s = _softmax(s, post == "SOFTMAX_ZERO")
    elif post == "PROBIT":
        s = _probit(s)
    elif post != "NONE":
        raise ValueError(f"{op}: unknown post_transform {post!r}")
    return np.asarray(s, np.float32)
