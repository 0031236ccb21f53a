"""``ai.onnx.ml`` TreeEnsembleClassifier (versions 1 and 3; inference only): the forest of
:mod:`onnxtrain.engine.kernels.trees` with one score column per class label.

Three classes or more: each row's class scores are the sums of its leaves' ``class_weights`` plus
``base_values``, returned after ``post_transform``; its label is the class of the largest score (the first of
ties), among the classes its leaves score when there are no base values, as onnxruntime gives them.

Two classes (a binary classifier) follow onnxruntime 1.32 (the oracle, and what scikit-learn's converter
targets), which departs from the spec here: the spec adds each base value to its class, applies the post
transform to both scores alike and returns the top class, and onnxruntime does not, as below. Two facts of
the whole node steer it: whether all ``class_ids`` name a single class (either; scikit-learn's converter
writes class 0 with the probability of class 1) and whether no class weight is negative. Per row, with
s0, s1 the sums of its leaves' weights and b the base values (none, one, or two):

* a class no leaf of the row scores reads 0, base value or not;
* two base values: when a leaf of the row scores class 1 the scores are (−t, t) with t = b1 + s0 (the
  class-1 leaves and b0 are ignored), else (s0 + b0, 0); one base value is added to class 0 only;
* when no leaf of the row scores class 1 and there are fewer than two base values, the second column is
  made from the class-0 score c: (1 − c, c) if the leaves score a single class with no negative weight
  (LOGISTIC: (1 − σ(c), σ(c))), else (−c, c) (LOGISTIC: (σ(−c), σ(c))); SOFTMAX and SOFTMAX_ZERO are not
  applied there;
* otherwise each column gets ``post_transform`` (SOFTMAX over the two);
* the label follows one raw score p, the class-1 score (the class-0 score when no leaf scores class 1):
  with a single class scored, the second label if p > 0.5 (no negative weight) or p > 0 (some), else the
  first, even where the other column is the larger; with both classes in ``class_ids``, the second label
  if p > 0, else the first.

Refused by name: fewer than two class labels, other numbers of base values than 0, 1 or 2 (onnxruntime
refuses them too), int64 class labels other than [0, 1] on a node whose leaves score both classes
(onnxruntime's labels there are 1 and 0 whatever the class labels: no class label), and the rows for which
onnxruntime leaves the second score unwritten (whatever was in memory): no leaf scoring class 1 with
PROBIT, or with one base value when the leaves score both classes.
A [C] input is one row (onnxruntime takes one only when the forest reads feature 0 alone). PROBIT is solved
to double precision where onnxruntime approximates erfinv (they part by up to about 5e-3).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxtrain.engine.kernels.ml import ML
from onnxtrain.engine.kernels.trees import (
    _Forest,
    _logistic,
    _predict,
    _regressor_forest,
    _rows,
    _tensor_or_list,
    _text,
    _transformed,
)
from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel


@kernel("TreeEnsembleClassifier", domain=ML)
def tree_ensemble_classifier(inputs: Inputs, attrs: Attrs) -> Outputs:
    op = f"TreeEnsembleClassifier {attrs.name!r}"
    strings = attrs.get("classlabels_strings")
    labels = [_text(v) for v in strings] if strings else list(attrs.get("classlabels_int64s") or [])
    if len(labels) < 2:
        raise ValueError(f"{op}: {len(labels)} class label(s); a classifier needs two or more (onnxruntime "
                         "gives one class label the label 1 whatever it is)")
    forest: _Forest = attrs.cached(
        "forest", lambda: _regressor_forest(attrs, "class", len(labels), "TreeEnsembleClassifier"))
    post = _text(attrs.get("post_transform") or "NONE")
    base = _tensor_or_list(attrs, "base_values", np.float32)
    x = np.asarray(inputs[0])
    if len(labels) == 2:
        if base is not None and len(base) > 2:
            raise ValueError(f"{op}: {len(base)} base values for 2 classes (give none, one or two)")
        one_class, positive = attrs.cached("binary", lambda: _binary_kind(attrs))
        if not one_class and not strings and labels != [0, 1]:
            raise ValueError(f"{op}: int64 class labels {labels} on leaves scoring both classes: onnxruntime "
                             "labels such rows 1 or 0, which are no class labels (give the labels [0, 1], or "
                             "strings)")
        return _binary(forest, x, base, post, op, one_class, positive, labels, bool(strings))
    if base is not None and len(base) not in (0, len(labels)):
        raise ValueError(f"{op}: {len(base)} base values for {len(labels)} classes (give none, or one each)")
    hit = np.zeros((1 if x.ndim == 1 else len(x), len(labels)), bool)
    s = _predict(forest, x, "SUM", base, "NONE", scored=hit)
    # the label: the largest score among the classes some leaf of the row scored (all, with base values)
    if base is not None and len(base):
        ranked = s
    else:
        hit[~hit.any(axis=1)] = True
        ranked = np.where(hit, s, -np.inf)
    y = np.array([labels[int(i)] for i in np.argmax(ranked, axis=1)], dtype=object if strings else np.int64)
    return y, _transformed(s, post, op)


def _binary_kind(attrs: Attrs) -> tuple[bool, bool]:
    """onnxruntime's two facts of a two-class node: whether its ``class_ids`` name a single class, and whether
    none of its class weights is negative."""
    ids = np.asarray(attrs.get("class_ids") if attrs.get("class_ids") is not None else [], np.int64)
    weights = _tensor_or_list(attrs, "class_weights", np.float32)
    positive = weights is None or not bool((np.asarray(weights) < 0).any())
    return len(np.unique(ids)) == 1, positive


def _binary(forest: _Forest, x: np.ndarray, base: np.ndarray | None, post: str, op: str, one_class: bool,
            positive: bool, labels: list[Any], strings: bool) -> Outputs:
    """A two-class forest's labels and scores as onnxruntime gives them (see the module docstring)."""
    x2 = _rows(x)
    dt = np.float64 if x2.dtype == np.float64 or forest.threshold.dtype == np.float64 else np.float32
    hit = np.zeros((len(x2), 2), bool)
    s = _predict(forest, x2, "SUM", None, "NONE", dt, scored=hit)  # in the trees' type, base values apart
    has0, has1 = hit[:, 0], hit[:, 1]
    n_base = 0 if base is None else len(base)
    b = np.zeros(2, dt) if base is None else base.astype(dt)
    if n_base == 2:
        t = b[1] + s[:, 0]  # onnxruntime's class-1 score, when a leaf scores class 1
        c0 = np.where(has0, np.where(has1, -t, s[:, 0] + b[0]), 0)
        c1 = np.where(has1, t, 0)
    else:
        c0 = np.where(has0, s[:, 0] + b[0] if n_base else s[:, 0], 0)
        c1 = np.where(has1, s[:, 1], 0)
    single = ~has1 & (n_base < 2)  # rows whose second column onnxruntime makes from the first
    if single.any() and (post == "PROBIT" or not (one_class or n_base == 0)):
        why = "PROBIT" if post == "PROBIT" else "one base value and leaves scoring both classes"
        raise ValueError(f"{op}: row {int(np.argmax(single))} reaches no leaf scoring class 1; with {why} "
                         "onnxruntime leaves its second score unwritten (undefined)")
    p = np.where(has1, c1, c0)  # the score the label follows
    second = (p > (0.5 if positive else 0) if one_class else p > 0).astype(np.intp)
    y = np.asarray(labels, dtype=object if strings else np.int64)[second]
    z = _transformed(np.stack([c0, c1], axis=1).astype(np.float32), post, op)
    if single.any():
        c = c0[single]  # in the trees' type, as onnxruntime makes the second column
        if post == "LOGISTIC":
            right = _logistic(c)
            left = 1 - right if one_class and positive else _logistic(-c)
        else:
            right, left = c, (1 - c if one_class and positive else -c)
        z[single] = np.stack([left, right], axis=1).astype(np.float32)
    return y, z
