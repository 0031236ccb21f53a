"""Kernels of the ``ai.onnx.ml`` domain that scikit-learn's converters write for preprocessing and linear
models: Scaler, Normalizer, Imputer, LinearRegressor and LinearClassifier (inference only: none has a
gradient).

Each takes a [N, C] or [C] input of float, double, int32 or int64; Scaler, Normalizer and the linear models
give float32 values, as their schemas say, Imputer its input's type. A [C] input is one row.
"""

from __future__ import annotations

import numpy as np

from onnxtrain.engine.kernels.ml import ML
from onnxtrain.engine.kernels.trees import _logistic, _probit, _softmax
from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel


def _rows(x: np.ndarray, op: str) -> np.ndarray:
    """``x`` as [N, C] (a vector as one row)."""
    if x.ndim not in (1, 2):
        raise ValueError(f"{op}: the input must be [N, C] or [C], got shape {list(x.shape)}")
    return x.reshape(1, -1) if x.ndim == 1 else x


def _per_feature(values: list[float] | None, c: int, what: str, op: str) -> np.ndarray:
    """An attribute of one value or one per feature, as float32 values broadcasting over [N, C]."""
    v = np.asarray(values if values else [0.0], np.float32)
    if v.size not in (1, c):
        raise ValueError(f"{op}: {what} has {v.size} values; give one, or one per feature ({c})")
    return v


@kernel("Scaler", domain=ML)
def scaler(inputs: Inputs, attrs: Attrs) -> Outputs:
    """(X - offset) · scale, per feature or for all."""
    op = f"Scaler {attrs.name!r}"
    x = np.asarray(inputs[0])
    c = x.shape[-1] if x.ndim else 1
    offset = _per_feature(attrs.get("offset"), c, "offset", op)
    scale = np.asarray(attrs.get("scale") or [1.0], np.float32)
    if scale.size not in (1, c):
        raise ValueError(f"{op}: scale has {scale.size} values; give one, or one per feature ({c})")
    y = x.astype(np.float32)
    y -= offset
    y *= scale
    return (y,)


@kernel("Normalizer", domain=ML)
def normalizer(inputs: Inputs, attrs: Attrs) -> Outputs:
    """Each row divided by its max, its sum of absolute values (L1) or its Euclidean length (L2); a row
    whose divisor is 0 unchanged."""
    op = f"Normalizer {attrs.name!r}"
    x = np.asarray(inputs[0])
    rows = _rows(x, op).astype(np.float32)
    norm = _text(attrs.get("norm") or "MAX")
    if norm == "MAX":
        d = rows.max(axis=1, keepdims=True)
    elif norm == "L1":
        d = np.abs(rows).sum(axis=1, keepdims=True)
    elif norm == "L2":
        d = np.sqrt(np.square(rows).sum(axis=1, keepdims=True))
    else:
        raise ValueError(f"{op}: norm must be MAX, L1 or L2, got {norm!r}")
    d[d == 0] = 1  # a row of norm 0 (a max of 0) is left as it is, as onnxruntime leaves it
    return ((rows / d).reshape(x.shape),)


@kernel("Imputer", domain=ML)
def imputer(inputs: Inputs, attrs: Attrs) -> Outputs:
    """X with each occurrence of the replaced value (``replaced_value_float``/``_int64``, 0 by default; a NaN
    one matches NaN, as scikit-learn's SimpleImputer exports it) replaced by the feature's imputed value."""
    op = f"Imputer {attrs.name!r}"
    x = np.asarray(inputs[0])
    c = x.shape[-1] if x.ndim else 1
    if x.dtype.kind == "f":
        values, missing = attrs.get("imputed_value_floats"), attrs.get("replaced_value_float")
        missing = np.float32(0.0 if missing is None else missing)
        hit = np.isnan(x) if np.isnan(missing) else x == missing
    elif x.dtype.kind == "i":
        values, missing = attrs.get("imputed_value_int64s"), attrs.get("replaced_value_int64")
        hit = x == (0 if missing is None else missing)
    else:
        raise ValueError(f"{op}: the input must be a float or integer tensor, got {x.dtype}")
    if not values or len(values) not in (1, c):
        raise ValueError(f"{op}: give one imputed value, or one per feature ({c}), of the input's kind")
    fill = np.broadcast_to(np.asarray(values, x.dtype), x.shape)
    return (np.where(hit, fill, x),)


@kernel("LinearRegressor", domain=ML)
def linear_regressor(inputs: Inputs, attrs: Attrs) -> Outputs:
    """X · coefficientsᵀ + intercepts for ``targets`` outputs per row (PROBIT on one target if asked)."""
    op = f"LinearRegressor {attrs.name!r}"
    targets = int(attrs.get("targets") or 1)
    y = _linear(inputs, attrs, op, targets)
    post = _text(attrs.get("post_transform") or "NONE")
    if post == "PROBIT" and targets == 1:
        return (_probit(y).astype(np.float32),)
    if post != "NONE":
        raise ValueError(f"{op}: post_transform {post!r} is not supported (NONE, or PROBIT on one target)")
    return (y,)


@kernel("LinearClassifier", domain=ML)
def linear_classifier(inputs: Inputs, attrs: Attrs) -> Outputs:
    """Labels and scores of X · coefficientsᵀ + intercepts: a label per row (the class of the largest score;
    with one set of coefficients, the second label where the score is above 0), and the scores after the
    post transform. One set of coefficients with two labels scores both classes: [1 − p, p] of the
    logistic p (LOGISTIC), else [1 − s, s], as onnxruntime does."""
    op = f"LinearClassifier {attrs.name!r}"
    scores = _linear(inputs, attrs, op, None)
    k = scores.shape[1]
    strings = attrs.get("classlabels_strings")
    labels = [_text(v) for v in strings] if strings else list(attrs.get("classlabels_ints") or [])
    dtype = object if strings else np.int64
    if k == 1:
        binary = labels if len(labels) == 2 else (["0", "1"] if strings else [0, 1])
        y = np.array(binary, dtype=dtype)[(scores[:, 0] > 0).astype(np.intp)]
    else:
        if len(labels) != k:
            raise ValueError(f"{op}: {len(labels)} class labels for {k} sets of coefficients")
        y = np.array(labels, dtype=dtype)[np.argmax(scores, axis=1)]
    post = _text(attrs.get("post_transform") or "NONE")
    return y, _classifier_scores(scores, post, k == 1 and len(labels) == 2, op)


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _linear(inputs: Inputs, attrs: Attrs, op: str, sets: int | None) -> np.ndarray:
    """X · coefficientsᵀ + intercepts, [N, sets] float32 (``sets`` None: one per intercept, else as many as
    the coefficients make)."""
    rows = _rows(np.asarray(inputs[0]), op).astype(np.float32)
    c = rows.shape[1]
    coef = np.asarray(attrs.get("coefficients") or [], np.float32)
    intercepts = attrs.get("intercepts")
    if sets is None and intercepts:
        sets = len(intercepts)
        if coef.size % sets:
            raise ValueError(f"{op}: {coef.size} coefficients are not a multiple of the {sets} classes "
                             "(one intercept each)")
    if sets is None:
        if not coef.size or coef.size % c:
            raise ValueError(f"{op}: {coef.size} coefficients do not make rows of the {c} features")
        sets = coef.size // c
    elif coef.size != sets * c:
        # more coefficients than the features fed take (onnxruntime's example logreg_iris.onnx holds 12 for
        # 3 classes and declares 2 features): onnxruntime reads the first sets × features of them
        if coef.size < sets * c:
            raise ValueError(f"{op}: {coef.size} coefficients for {sets} target(s) of {c} features")
        coef = coef[:sets * c]
    k = sets
    y = rows @ coef.reshape(k, c).T
    if intercepts:
        if len(intercepts) != k:
            raise ValueError(f"{op}: {len(intercepts)} intercepts for {k} sets of coefficients")
        y += np.asarray(intercepts, np.float32)
    return y


def _classifier_scores(s: np.ndarray, post: str, second: bool, op: str) -> np.ndarray:
    """The post transform of LinearClassifier's scores; ``second``: one score column for two classes."""
    if second:  # SOFTMAX and SOFTMAX_ZERO leave the score as NONE does, as in onnxruntime
        if post == "LOGISTIC":
            s = _logistic(s)
        elif post not in ("NONE", "SOFTMAX", "SOFTMAX_ZERO"):
            raise ValueError(f"{op}: post_transform {post!r} with one set of coefficients for two classes "
                             "is not supported (onnxruntime's scores there are not defined)")
        return np.concatenate([1 - s, s], axis=1).astype(np.float32)
    if post == "LOGISTIC":
        return _logistic(s).astype(np.float32)
    if post in ("SOFTMAX", "SOFTMAX_ZERO"):
        return _softmax(s, post == "SOFTMAX_ZERO").astype(np.float32)
    if post == "PROBIT":
        return _probit(s).astype(np.float32)
    if post != "NONE":
        raise ValueError(f"{op}: unknown post_transform {post!r}")
    return s
