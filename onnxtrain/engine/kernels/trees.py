"""``ai.onnx.ml`` tree ensembles: TreeEnsembleRegressor (versions 1 and 3) and TreeEnsemble (version 5).
Every sample walks every tree at once.

Both ops' nodes are compiled once per node (cached on it) into one :class:`_Forest` of flat arrays:
feature, threshold, comparison, child indices, whether a missing value (NaN) takes the true branch, the set
of a BRANCH_MEMBER node; the leaves' weights into a dense (leaf, target) matrix. A walk is one vectorised
step per tree level over a (samples, trees) array of node indices. What the spec leaves open follows
onnxruntime, the oracle of the tests: features compare in the thresholds' type (float32 unless they are
double; a double input compares in double), scores add up tree after tree in float32 (in double for a
double input or double thresholds), AVERAGE divides by the number of trees, MIN and MAX take only the
leaves that score a target (none: 0), and the post transforms are onnxruntime's formulas. Where the spec
says otherwise than onnxruntime does, the spec is followed: base values are added to every target
(onnxruntime leaves a target no leaf scored at 0) and a single target gets its post transform too
(onnxruntime applies only PROBIT there).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel

# comparison codes (version 5's own numbering), and a leaf
_MODES = {"BRANCH_LEQ": 0, "BRANCH_LT": 1, "BRANCH_GTE": 2, "BRANCH_GT": 3, "BRANCH_EQ": 4, "BRANCH_NEQ": 5,
          "BRANCH_MEMBER": 6, "LEAF": 7}
_MEMBER, _LEAF = 6, 7
_COMPARE = {0: np.less_equal, 1: np.less, 2: np.greater_equal, 3: np.greater, 4: np.equal, 5: np.not_equal}
_AGGREGATES = ("AVERAGE", "SUM", "MIN", "MAX")  # version 5's codes 0..3
_ROWS = 4096  # rows walked at once
_TRANSFORMS = ("NONE", "SOFTMAX", "LOGISTIC", "SOFTMAX_ZERO", "PROBIT")  # version 5's codes 0..4


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
    """A tree ensemble's nodes and leaves as flat arrays (see the module docstring); leaves are nodes of mode
    LEAF. ``members``: for each node, its BRANCH_MEMBER set as a row padded with NaN (None: no such
    node)."""

    def __init__(self, op: str, mode: np.ndarray, feature: np.ndarray, threshold: np.ndarray,
                 missing_true: np.ndarray, true: np.ndarray, false: np.ndarray, roots: np.ndarray,
                 weights: np.ndarray, scores: np.ndarray, members: np.ndarray | None = None):
        self.op, self.mode, self.feature, self.threshold = op, mode, feature, threshold
        self.missing_true, self.true, self.false, self.roots = missing_true, true, false, roots
        self.weights, self.scores, self.members = weights, scores, members
        self.n_trees, self.n_targets = len(roots), weights.shape[1]
        self.depth = self._depth()
        # the walk's tables: the feature a node reads (0 for a leaf), node k's children at 2k (false) and
        # 2k + 1 (true), and the one comparison of all the inner nodes when they share one
        self._reads = np.where(mode == _LEAF, 0, feature).astype(np.int64)
        self.last_feature = int(self._reads.max(initial=-1))  # the highest feature a node reads (-1: none)
        self._next = np.stack([false, true], axis=1).reshape(-1).astype(np.int64)
        inner = np.unique(mode[mode != _LEAF])
        self._compare = _COMPARE.get(int(inner[0])) if len(inner) == 1 else None
        if self.n_targets <= 63:  # each node's scored targets as the bits of one integer
            self._bits = scores.astype(np.int64) @ (np.int64(1) << np.arange(self.n_targets, dtype=np.int64))

    def _depth(self) -> int:
        """The longest root-to-leaf path (a bound for the walk's steps; a cycle is an error)."""
        frontier, level = self.roots, 0
        while len(frontier):
            level += 1
            if level > len(self.mode) + 1:
                raise ValueError(f"{self.op}: the nodes form a cycle")
            inner = frontier[self.mode[frontier] != _LEAF]
            frontier = np.unique(np.concatenate([self.true[inner], self.false[inner]]))
        return level

    def leaves(self, x: np.ndarray) -> np.ndarray:
        """The leaf each sample (row of ``x``) reaches in each tree: (samples, trees). A step is a handful of
        gathers over the (samples, trees) node indices: a leaf's two children are itself, so it stays."""
        rows, width = _rows(x).shape
        at = np.broadcast_to(self.roots, (rows, len(self.roots))).copy()
        if not at.size:
            return at
        flat = np.ascontiguousarray(x).reshape(-1)
        first = (np.arange(rows, dtype=np.int64) * width)[:, None]  # each row's first feature in ``flat``
        missing = bool(self.missing_true.any()) and bool(np.isnan(flat).any())
        for _ in range(self.depth):
            where = self._reads.take(at)
            where += first
            v = flat.take(where)
            t = self.threshold.take(at)
            go = self._compare(v, t) if self._compare is not None else self._go(at, v, t)
            if missing:
                go |= np.isnan(v) & self.missing_true.take(at)
            at <<= 1
            at += go
            at = self._next.take(at)
        return at

    def scored(self, at: np.ndarray) -> np.ndarray:
        """(samples, targets): whether a leaf of ``at`` (samples, trees) scores the target; up to 63 targets
        as bit masks OR-ed over the trees."""
        if self.n_targets > 63:
            return self.scores[at].any(axis=1)
        bits = np.bitwise_or.reduce(self._bits.take(at), axis=1)
        return (bits[:, None] >> np.arange(self.n_targets, dtype=np.int64)) & 1 != 0

    def _go(self, at: np.ndarray, v: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Whether each sample takes the true branch, for forests of several comparison modes."""
        m = self.mode.take(at)
        go = np.select([m == 0, m == 1, m == 2, m == 3, m == 4], [v <= t, v < t, v >= t, v > t, v == t],
                       v != t)
        if self.members is not None:
            member = m == _MEMBER
            if member.any():
                go[member] = (self.members[at[member]] == v[member][:, None]).any(axis=1)
        return go


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


def _transformed(s: np.ndarray, post: str, op: str) -> np.ndarray:
    """Every score column after ``post`` (a classifier's: PROBIT too on several columns), float32."""
    if post == "LOGISTIC":
        s = _logistic(s)
    elif post in ("SOFTMAX", "SOFTMAX_ZERO"):
        s = _softmax(s, post == "SOFTMAX_ZERO")
    elif post == "PROBIT":
        s = _probit(s)
    elif post != "NONE":
        raise ValueError(f"{op}: unknown post_transform {post!r}")
    return np.asarray(s, np.float32)


def _regressor_forest(attrs: Attrs, leaf: str = "target", n_targets: int | None = None,
                      op: str = "TreeEnsembleRegressor") -> _Forest:
    """TreeEnsembleRegressor's nodes (identified by tree and node ids) and targets as a forest; with
    ``leaf="class"``, TreeEnsembleClassifier's, whose ``n_targets`` classes the ``class_*`` entries score."""
    op = f"{op} {attrs.name!r}"
    tree_ids = np.asarray(attrs["nodes_treeids"], np.int64)
    node_ids = np.asarray(attrs["nodes_nodeids"], np.int64)
    n = len(tree_ids)
    modes = [_MODES.get(_text(m)) for m in attrs["nodes_modes"]]
    if None in modes or _MEMBER in modes:
        bad = _text(attrs["nodes_modes"][modes.index(None if None in modes else _MEMBER)])
        raise ValueError(f"{op}: unknown node mode {bad!r}")
    values = _tensor_or_list(attrs, "nodes_values", np.float32)
    lists = [node_ids, np.asarray(attrs["nodes_featureids"]), np.asarray(attrs["nodes_truenodeids"]),
             np.asarray(attrs["nodes_falsenodeids"]), modes, values]
    if any(v is None or len(v) != n for v in lists):
        raise ValueError(f"{op}: the nodes_* attributes differ in length")
    index = {(int(t), int(i)): k for k, (t, i) in enumerate(zip(tree_ids, node_ids))}
    if len(index) != n:
        raise ValueError(f"{op}: a (tree, node) id pair is repeated")
    mode = np.asarray(modes, np.int8)
    threshold = values.astype(np.float64 if values.dtype == np.float64 else np.float32)

    def child(k: int, ids: Any) -> int:
        if mode[k] == _LEAF:
            return k
        key = (int(tree_ids[k]), int(ids[k]))
        if key not in index:
            raise ValueError(f"{op}: node {key} (a child of node {(int(tree_ids[k]), int(node_ids[k]))}) "
                             "does not exist")
        return index[key]

    true = np.asarray([child(k, attrs["nodes_truenodeids"]) for k in range(n)], np.int64)
    false = np.asarray([child(k, attrs["nodes_falsenodeids"]) for k in range(n)], np.int64)
    children = set(true[mode != _LEAF].tolist()) | set(false[mode != _LEAF].tolist())
    roots = np.asarray([k for k in range(n) if k not in children], np.int64)
    if len(roots) != len(set(tree_ids.tolist())):
        raise ValueError(f"{op}: {len(roots)} roots for {len(set(tree_ids.tolist()))} trees")
    n_targets = int(attrs.get("n_targets") or 1) if n_targets is None else n_targets
    weights = np.zeros((n, n_targets), threshold.dtype)
    scores = np.zeros((n, n_targets), bool)  # which (leaf, target) a leaf scores
    given = _tensor_or_list(attrs, f"{leaf}_weights", np.float32)
    for t, i, target, w in zip(attrs[f"{leaf}_treeids"], attrs[f"{leaf}_nodeids"], attrs[f"{leaf}_ids"],
                               given if given is not None else ()):
        k = index.get((int(t), int(i)))
        if k is None or not 0 <= int(target) < n_targets:
            raise ValueError(f"{op}: target entry of node {(int(t), int(i))} and target {int(target)} "
                             "names no leaf or target")
        weights[k, int(target)] += threshold.dtype.type(w)
        scores[k, int(target)] = True
    missing = attrs.get("nodes_missing_value_tracks_true")
    missing_true = np.zeros(n, bool) if missing is None or len(missing) == 0 else np.asarray(missing) != 0
    return _Forest(op, mode, np.asarray(attrs["nodes_featureids"], np.int64), threshold, missing_true, true,
                   false, roots, weights, scores)


def _v5_forest(attrs: Attrs) -> _Forest:
    """TreeEnsemble's (version 5) nodes, by index, and its leaves, appended after them as LEAF nodes."""
    op = f"TreeEnsemble {attrs.name!r}"
    splits = np.asarray(attrs["nodes_splits"]).reshape(-1)
    n = len(splits)
    mode = np.asarray(attrs["nodes_modes"]).reshape(-1).astype(np.int8)
    targets = np.asarray(attrs["leaf_targetids"], np.int64)
    leaf_w = np.asarray(attrs["leaf_weights"]).reshape(-1)
    n_leaves, n_targets = len(targets), int(attrs.get("n_targets") or 1)
    lists = [mode, attrs["nodes_featureids"], attrs["nodes_truenodeids"], attrs["nodes_falsenodeids"],
             attrs["nodes_trueleafs"], attrs["nodes_falseleafs"]]
    if any(len(v) != n for v in lists) or len(leaf_w) != n_leaves:
        raise ValueError(f"{op}: the nodes_* (or leaf_*) attributes differ in length")
    if ((mode < 0) | (mode > _MEMBER)).any():
        raise ValueError(f"{op}: unknown node mode {int(mode[(mode < 0) | (mode > _MEMBER)][0])}")
    if ((targets < 0) | (targets >= n_targets)).any():
        raise ValueError(f"{op}: a leaf's target is not below n_targets={n_targets}")

    def child(ids: Any, leafs: Any) -> np.ndarray:
        ids, leafs = np.asarray(ids, np.int64), np.asarray(leafs, np.int64) != 0
        bad = (leafs & ((ids < 0) | (ids >= n_leaves))) | (~leafs & ((ids < 0) | (ids >= n)))
        if bad.any():
            raise ValueError(f"{op}: node {int(np.argmax(bad))} names a child that does not exist")
        return np.where(leafs, ids + n, ids)

    own = n + np.arange(n_leaves)  # a leaf's children are itself
    true = np.concatenate([child(attrs["nodes_truenodeids"], attrs["nodes_trueleafs"]), own])
    false = np.concatenate([child(attrs["nodes_falsenodeids"], attrs["nodes_falseleafs"]), own])
    roots = np.asarray(attrs["tree_roots"], np.int64)
    # a tree that is one leaf: its root's two branches name the same leaf
    true_leaf = np.asarray(attrs["nodes_trueleafs"]) != 0
    false_leaf = np.asarray(attrs["nodes_falseleafs"]) != 0
    lone = true_leaf[roots] & false_leaf[roots] & (true[roots] == false[roots])
    roots = np.where(lone, true[roots], roots)
    dtype = np.float64 if splits.dtype == np.float64 else np.float32
    weights = np.zeros((n + n_leaves, n_targets), dtype)
    scores = np.zeros((n + n_leaves, n_targets), bool)
    weights[n + np.arange(n_leaves), targets] = leaf_w.astype(dtype)
    scores[n + np.arange(n_leaves), targets] = True
    members = None
    if (mode == _MEMBER).any():
        values = np.asarray(attrs.get("membership_values") if attrs.get("membership_values") is not None
                            else [], np.float64).reshape(-1)
        sets, current = [], []
        for v in values:  # one NaN-ended run of values per BRANCH_MEMBER node, in node order
            if np.isnan(v):
                sets.append(current)
                current = []
            else:
                current.append(v)
        if current:
            sets.append(current)
        at = np.flatnonzero(mode == _MEMBER)
        if len(sets) != len(at):
            raise ValueError(f"{op}: {len(sets)} membership sets for {len(at)} BRANCH_MEMBER nodes")
        width = max(1, *(len(m) for m in sets))
        members = np.full((n + n_leaves, width), np.nan, dtype)
        for k, m in zip(at, sets):
            members[k, : len(m)] = m
    missing = attrs.get("nodes_missing_value_tracks_true")
    missing_true = np.zeros(n + n_leaves, bool)
    if missing is not None and len(missing):
        missing_true[:n] = np.asarray(missing) != 0
    feature = np.concatenate([np.asarray(attrs["nodes_featureids"], np.int64), np.zeros(n_leaves, np.int64)])
    mode = np.concatenate([mode, np.full(n_leaves, _LEAF, np.int8)])
    threshold = np.concatenate([splits.astype(dtype), np.zeros(n_leaves, dtype)])
    return _Forest(op, mode, feature, threshold, missing_true, true, false, roots, weights, scores, members)


def _rows(x: np.ndarray) -> np.ndarray:
    """``x`` as (rows, features): a vector is one row; an empty batch keeps its width."""
    if x.ndim == 1:
        return x.reshape(1, -1)
    return x.reshape(len(x), int(np.prod(x.shape[1:], dtype=np.int64)))


def _predict(forest: _Forest, x: np.ndarray, how: str, base: np.ndarray | None, post: str,
             out: Any = np.float32, scored: np.ndarray | None = None) -> np.ndarray:
    """The forest's aggregated, shifted and transformed scores of the rows of ``x``, of dtype ``out``; with
    ``scored`` (rows, targets) booleans, also whether a leaf each row reaches scores each target (the same
    walk)."""
    x = _rows(x)
    compare = np.float64 if x.dtype == np.float64 or forest.threshold.dtype == np.float64 else np.float32
    x = x.astype(compare, copy=False)
    if x.shape[1] <= forest.last_feature:
        raise ValueError(f"{forest.op}: a node reads feature {forest.last_feature}, the input has "
                         f"{x.shape[1]}")
    if how not in _AGGREGATES:
        raise ValueError(f"{forest.op}: unknown aggregate_function {how!r}")
    dt = np.dtype(compare).type  # a double input or double trees add in double, as onnxruntime does
    weights = forest.weights.astype(compare, copy=False)
    s = np.zeros((len(x), forest.n_targets), dt)
    for lo in range(0, len(x), _ROWS):  # rows a block at a time: the walk holds (rows, trees) indices
        at = forest.leaves(x[lo: lo + _ROWS])
        part = s[lo: lo + _ROWS]
        if scored is not None:
            scored[lo: lo + _ROWS] = forest.scored(at)
        if how in ("SUM", "AVERAGE"):  # tree after tree, as onnxruntime adds them (the same bits): a
            part += np.add.reduce(weights[at.T], axis=0)  # reduction over the outer axis adds in order
        else:
            better = np.less if how == "MIN" else np.greater
            seen = np.zeros(part.shape, bool)
            for t in range(at.shape[1]):
                w, hit = weights[at[:, t]], forest.scores[at[:, t]]
                take = hit & (~seen | better(w, part))
                part[take] = w[take]
                seen |= hit
    if how == "AVERAGE":
        s = s / dt(forest.n_trees)
    if base is not None and len(base) == forest.n_targets:  # (other lengths: none added, as onnxruntime)
        s = s + base.astype(dt)
    s = s.astype(out)
    if post == "LOGISTIC":
        return _logistic(s)
    if post in ("SOFTMAX", "SOFTMAX_ZERO"):
        return _softmax(s, post == "SOFTMAX_ZERO")
    if post == "PROBIT":
        if forest.n_targets != 1:
            raise ValueError(f"{forest.op}: PROBIT needs one target")
        return _probit(s)
    if post != "NONE":
        raise ValueError(f"{forest.op}: unknown post_transform {post!r}")
    return s


@kernel("TreeEnsembleRegressor", domain="ai.onnx.ml")
def tree_ensemble_regressor(inputs: Inputs, attrs: Attrs) -> Outputs:
    forest: _Forest = attrs.cached("forest", lambda: _regressor_forest(attrs))
    base = _tensor_or_list(attrs, "base_values", np.float32)
    s = _predict(forest, np.asarray(inputs[0]), _text(attrs.get("aggregate_function") or "SUM"), base,
                 _text(attrs.get("post_transform") or "NONE"))
    return (np.asarray(s, np.float32),)


@kernel("TreeEnsemble", domain="ai.onnx.ml")
def tree_ensemble(inputs: Inputs, attrs: Attrs) -> Outputs:
    forest: _Forest = attrs.cached("forest", lambda: _v5_forest(attrs))
    x = np.asarray(inputs[0])
    how, post = attrs.get("aggregate_function"), attrs.get("post_transform")
    how = 1 if how is None else int(how)
    post = 0 if post is None else int(post)
    if not 0 <= how < len(_AGGREGATES) or not 0 <= post < len(_TRANSFORMS):
        raise ValueError(f"TreeEnsemble {attrs.name!r}: unknown aggregate_function {how} or post_transform "
                         f"{post}")
    out = x.dtype if x.dtype.kind == "f" else np.float32  # Y has X's type
    return (np.asarray(_predict(forest, x, _AGGREGATES[how], None, _TRANSFORMS[post], out), out),)
