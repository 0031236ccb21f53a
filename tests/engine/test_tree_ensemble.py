"""TreeEnsembleRegressor (``ai.onnx.ml`` 1 and 3) against onnxruntime, on random forests built here: every
comparison mode, NaN features and their missing-value branch, every aggregate and post transform, base
values, several targets, double thresholds and inputs of other types. Up to 50 rows onnxruntime adds the
trees one after the other, as onnxtrain does (the same bits); over 50 rows it adds each thread's share of
the trees apart and then the shares, so there the sums may part in the last bits."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.engine import compile_model
from onnxtrain.engine.interface import EngineError

MODES = ["BRANCH_LEQ", "BRANCH_LT", "BRANCH_GTE", "BRANCH_GT", "BRANCH_EQ", "BRANCH_NEQ"]


def random_forest(rng: np.random.Generator, n_trees: int, depth: int, n_features: int, n_targets: int,
                  every_target: bool = True) -> dict[str, list]:
    """The nodes_* and target_* attributes of ``n_trees`` random trees (thresholds on a 0.1 grid, so that the
    equality modes and ties with the inputs occur); each leaf scores every target, or some of them."""
    a: dict[str, list] = {k: [] for k in (
        "nodes_treeids", "nodes_nodeids", "nodes_featureids", "nodes_values", "nodes_modes",
        "nodes_truenodeids", "nodes_falsenodeids", "nodes_missing_value_tracks_true", "target_treeids",
        "target_nodeids", "target_ids", "target_weights")}

    def build(tree: int, count: list[int], level: int) -> int:
        me, slot = count[0], len(a["nodes_treeids"])
        count[0] += 1
        a["nodes_treeids"].append(tree)
        a["nodes_nodeids"].append(me)
        leaf = level == depth or (level > 0 and rng.random() < 0.15)
        a["nodes_featureids"].append(0 if leaf else int(rng.integers(n_features)))
        a["nodes_values"].append(0.0 if leaf else float(np.round(rng.standard_normal(), 1)))
        a["nodes_modes"].append("LEAF" if leaf else str(rng.choice(MODES, p=[.5, .1, .1, .1, .1, .1])))
        a["nodes_missing_value_tracks_true"].append(0 if leaf else int(rng.integers(2)))
        a["nodes_truenodeids"].append(0)
        a["nodes_falsenodeids"].append(0)
        if leaf:
            count_k = n_targets if every_target else int(rng.integers(1, n_targets + 1))
            for k in rng.choice(n_targets, size=count_k, replace=False):
                a["target_treeids"].append(tree)
                a["target_nodeids"].append(me)
                a["target_ids"].append(int(k))
                a["target_weights"].append(float(rng.standard_normal()))
        else:
            a["nodes_truenodeids"][slot] = build(tree, count, level + 1)
            a["nodes_falsenodeids"][slot] = build(tree, count, level + 1)
        return me

    for tree in range(n_trees):
        build(tree, [0], 0)
    return a


def regressor(attrs: dict[str, Any], n_features: int, n_targets: int, x_type: int = TensorProto.FLOAT,
              ml_opset: int = 3) -> onnx.ModelProto:
    node = helper.make_node("TreeEnsembleRegressor", ["X"], ["Y"], domain="ai.onnx.ml", name="trees",
                            n_targets=n_targets, **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", x_type, [None, n_features])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, n_targets])])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", ml_opset)]
    m = helper.make_model(g, opset_imports=opsets)
    m.ir_version = 9
    return m


def features(rng: np.random.Generator, n: int, n_features: int, dtype: Any = np.float32) -> np.ndarray:
    """Rows on a 0.1 grid (ties with the thresholds, whole numbers for the membership sets), 10 % NaN."""
    x = np.round(rng.standard_normal((n, n_features)), 1).astype(dtype)
    if x.dtype.kind == "f":
        x[rng.random(x.shape) < 0.1] = np.nan
    return x


def both(model: onnx.ModelProto, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ours = compile_model(model).run({"X": x})[0]
    theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"X": x})[0]
    return ours, theirs


@pytest.mark.parametrize("aggregate", ["SUM", "AVERAGE", "MIN", "MAX"])
@pytest.mark.parametrize("post", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
def test_forests_of_three_targets(aggregate: str, post: str) -> None:
    rng = np.random.default_rng(zlib.crc32(f"{aggregate} {post}".encode()))
    a = random_forest(rng, n_trees=7, depth=5, n_features=6, n_targets=3)
    model = regressor({**a, "aggregate_function": aggregate, "post_transform": post,
                       "base_values": [0.5, -1.0, 2.0]}, 6, 3)
    ours, theirs = both(model, features(rng, 50, 6))
    assert ours.dtype == np.float32 and ours.shape == theirs.shape == (50, 3)
    if post == "NONE":
        np.testing.assert_array_equal(ours, theirs)
    else:  # the same formulas; exp may differ in the last bit
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-7)


@pytest.mark.parametrize("post", ["NONE", "PROBIT"])
def test_one_target_with_one_base_value(post: str) -> None:
    """(40 rows: onnxruntime adds the trees in order, as onnxtrain does.)"""
    rng = np.random.default_rng(5)
    a = random_forest(rng, n_trees=5, depth=4, n_features=3, n_targets=1)
    a["target_weights"] = [abs(w) / 20 for w in a["target_weights"]]  # scores inside (0, 1) for PROBIT
    model = regressor({**a, "post_transform": post, "base_values": [0.1]}, 3, 1)
    ours, theirs = both(model, features(rng, 40, 3))
    # onnxruntime's probit approximates erfinv; onnxtrain solves it to double precision
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-3 if post == "PROBIT" else 0)


def test_the_spec_where_onnxruntime_departs_from_it() -> None:
    """The spec adds the base values to every target and applies the post transform to one target too;
    onnxruntime leaves a target no leaf scored at 0 (base value or not) and skips LOGISTIC and SOFTMAX for
    a single target. The oracle: onnxruntime without the base values or the transform, and the spec's
    formula."""
    rng = np.random.default_rng(12)
    a = random_forest(rng, n_trees=3, depth=3, n_features=4, n_targets=3, every_target=False)
    x = features(rng, 40, 4)
    _, plain = both(regressor(a, 4, 3), x)
    base = np.array([0.5, -1.0, 2.0], np.float32)
    ours, theirs = both(regressor({**a, "base_values": base.tolist()}, 4, 3), x)
    np.testing.assert_array_equal(ours, plain + base)
    scored = theirs != 0
    np.testing.assert_array_equal(theirs[scored], (plain + base)[scored])
    assert (~scored).any()  # the case the test is about occurs
    one = random_forest(rng, n_trees=4, depth=3, n_features=4, n_targets=1)
    _, raw = both(regressor(one, 4, 1), x)
    ours, theirs = both(regressor({**one, "post_transform": "LOGISTIC"}, 4, 1), x)
    np.testing.assert_array_equal(theirs, raw)
    np.testing.assert_allclose(ours, 1 / (1 + np.exp(-raw.astype(np.float64))), rtol=1e-6)


def test_double_thresholds_and_tensor_weights() -> None:
    """Version 3's ``*_as_tensor`` attributes: double thresholds compare a double input in double."""
    rng = np.random.default_rng(6)
    a = random_forest(rng, n_trees=4, depth=4, n_features=5, n_targets=2)
    values = np.asarray(a.pop("nodes_values")) + 1e-9  # ties a float32 threshold would make
    weights = np.asarray(a.pop("target_weights"))
    a["nodes_values_as_tensor"] = numpy_helper.from_array(values, "v")
    a["target_weights_as_tensor"] = numpy_helper.from_array(weights, "w")
    a["base_values_as_tensor"] = numpy_helper.from_array(np.array([1.0, 2.0]), "b")
    model = regressor(a, 5, 2, TensorProto.DOUBLE)
    ours, theirs = both(model, features(rng, 50, 5, np.float64))
    np.testing.assert_array_equal(ours, theirs)


def test_double_inputs_to_float_trees() -> None:
    rng = np.random.default_rng(7)
    a = random_forest(rng, n_trees=6, depth=5, n_features=4, n_targets=2)
    ours, theirs = both(regressor(a, 4, 2, TensorProto.DOUBLE), features(rng, 30, 4, np.float64) / 3)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("dtype,onnx_type", [(np.int64, TensorProto.INT64), (np.int32, TensorProto.INT32)])
def test_integer_inputs_compare_as_floats(dtype: Any, onnx_type: int) -> None:
    """onnxruntime 1.32 has no integer kernel: the oracle is its result on the same values as float32 (how
    C++ compares an integer with a float threshold)."""
    rng = np.random.default_rng(8)
    a = random_forest(rng, n_trees=6, depth=5, n_features=4, n_targets=2)
    x = rng.integers(-2, 3, (30, 4))
    ours = compile_model(regressor(a, 4, 2, onnx_type)).run({"X": x.astype(dtype)})[0]
    _, theirs = both(regressor(a, 4, 2), x.astype(np.float32))
    np.testing.assert_array_equal(ours, theirs)


def test_a_tree_that_is_one_leaf_and_version_1() -> None:
    a = {"nodes_treeids": [0, 1, 1, 1], "nodes_nodeids": [0, 0, 1, 2], "nodes_featureids": [0, 1, 0, 0],
         "nodes_values": [0.0, 0.5, 0.0, 0.0], "nodes_modes": ["LEAF", "BRANCH_LEQ", "LEAF", "LEAF"],
         "nodes_truenodeids": [0, 1, 0, 0], "nodes_falsenodeids": [0, 2, 0, 0],
         "target_treeids": [0, 1, 1], "target_nodeids": [0, 1, 2], "target_ids": [0, 0, 0],
         "target_weights": [3.0, -1.0, 1.0]}
    model = regressor({**a, "aggregate_function": "AVERAGE"}, 2, 1, ml_opset=1)
    x = np.array([[0.0, 0.2], [0.0, 0.9], [0.0, np.nan]], np.float32)
    ours, theirs = both(model, x)
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(ours[:, 0], [1.0, 2.0, 2.0])  # (3 − 1) / 2, (3 + 1) / 2, NaN goes false


def test_bad_forests_are_errors_naming_the_node() -> None:
    a = random_forest(np.random.default_rng(8), n_trees=2, depth=2, n_features=2, n_targets=1)
    a["nodes_truenodeids"][0] = 99
    with pytest.raises(EngineError, match="trees.*does not exist"):
        compile_model(regressor(a, 2, 1)).run({"X": np.zeros((1, 2), np.float32)})
    b = random_forest(np.random.default_rng(8), n_trees=2, depth=2, n_features=2, n_targets=1)
    with pytest.raises(EngineError, match="trees.*reads feature"):
        compile_model(regressor(b, 2, 1)).run({"X": np.zeros((1, 1), np.float32)})


def test_many_rows_match_within_rounding() -> None:
    rng = np.random.default_rng(9)
    a = random_forest(rng, n_trees=9, depth=5, n_features=6, n_targets=3)
    model = regressor(a, 6, 3)
    ours, theirs = both(model, features(rng, 400, 6))
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)


# ---- TreeEnsemble (ai.onnx.ml 5) -------------------------------------------------------------------------
def random_v5(rng: np.random.Generator, n_trees: int, depth: int, n_features: int, n_targets: int,
              dtype: Any = np.float32, member: bool = False) -> dict[str, Any]:
    """Version 5's attributes for ``n_trees`` random trees: nodes by index (modes 0-5, and BRANCH_MEMBER
    with its sets when ``member``), leaves apart, each scoring one target."""
    nodes: dict[str, list] = {k: [] for k in ("splits", "featureids", "modes", "truenodeids", "falsenodeids",
                                              "trueleafs", "falseleafs", "missing")}
    leaves: dict[str, list] = {"targetids": [], "weights": []}
    members: list[float] = []
    roots = []

    def leaf() -> int:
        leaves["targetids"].append(int(rng.integers(n_targets)))
        leaves["weights"].append(float(rng.standard_normal()))
        return len(leaves["weights"]) - 1

    def node(level: int) -> int:
        k = len(nodes["splits"])
        mode = int(rng.choice(7, p=[.4, .1, .1, .1, .1, .1, .1] if member else [.5, .1, .1, .1, .1, .1, 0]))
        nodes["modes"].append(mode)
        nodes["featureids"].append(int(rng.integers(n_features)))
        nodes["splits"].append(float(np.round(rng.standard_normal(), 1)) if mode != 6 else 0.0)
        nodes["missing"].append(int(rng.integers(2)))
        for side in ("true", "false"):
            nodes[f"{side}nodeids"].append(0)
            nodes[f"{side}leafs"].append(0)
        if mode == 6:
            # (onnxruntime takes whole-number members only; onnx.reference ends a set at a member 0)
            members.extend([float(v) for v in rng.choice([-2, -1, 1, 2], 3)] + [float("nan")])
        for side in ("true", "false"):
            is_leaf = level == depth or rng.random() < 0.2
            nodes[f"{side}leafs"][k] = int(is_leaf)
            nodes[f"{side}nodeids"][k] = leaf() if is_leaf else node(level + 1)
        return k

    for _ in range(n_trees):
        roots.append(node(1))
    attrs = {f"nodes_{k}": v for k, v in nodes.items() if k not in ("splits", "modes", "missing")}
    attrs.update(
        nodes_splits=numpy_helper.from_array(np.asarray(nodes["splits"], dtype), "splits"),
        nodes_modes=numpy_helper.from_array(np.asarray(nodes["modes"], np.uint8), "modes"),
        nodes_missing_value_tracks_true=nodes["missing"], leaf_targetids=leaves["targetids"],
        leaf_weights=numpy_helper.from_array(np.asarray(leaves["weights"], dtype), "weights"),
        tree_roots=roots, n_targets=n_targets)
    if members:
        attrs["membership_values"] = numpy_helper.from_array(np.asarray(members, dtype), "members")
    return attrs


def v5_model(attrs: dict[str, Any], n_features: int, n_targets: int,
             x_type: int = TensorProto.FLOAT) -> onnx.ModelProto:
    node = helper.make_node("TreeEnsemble", ["X"], ["Y"], domain="ai.onnx.ml", name="trees", **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", x_type, [None, n_features])],
                          [helper.make_tensor_value_info("Y", x_type, [None, n_targets])])
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("ai.onnx.ml", 5)]
    m = helper.make_model(g, opset_imports=opsets)
    m.ir_version = 10
    return m


@pytest.mark.parametrize("aggregate", [0, 1, 2, 3])
@pytest.mark.parametrize("post", [0, 1, 2, 3])
def test_v5_forests_against_onnxruntime(aggregate: int, post: int) -> None:
    """onnxruntime 1.32 reads ``post_transform`` 1 as LOGISTIC and 2 as SOFTMAX, the spec the other way
    round: its model for the oracle gets the other code."""
    rng = np.random.default_rng(100 + 4 * aggregate + post)
    attrs = random_v5(rng, n_trees=6, depth=4, n_features=5, n_targets=3)
    model = v5_model({**attrs, "aggregate_function": aggregate, "post_transform": post}, 5, 3)
    x = features(rng, 50, 5)
    ours = compile_model(model).run({"X": x})[0]
    swapped = {1: 2, 2: 1}.get(post, post)
    _, theirs = both(v5_model({**attrs, "aggregate_function": aggregate, "post_transform": swapped}, 5, 3), x)
    assert ours.dtype == theirs.dtype == np.float32 and ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=0 if post == 0 else 2e-7)


@pytest.mark.parametrize("seed", range(4))
def test_v5_membership_sets_against_onnx_reference(seed: int) -> None:
    """BRANCH_MEMBER nodes: onnx.reference is the oracle (onnxruntime 1.32 goes wrong once such a node is
    not the ensemble's last one: on these forests it scores other leaves than the paths followed by hand;
    onnx.reference ends a set at a member 0, which the forests here leave out)."""
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(seed)
    attrs = random_v5(rng, n_trees=5, depth=4, n_features=5, n_targets=3, member=True)
    model = v5_model(attrs, 5, 3)
    x = features(rng, 50, 5)
    ours = compile_model(model).run({"X": x})[0]
    np.testing.assert_array_equal(ours, ReferenceEvaluator(model).run(None, {"X": x})[0])


def test_v5_double() -> None:
    rng = np.random.default_rng(7)
    attrs = random_v5(rng, n_trees=5, depth=4, n_features=4, n_targets=2, dtype=np.float64)
    ours, theirs = both(v5_model(attrs, 4, 2, TensorProto.DOUBLE), features(rng, 40, 4, np.float64))
    assert ours.dtype == theirs.dtype == np.float64
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("module", ["ai_onnx_ml.tree_ensemble"])
def test_v5_onnx_node_cases(module: str) -> None:
    """ONNX's own node cases of TreeEnsemble (a single tree, set membership)."""
    from onnxtrain.conformance import module_cases, run_case

    cases = module_cases(module)
    assert len(cases) == 2
    for _, case in cases:
        run_case(case)


@pytest.mark.parametrize("aggregate", ["SUM", "MIN"])
def test_rows_walked_in_blocks(aggregate: str) -> None:
    """More rows than one block of the walk (4,096). (Over 50 rows onnxruntime adds each thread's share of
    the trees apart: the sums may part in the last bits; a minimum is exact.)"""
    rng = np.random.default_rng(13)
    a = random_forest(rng, n_trees=8, depth=5, n_features=4, n_targets=1)
    ours, theirs = both(regressor({**a, "aggregate_function": aggregate}, 4, 1), features(rng, 9000, 4))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=0 if aggregate == "MIN" else 2e-6)


def test_an_empty_batch_gives_empty_scores() -> None:
    """A [0, C] input (an empty batch) gives [0, targets] scores, as onnxruntime does, for both versions."""
    rng = np.random.default_rng(21)
    a = random_forest(rng, n_trees=3, depth=3, n_features=4, n_targets=2)
    for post in ("NONE", "SOFTMAX"):
        ours, theirs = both(regressor({**a, "post_transform": post, "base_values": [0.5, 1.0]}, 4, 2),
                            np.zeros((0, 4), np.float32))
        assert ours.dtype == theirs.dtype == np.float32 and ours.shape == theirs.shape == (0, 2)
    attrs = random_v5(rng, n_trees=3, depth=3, n_features=4, n_targets=2)
    ours, theirs = both(v5_model(attrs, 4, 2), np.zeros((0, 4), np.float32))
    assert ours.dtype == theirs.dtype == np.float32 and ours.shape == theirs.shape == (0, 2)
