"""``ai.onnx.ml`` SVMClassifier (scikit-learn's SVC and NuSVC as skl2onnx exports them; inference only).

With support vectors (``vectors_per_class``) it is LIBSVM's one-against-one classifier: for each pair of
classes i < j, in the order (0, 1), (0, 2), ..., (1, 2), ..., the decision value is Σ coefficient · K(X, v)
over the support vectors v of the two classes, plus that pair's ``rho``; the coefficients are LIBSVM's
(classes − 1) × vectors layout (a vector of class i uses row j − 1 for the pair (i, j), one of class j row
i), and K is one of the kernels of :mod:`onnxtrain.engine.kernels.ml_svm`. A positive value is a vote for
i, any other for j; the label is the class with the most votes (the first of ties). What the spec leaves
open follows onnxruntime, the oracle of the tests:

- without ``prob_a``/``prob_b``, the scores are the pairwise decision values (one column per pair, which
  for four classes or more is more columns than classes); with two classes, the one value s becomes
  [−s, s] (NONE), [σ(−s), σ(s)] (LOGISTIC) or [1 − s, s] (SOFTMAX, SOFTMAX_ZERO); so there the label is
  the first class when the second column is positive. PROBIT, for which onnxruntime leaves the second
  column unwritten, is refused;
- with ``prob_a``/``prob_b``, each pair's probability is Platt's 1 − σ(a·s + b) kept within [1e-7,
  1 − 1e-7], and the class probabilities come from them by pairwise coupling (Wu, Lin and Weng's second
  method), run in float32 with onnxruntime's stopping rule (at most 100 sweeps, stopping once every
  class is within 0.005 / classes of the balance) so that the probabilities match it, for two classes too
  (where the exact answer is the pair's probability itself, which the early stop misses by up to 5e-3).
  The label is still the vote winner;
- the post transform then applies to all the score columns (PROBIT as the exact normal quantile, as
  elsewhere in onnxtrain; onnxruntime approximates erfinv).

Without support vectors it is LIBLINEAR's form, as in onnxruntime: scores X · coefficientsᵀ + rho[0], one
set of coefficients per class (``kernel_type`` is ignored), the label that of the largest score, except
that with two classes it is the second one when the largest score is > 0 and some coefficient is
negative, or ≥ 0.5 and none is (onnxruntime's rule). ``prob_a``/``prob_b`` are refused there: onnxruntime
ignores them and returns raw scores where the spec promises probabilities.

A [C] input is one row; float, double, int32 and int64 inputs are computed in float32, as onnxruntime
does; kernel values are float32 and each pair's sum is taken in float64, as there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnxtrain.engine.kernels.ml import ML
from onnxtrain.engine.kernels.ml_linear import _rows, _text
from onnxtrain.engine.kernels.ml_svm import _kernel_matrix
from onnxtrain.engine.kernels.trees import _logistic, _transformed
from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel

_KERNELS = ("LINEAR", "POLY", "RBF", "SIGMOID")
_TRANSFORMS = ("NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO", "PROBIT")
_COUPLING_SWEEPS = 100  # onnxruntime's (and LIBSVM's) bound on the coupling's iterations


@dataclass(frozen=True)
class _Svm:
    """A node's attributes, checked and laid out for computing (made once per node)."""

    labels: np.ndarray  # int64, or object (str)
    post: str
    kind: str
    params: list[float]
    rho: np.ndarray  # float64 (one per pair) with support vectors, float32 (one value) without
    vectors: np.ndarray | None  # [V, C] float32 support vectors; None: the linear form
    weights: np.ndarray  # [pairs, V] float64 with support vectors; [classes, C] float32 without
    first: np.ndarray  # each pair's classes i < j
    second: np.ndarray
    prob_a: np.ndarray | None  # float32, one per pair
    prob_b: np.ndarray | None
    all_positive: bool  # no coefficient < 0 (onnxruntime's binary rule of the linear form)

    @property
    def features(self) -> int:
        return (self.vectors if self.vectors is not None else self.weights).shape[1]


def _floats(attrs: Attrs, name: str) -> np.ndarray:
    return np.asarray(attrs.get(name) or [], np.float32).reshape(-1)


def _read(attrs: Attrs, op: str) -> _Svm:
    strings, ints = attrs.get("classlabels_strings"), attrs.get("classlabels_ints")
    if bool(strings) == bool(ints):
        raise ValueError(f"{op}: give classlabels_strings or classlabels_ints, one and not both")
    labels = np.array([_text(s) for s in strings], dtype=object) if strings else np.asarray(ints, np.int64)
    k = len(labels)
    if k < 2:
        raise ValueError(f"{op}: {k} class label; a classifier needs two or more")
    post = _text(attrs.get("post_transform") or "NONE")
    if post not in _TRANSFORMS:
        raise ValueError(f"{op}: post_transform must be one of {', '.join(_TRANSFORMS)}, got {post!r}")
    kind = _text(attrs.get("kernel_type") or "LINEAR")
    if kind not in _KERNELS:
        raise ValueError(f"{op}: kernel_type must be LINEAR, POLY, RBF or SIGMOID, got {kind!r}")
    params = [float(v) for v in attrs.get("kernel_params") or []]
    if len(params) not in (0, 3):
        raise ValueError(f"{op}: kernel_params holds {len(params)} values; give none or three (gamma, coef0, "
                         "degree)")
    coef, rho, sv = _floats(attrs, "coefficients"), _floats(attrs, "rho"), _floats(attrs, "support_vectors")
    prob_a, prob_b = _floats(attrs, "prob_a"), _floats(attrs, "prob_b")
    if prob_a.size != prob_b.size:
        raise ValueError(f"{op}: prob_a has {prob_a.size} values and prob_b {prob_b.size}; give as many")
    per_class = np.asarray(attrs.get("vectors_per_class") or [], np.int64)
    if (per_class < 0).any():
        raise ValueError(f"{op}: vectors_per_class holds a negative count")
    first, second = np.triu_indices(k, 1)  # the pairs (0, 1), (0, 2), ..., (1, 2), ...: LIBSVM's order
    pairs, n = len(first), int(per_class.sum())
    all_positive = bool((coef >= 0).all())
    if n == 0:  # LIBLINEAR's form
        if sv.size:
            raise ValueError(f"{op}: {sv.size} support_vectors values but no vectors_per_class to share them")
        if prob_a.size:
            raise ValueError(f"{op}: prob_a/prob_b without support vectors are not supported (onnxruntime "
                             "ignores them there, giving raw scores where the spec says probabilities)")
        if not coef.size or coef.size % k:
            raise ValueError(f"{op}: without support vectors the coefficients are one set per class; "
                             f"{coef.size} values do not make {k} sets")
        if rho.size != 1:
            raise ValueError(f"{op}: without support vectors rho is one value (added to every class), got "
                             f"{rho.size}")
        return _Svm(labels, post, "LINEAR", params, rho, None, coef.reshape(k, -1), first, second, None,
                    None, all_positive)
    if per_class.size != k:
        raise ValueError(f"{op}: vectors_per_class has {per_class.size} counts for {k} class labels")
    if sv.size % n or not sv.size:
        raise ValueError(f"{op}: {sv.size} support_vectors values do not make {n} support vectors")
    if coef.size != (k - 1) * n:
        raise ValueError(f"{op}: {n} support vectors and {k} classes need {(k - 1) * n} coefficients "
                         f"(classes - 1 rows), got {coef.size}")
    if rho.size != pairs:
        raise ValueError(f"{op}: {k} classes make {pairs} pairs, each with a rho; got {rho.size}")
    if prob_a.size not in (0, pairs):
        raise ValueError(f"{op}: {k} classes make {pairs} pairs; give prob_a and prob_b for each, or none "
                         f"(got {prob_a.size})")
    if k == 2 and not prob_a.size and post == "PROBIT":
        raise ValueError(f"{op}: post_transform 'PROBIT' on the raw scores of two classes is not supported "
                         "(onnxruntime transforms one column and leaves the other unwritten)")
    # each pair's weights over all the support vectors: row j − 1 of the coefficients for class i's vectors,
    # row i for class j's, 0 for the other classes'
    owner = np.repeat(np.arange(k), per_class)
    row = np.where(owner == first[:, None], second[:, None] - 1,
                   np.where(owner == second[:, None], first[:, None], -1))
    table = coef.reshape(k - 1, n).astype(np.float64)
    weights = np.where(row >= 0, table[np.maximum(row, 0), np.arange(n)], 0.0)
    return _Svm(labels, post, kind, params, rho.astype(np.float64), sv.reshape(n, -1), weights, first,
                second, prob_a if prob_a.size else None, prob_b if prob_b.size else None, all_positive)


@kernel("SVMClassifier", domain=ML)
def svm_classifier(inputs: Inputs, attrs: Attrs) -> Outputs:
    op = f"SVMClassifier {attrs.name!r}"
    svm: _Svm = attrs.cached("svm", lambda: _read(attrs, op))
    x = _rows(np.asarray(inputs[0]), op)
    if x.dtype.kind not in "fi":
        raise ValueError(f"{op}: the input must be a float or integer tensor, got {x.dtype}")
    x = x.astype(np.float32, copy=False)
    if x.shape[1] != svm.features:
        raise ValueError(f"{op}: the input has {x.shape[1]} features, the model {svm.features}")
    if svm.vectors is None:
        return _linear_form(x, svm, op)
    k = len(svm.labels)
    decision = _kernel_matrix(x, svm.vectors, svm.kind, svm.params, op).astype(np.float64) @ svm.weights.T
    decision += svm.rho
    ahead = decision > 0  # a vote for the pair's first class, else (NaN too) for its second
    hot = np.eye(k)
    votes = ahead @ hot[svm.first] + ~ahead @ hot[svm.second]
    y = svm.labels[np.argmax(votes, axis=1)]
    s = decision.astype(np.float32)
    if svm.prob_a is not None:
        pair = 1 - _logistic(s * svm.prob_a + svm.prob_b)
        pair = np.clip(pair, np.float32(1e-7), np.float32(1) - np.float32(1e-7))
        return y, _transformed(_coupled(pair, svm.first, svm.second, k), svm.post, op)
    if k == 2:
        if svm.post == "LOGISTIC":
            return y, np.concatenate([_logistic(-s), _logistic(s)], axis=1).astype(np.float32)
        other = -s if svm.post == "NONE" else 1 - s  # SOFTMAX, SOFTMAX_ZERO: as onnxruntime does
        return y, np.concatenate([other, s], axis=1)
    return y, _transformed(s, svm.post, op)


def _linear_form(x: np.ndarray, svm: _Svm, op: str) -> Outputs:
    """Labels and scores without support vectors (see the module docstring)."""
    s = x @ svm.weights.T + svm.rho[0]
    top = np.argmax(s, axis=1)
    if len(svm.labels) == 2:
        best = s.max(axis=1)
        second = best >= 0.5 if svm.all_positive else best > 0
        top = np.where(second, 1, top)
    return svm.labels[top], _transformed(s, svm.post, op)


def _coupled(pair: np.ndarray, first: np.ndarray, second: np.ndarray, k: int) -> np.ndarray:
    """Class probabilities [N, k] from each row's pairwise ones ``pair`` [N, pairs] (the probability of the
    pair's first class against its second), by minimising Σ_{i≠j} (r_ji·p_i − r_ij·p_j)² over the simplex
    (Wu, Lin and Weng 2004, method 2), in float32 with onnxruntime's order of operations and stopping rule.
    Rows run together, each until it has converged (then it leaves the batch) or the sweeps run out."""
    n = len(pair)
    r = np.zeros((n, k, k), np.float32)
    r[:, first, second] = pair
    r[:, second, first] = 1 - pair
    q = np.zeros((n, k, k), np.float32)
    for i in range(k):
        for j in range(k):  # the diagonal term accumulates in the order onnxruntime adds it
            if j != i:
                q[:, i, i] += r[:, j, i] * r[:, j, i]
        for j in range(i + 1, k):
            q[:, i, j] = q[:, j, i] = -r[:, j, i] * r[:, i, j]
    out = np.full((n, k), np.float32(1) / np.float32(k), np.float32)
    eps = np.float32(0.005) / np.float32(k)
    rows, p = np.arange(n), out.copy()  # the rows still running, and their probabilities
    for _ in range(_COUPLING_SWEEPS):
        qp = np.zeros((len(rows), k), np.float32)
        pqp = np.zeros(len(rows), np.float32)
        for i in range(k):
            for j in range(k):
                qp[:, i] += q[:, i, j] * p[:, j]
            pqp += p[:, i] * qp[:, i]
        worst = np.zeros(len(rows), np.float32)
        for i in range(k):
            error = np.abs(qp[:, i] - pqp)
            worst = np.where(error > worst, error, worst)  # a NaN error is passed over, as there
        done = worst < eps
        if done.any():
            out[rows[done]] = p[done]
            keep = ~done
            rows, p, q, qp, pqp = rows[keep], p[keep], q[keep], qp[keep], pqp[keep]
            if not len(rows):
                return out
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            for i in range(k):
                qii = q[:, i, i]
                diff = (pqp - qp[:, i]) / qii
                p[:, i] += diff
                grow = 1 + diff
                pqp = (pqp + diff * (diff * qii + 2 * qp[:, i])) / grow / grow
                qp = (qp + diff[:, None] * q[:, i, :]) / grow[:, None]
                p /= grow[:, None]
    out[rows] = p
    return out
