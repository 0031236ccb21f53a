"""``ai.onnx.ml`` TreeEnsembleRegressor (versions 1 and 3): every sample walks every tree at once.

The nodes are compiled once per node (cached on it) into flat arrays: feature, threshold, comparison,
child indices and whether a missing value (NaN) takes the true branch; the leaves' weights into a dense
(leaf, target) matrix. A walk is one vectorised step per tree level over a (samples, trees) array of node
indices. What the spec leaves open follows onnxruntime, the oracle of the tests: features compare in the
thresholds' type (float32 unless ``nodes_values_as_tensor`` is double; a double input compares in double),
scores add up tree after tree in float32 (in double for a double input or double thresholds), AVERAGE
divides by the number of trees, MIN and MAX take only the leaves that score a target (none: 0), and the
post transforms are onnxruntime's formulas. Where the spec says otherwise than onnxruntime does, the spec
is followed: base values are added to every target (onnxruntime leaves a target no leaf scored at 0) and a
single target gets its post transform too (onnxruntime applies only PROBIT there).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel

_MODES = {"BRANCH_LEQ": 0, "BRANCH_LT": 1, "BRANCH_GTE": 2, "BRANCH_GT": 3, "BRANCH_EQ": 4, "BRANCH_NEQ": 5,
          "LEAF": 6}
_LEAF = 6


def _text(v: Any) -> str:
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def _tensor_or_list(attrs: Attrs, name: str, dtype: Any) -> np.ndarray | None:
    """The attribute ``name`` (a list) or ``name_as_tensor`` (a tensor, its own type), or None."""
    t = attrs.get(f"{name}_as_tensor")
    if t is not None:
        return np.asarray(t).reshape(-1)
    v = attrs.get(name)
    return None if v is None else np.asarray(v, dtype=dtype)


class _Forest:
    """A tree ensemble's nodes as flat arrays (see the module docstring)."""

    def __init__(self, attrs: Attrs):
        name = attrs.name
        tree_ids = np.asarray(attrs["nodes_treeids"], np.int64)
        node_ids = np.asarray(attrs["nodes_nodeids"], np.int64)
        n = len(tree_ids)
        modes = [_MODES.get(_text(m)) for m in attrs["nodes_modes"]]
        if None in modes:
            bad = _text(attrs["nodes_modes"][modes.index(None)])
            raise ValueError(f"TreeEnsembleRegressor {name!r}: unknown node mode {bad!r}")
        values = _tensor_or_list(attrs, "nodes_values", np.float32)
        lists = [node_ids, np.asarray(attrs["nodes_featureids"]), np.asarray(attrs["nodes_truenodeids"]),
                 np.asarray(attrs["nodes_falsenodeids"]), modes, values]
        if any(v is None or len(v) != n for v in lists):
            raise ValueError(f"TreeEnsembleRegressor {name!r}: the nodes_* attributes differ in length")
        index = {(int(t), int(i)): k for k, (t, i) in enumerate(zip(tree_ids, node_ids))}
        if len(index) != n:
            raise ValueError(f"TreeEnsembleRegressor {name!r}: a (tree, node) id pair is repeated")
        self.mode = np.asarray(modes, np.int8)
        self.feature = np.asarray(attrs["nodes_featureids"], np.int64)
        self.threshold = values.astype(np.float64 if values.dtype == np.float64 else np.float32)
        missing = attrs.get("nodes_missing_value_tracks_true")
        self.missing_true = (np.zeros(n, bool) if missing is None or len(missing) == 0
                             else np.asarray(missing, np.int64) != 0)

        def child(k: int, ids: Any) -> int:
            if self.mode[k] == _LEAF:
                return k
            key = (int(tree_ids[k]), int(ids[k]))
            if key not in index:
                raise ValueError(f"TreeEnsembleRegressor {name!r}: node {key} (a child of node "
                                 f"{(int(tree_ids[k]), int(node_ids[k]))}) does not exist")
            return index[key]

        true_ids, false_ids = attrs["nodes_truenodeids"], attrs["nodes_falsenodeids"]
        self.true = np.asarray([child(k, true_ids) for k in range(n)], np.int64)
        self.false = np.asarray([child(k, false_ids) for k in range(n)], np.int64)
        children = set(self.true[self.mode != _LEAF].tolist()) | set(self.false[self.mode != _LEAF].tolist())
        self.roots = np.asarray([k for k in range(n) if k not in children], np.int64)
        self.n_trees = len(set(tree_ids.tolist()))
        if len(self.roots) != self.n_trees:
            raise ValueError(f"TreeEnsembleRegressor {name!r}: {len(self.roots)} roots for "
                             f"{self.n_trees} trees")
        self.n_targets = int(attrs.get("n_targets") or 1)
        weights = _tensor_or_list(attrs, "target_weights", np.float32)
        # scores add up in the thresholds' type (float64 for double trees), as onnxruntime adds them
        self.weights = np.zeros((n, self.n_targets), self.threshold.dtype)
        self.scores = np.zeros((n, self.n_targets), bool)  # which (leaf, target) a leaf scores
        for t, i, target, w in zip(attrs["target_treeids"], attrs["target_nodeids"], attrs["target_ids"],
                                   weights if weights is not None else ()):
            k = index.get((int(t), int(i)))
            if k is None or not 0 <= int(target) < self.n_targets:
                raise ValueError(f"TreeEnsembleRegressor {name!r}: target entry of node {(int(t), int(i))} "
                                 f"and target {int(target)} names no leaf or target")
            self.weights[k, int(target)] += self.threshold.dtype.type(w)
            self.scores[k, int(target)] = True
        self.depth = self._depth()

    def _depth(self) -> int:
        """The longest root-to-leaf path (a bound for the walk's steps; a cycle is an error)."""
        depth = np.zeros(len(self.mode), np.int64)
        frontier, level = self.roots, 0
        while len(frontier):
            level += 1
            if level > len(self.mode) + 1:
                raise ValueError("TreeEnsembleRegressor: the nodes form a cycle")
            inner = frontier[self.mode[frontier] != _LEAF]
            depth[frontier] = level
            frontier = np.unique(np.concatenate([self.true[inner], self.false[inner]]))
        return level

    def leaves(self, x: np.ndarray) -> np.ndarray:
        """The leaf each sample (row of ``x``) reaches in each tree: (samples, trees)."""
        rows = np.arange(len(x))[:, None]
        at = np.broadcast_to(self.roots, (len(x), len(self.roots))).copy()
        for _ in range(self.depth):
            inner = self.mode[at] != _LEAF
            if not inner.any():
                break
            v = x[rows, self.feature[at]]
            t = self.threshold[at]
            m = self.mode[at]
            go = np.select([m == 0, m == 1, m == 2, m == 3, m == 4], [v <= t, v < t, v >= t, v > t, v == t],
                           v != t)
            go |= np.isnan(v) & self.missing_true[at]
            at = np.where(inner, np.where(go, self.true[at], self.false[at]), at)
        return at


def _logistic(s: np.ndarray) -> np.ndarray:
    v = 1 / (1 + np.exp(-np.abs(s)))
    return np.where(s < 0, 1 - v, v)


def _softmax(s: np.ndarray, skip_zeros: bool) -> np.ndarray:
    """onnxruntime's SOFTMAX, or SOFTMAX_ZERO: scores within 1e-7 of 0 stay (nearly) 0 and count for none."""
    m = s.max(axis=1, keepdims=True)
    e = np.exp(s - m)
    if skip_zeros:
        zero = np.abs(s) <= np.float32(1e-7)
        e = np.where(zero, s * np.exp(-m), e)
        total = np.where(zero, 0, e).sum(axis=1, keepdims=True)
    else:
        total = e.sum(axis=1, keepdims=True)
    return e / total


def _probit(s: np.ndarray) -> np.ndarray:
    """sqrt(2)·erfinv(2s − 1), by Newton steps on math.erf (onnxruntime uses an approximation of erfinv)."""
    def one(p: float) -> float:
        y = 2 * p - 1
        if not -1 < y < 1:
            return math.copysign(math.inf, y) if abs(y) == 1 else math.nan
        w = -math.log((1 - y) * (1 + y))
        x = math.copysign(math.sqrt(max(w, 0.0)), y) * 0.8862269254527580  # a start near the root
        for _ in range(60):
            step = (math.erf(x) - y) / (2 / math.sqrt(math.pi) * math.exp(-x * x))
            x -= step
            if abs(step) < 1e-15:
                break
        return math.sqrt(2) * x
    return np.vectorize(one, otypes=[np.float64])(s.astype(np.float64))


@kernel("TreeEnsembleRegressor", domain="ai.onnx.ml")
def tree_ensemble_regressor(inputs: Inputs, attrs: Attrs) -> Outputs:
    forest: _Forest = attrs.cached("forest", lambda: _Forest(attrs))
    x = np.asarray(inputs[0])
    if x.ndim == 1:
        x = x.reshape(1, -1)
    x = x.reshape(len(x), -1)
    compare = np.float64 if x.dtype == np.float64 or forest.threshold.dtype == np.float64 else np.float32
    x = x.astype(compare, copy=False)
    if len(forest.feature) and x.shape[1] <= int(forest.feature[forest.mode != _LEAF].max(initial=-1)):
        raise ValueError(f"TreeEnsembleRegressor {attrs.name!r}: a node reads feature "
                         f"{int(forest.feature.max())}, the input has {x.shape[1]}")
    at = forest.leaves(x)
    w, hit = forest.weights[at].astype(compare, copy=False), forest.scores[at]  # (samples, trees, targets)
    how = _text(attrs.get("aggregate_function") or "SUM")
    dt = w.dtype.type  # a double input or double trees add in double, as onnxruntime does
    if how in ("SUM", "AVERAGE"):  # tree after tree, as onnxruntime adds them (the same bits)
        s = np.zeros((len(x), forest.n_targets), dt)
        for t in range(w.shape[1]):
            s += w[:, t]
        if how == "AVERAGE":
            s = s / dt(forest.n_trees)
    elif how in ("MIN", "MAX"):
        pick = np.min if how == "MIN" else np.max
        fill = dt(np.inf if how == "MIN" else -np.inf)
        s = np.where(hit.any(axis=1), pick(np.where(hit, w, fill), axis=1), dt(0))
    else:
        raise ValueError(f"TreeEnsembleRegressor {attrs.name!r}: unknown aggregate_function {how!r}")
    base = _tensor_or_list(attrs, "base_values", np.float32)
    if base is not None and len(base) == forest.n_targets:  # (other lengths: none added, as onnxruntime)
        s = s + base.astype(dt)
    s = s.astype(np.float32)
    post = _text(attrs.get("post_transform") or "NONE")
    if post == "LOGISTIC":
        s = _logistic(s)
    elif post in ("SOFTMAX", "SOFTMAX_ZERO"):
        s = _softmax(s, post == "SOFTMAX_ZERO")
    elif post == "PROBIT":
        if forest.n_targets != 1:
            raise ValueError(f"TreeEnsembleRegressor {attrs.name!r}: PROBIT needs one target")
        s = _probit(s)
    elif post != "NONE":
        raise ValueError(f"TreeEnsembleRegressor {attrs.name!r}: unknown post_transform {post!r}")
    return (np.asarray(s, np.float32),)
