"""Legacy TrainingSession behaviours found in a review against onnxruntime-training 1.16.3 (the oracle runs in
tests/ortt.py's legacy venv, through tests/session/legacy_peer.py, with its session options of
legacy_peer.PEER_CONFIG): each case runs the same model, parameters and feeds on both sides, and every step's
outputs, get_state() and get_optimizer_state() are compared to float32 rounding
(test_legacy_ort116_numerics._compare).

* ``weights_to_train`` whose every name nothing in the model reads (names of a torch module that its export
  renamed, a parameter the export left out): 1.16.3 drops each such name with a warning, as for some of
  them, and then, the set being empty, finds the trained weights as without ``weights_to_train`` (every float
  initializer that reaches the loss; the spec's §2, steps 2 and 6). onnxtrain refused the session ("no
  trainable weight reaches the loss").
* An Adam ``do_bias_correction`` or ``weight_decay_mode`` other than 0 or 1: 1.16.3's AdamOptimizer kernel
  refuses it when the session is made, a ``RuntimeException``; onnxtrain refused it as a ``Fail`` (and a
  ValueError), so a ported ``except RuntimeException`` missed it. It is now both: an instance of 1.16.3's
  class, by name, as tests/session/test_legacy_ort116_surface.py compares every refusal.
* A ``lr_params_feed_name`` that names a value the training graph computes (``global_gradient_norm``, a
  gradient ``W1_grad``, an update's output ``W1_SGD_out``): 1.16.3 refuses the session ("Duplicate
  definition of name", a Fail). onnxtrain checked the name against the user's model only, so it built a
  graph with two definitions of the name and trained with the wrong learning rate (the global norm in its
  place: SGD steps 16 times too large here) or failed in the run. Names the session adds only in other
  configurations (``loss_scale``, ``Group_Accumulated_Gradients``) stay free, as there.

Checked and found to agree (kept as comparisons): SGD steps through gradient rules that
test_legacy_ort116_numerics does not reach (Gather with repeated indices, Greater/Where, Clip, Slice, Split,
Concat, Unsqueeze/Expand, Tile, Pad, LeakyRelu, AveragePool, GlobalAveragePool, ReduceLogSumExp, ReduceL2,
Reciprocal, Cos, Cast to float64 and back, TopK, GatherElements). (1.16.3 has no gradient of Sum or
Softplus: those stay out.) And onnxtrain on its onnxruntime backend (session config entry
``onnxtrain.backend``: a step as two graphs, session_halves, and the flat update), which
test_legacy_ort116_numerics runs on the numpy engine only: its cases that 1.16.3 runs right step the same.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from tests.session.legacy_peer import Case, Step, run_cases
from tests.session.test_legacy_ort116_numerics import CPU_ADAM, LRS, MLP_WEIGHTS, _compare, mlp, mlp_feeds

MAPPED = (*MLP_WEIGHTS, "unused", "fc.weight")  # (1.16.3 wants an entry for every weight it trains)


def _with_unused() -> object:
    """test_legacy_ort116_numerics.mlp() with one more float initializer that no node reads."""
    m = mlp()
    m.graph.initializer.append(numpy_helper.from_array(np.ones((4, 5), np.float32), "unused"))
    return m


def _params(opt: str, wanted: set[str], **kw) -> dict:
    return {"loss_output_name": "loss", "training_optimizer_name": opt, "weights_to_train": wanted,
            "optimizer_attributes_map": {w: {} for w in MAPPED},
            "optimizer_int_attributes_map": {w: {} for w in MAPPED}, **kw}


SWITCHES = {"do_bias_correction": 2, "weight_decay_mode": 2}
# learning-rate feed names: (optimizer, gradients as outputs, name, refused)
LR_NAMES = {
    "lr_global_norm_sgd": ("SGDOptimizer", False, "global_gradient_norm", True),
    "lr_global_norm_adam": ("AdamOptimizer", False, "global_gradient_norm", True),
    "lr_a_gradient": ("SGDOptimizer", False, "W1_grad", True),
    "lr_a_gradient_output": ("SGDOptimizer", True, "W1_grad", True),
    "lr_an_update_output_sgd": ("SGDOptimizer", False, "W1_SGD_out", True),
    "lr_an_update_output_adam": ("AdamOptimizer", False, "W1_Adam_out", True),
    "lr_loss_scale": ("SGDOptimizer", False, "loss_scale", False),
    "lr_group_output": ("AdamOptimizer", False, "Group_Accumulated_Gradients", False),
}

CASES = {
    "sgd_unused_name_only": (_with_unused, "SGDOptimizer", {"unused"}),
    "sgd_names_the_model_lacks": (_with_unused, "SGDOptimizer", {"fc.weight", "unused"}),
    "adam_name_the_model_lacks": (mlp, "AdamOptimizer", {"fc.weight"}),
}


@pytest.fixture(scope="module")
def traces() -> dict:
    cases = {name: Case(model(), _params(opt, wanted), [Step(f) for f in mlp_feeds(3, LRS)],
                        ours=CPU_ADAM if opt == "AdamOptimizer" else {})
             for name, (model, opt, wanted) in CASES.items()}
    for key, (opt, grads, lr, _) in LR_NAMES.items():
        feeds = [{**{k: v for k, v in f.items() if k != "Learning_Rate"}, lr: f["Learning_Rate"]}
                 for f in mlp_feeds(3, LRS)]
        cases[key] = Case(mlp(), _params(opt, set(MLP_WEIGHTS), lr_params_feed_name=lr,
                                         set_gradients_as_graph_outputs=grads), [Step(f) for f in feeds],
                          ours=CPU_ADAM if opt == "AdamOptimizer" else {})
    for key, value in SWITCHES.items():
        p = _params("AdamOptimizer", set(MLP_WEIGHTS))
        p["optimizer_int_attributes_map"] = {**p["optimizer_int_attributes_map"], "W2": {key: value}}
        cases[key] = Case(mlp(), p, [Step(f) for f in mlp_feeds(1, LRS)], ours=CPU_ADAM)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peer, ours = run_cases(list(cases.values()))
    return {name: (p, o) for name, p, o in zip(cases, peer, ours)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_weights_to_train_of_unread_names_only_trains_what_discovery_finds(traces: dict, name: str) -> None:
    peer, ours = traces[name]
    _compare(name, peer, ours)
    trained = set(MLP_WEIGHTS)
    assert set(peer.state[0]) >= trained and "unused" not in peer.state[0]  # (the oracle's own answer)
    w0 = {t.name: numpy_helper.to_array(t) for t in mlp().graph.initializer}
    for w in trained:
        assert not np.array_equal(ours.state[0][w], w0[w]), f"{name}: {w} did not move"


def test_the_fallback_is_named_in_a_warning() -> None:
    p = onnxtrain.TrainingParameters()
    for k, v in _params("SGDOptimizer", {"fc.weight"}).items():
        setattr(p, k, v)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = onnxtrain.TrainingSession(mlp().SerializeToString(), p)
    messages = [str(w.message) for w in caught]
    assert any("fc.weight" in m and "no consumer" in m for m in messages), messages
    assert any("every float initializer that reaches the loss" in m for m in messages), messages
    assert sorted(s.get_state()) == sorted(MLP_WEIGHTS)


@pytest.mark.parametrize("key", sorted(SWITCHES))
def test_an_adam_switch_out_of_range_is_refused_as_1_16_3s_class(traces: dict, key: str) -> None:
    peer, _ = traces[key]
    assert peer.error is not None and f"{key}" in peer.error, peer.error  # (its kernel's check)
    expected = peer.error.split(":", 1)[0]
    p = onnxtrain.TrainingParameters()
    for k, v in _params("AdamOptimizer", set(MLP_WEIGHTS)).items():
        setattr(p, k, v)
    p.optimizer_int_attributes_map = {**p.optimizer_int_attributes_map, "W2": {key: SWITCHES[key]}}
    with pytest.raises(Exception) as caught:
        onnxtrain.TrainingSession(mlp().SerializeToString(), p)
    classes = [c.__name__ for c in type(caught.value).__mro__]
    assert expected in classes, (expected, classes)
    assert "ValueError" in classes and "Fail" in classes  # (what onnxtrain raised before, kept)
    assert f"optimizer_int_attributes_map['W2'][{key!r}] must be 0 or 1, got 2" in str(caught.value)


def _op_chains() -> dict[str, object]:
    """Small models over more gradient rules, each to a scalar loss; trained A, C [12, 12], B [12], D [12],
    E [20, 12] (each above 8 values: 1.16.3's ConstantSharing); x [4, 12] ([4, 12, 12] for the Gather)."""
    n = helper.make_node
    chains = {
        "gather_where_clip": [
            n("Gather", ["E", "idx"], ["g"]), n("MatMul", ["g", "A"], ["m"]),
            n("Greater", ["m", "zero"], ["c"]), n("Where", ["c", "m", "x"], ["w"]),
            n("Clip", ["w", "lo", "hi"], ["cl"]), n("Mul", ["cl", "B"], ["o"]),
            n("ReduceMean", ["o"], ["loss"], keepdims=0)],
        "slice_split_concat": [
            n("MatMul", ["x", "A"], ["m"]), n("Slice", ["m", "s0", "s1", "ax1"], ["sl"]),
            n("Split", ["m"], ["p1", "p2"], axis=1, num_outputs=2),
            n("Concat", ["p2", "sl", "p1"], ["cc"], axis=1),
            n("Mul", ["cc", "cc"], ["q"]), n("ReduceSum", ["q"], ["loss"], keepdims=0)],
        "expand_tile_pad": [
            n("Unsqueeze", ["D", "ax0"], ["du"]), n("Expand", ["du", "shp"], ["ex"]),
            n("MatMul", ["x", "A"], ["m"]), n("Mul", ["m", "ex"], ["me"]), n("Tile", ["me", "reps"], ["ti"]),
            n("Pad", ["ti", "pads"], ["pd"]),
            n("LeakyRelu", ["pd"], ["lr"], alpha=0.1), n("ReduceMean", ["lr"], ["r"], keepdims=0),
            n("Mul", ["r", "r"], ["loss"])],
        "pool_lse_l2": [
            n("MatMul", ["x", "A"], ["m"]), n("Reshape", ["m", "s4"], ["m4"]),
            n("AveragePool", ["m4"], ["ap"], kernel_shape=[2, 2]), n("GlobalAveragePool", ["m4"], ["gp"]),
            n("ReduceLogSumExp", ["ap"], ["lse"], keepdims=0), n("ReduceL2", ["gp"], ["l2"], keepdims=0),
            n("Add", ["lse", "l2"], ["s"]), n("ReduceSum", ["s"], ["loss"], keepdims=0)],
        "reciprocal_cos_cast": [
            n("MatMul", ["x", "A"], ["m"]), n("Mul", ["m", "m"], ["mm"]), n("Add", ["mm", "one"], ["m1"]),
            n("Reciprocal", ["m1"], ["rc"]), n("Cos", ["m"], ["cs"]), n("Add", ["rc", "cs"], ["rcs"]),
            n("Add", ["rcs", "B"], ["sm"]), n("Cast", ["sm"], ["cd"], to=TensorProto.DOUBLE),
            n("Cast", ["cd"], ["cf"], to=TensorProto.FLOAT), n("MatMul", ["cf", "C"], ["f"]),
            n("ReduceMean", ["f"], ["loss"], keepdims=0)],
        "gather_elements_topk": [
            n("MatMul", ["x", "A"], ["m"]), n("TopK", ["m", "k"], ["tv", "ti"], axis=1),
            n("GatherElements", ["m", "gi"], ["ge"], axis=1), n("ReduceSum", ["tv"], ["a"], keepdims=0),
            n("ReduceSum", ["ge"], ["b"], keepdims=0), n("Mul", ["a", "b"], ["loss"])],
    }
    rng = np.random.default_rng(5)
    weights = {"A": rng.standard_normal((12, 12)) * 0.3, "B": rng.standard_normal(12),
               "C": rng.standard_normal((12, 12)) * 0.3, "D": rng.standard_normal(12),
               "E": rng.standard_normal((20, 12)) * 0.5}
    consts = {"idx": np.array([[1, 3, 3, 19, 0, 1, 2, 5, 5, 5, 7, 8]] * 4, np.int64),
              "zero": np.array(0.0, np.float32), "lo": np.array(-0.5, np.float32),
              "hi": np.array(0.7, np.float32),
              "s0": np.array([2], np.int64), "s1": np.array([9], np.int64), "ax1": np.array([1], np.int64),
              "ax0": np.array([0], np.int64), "shp": np.array([4, 12], np.int64),
              "reps": np.array([2, 1], np.int64),
              "pads": np.array([1, 0, 0, 2], np.int64), "s4": np.array([4, 1, 3, 4], np.int64),
              "one": np.array(1.0, np.float32), "k": np.array([3], np.int64),
              "gi": np.array([[0, 5, 5], [1, 2, 11], [3, 3, 3], [10, 0, 4]], np.int64)}
    cases = {}
    for name, nodes in chains.items():
        used = {i for node in nodes for i in node.input}
        inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items() if k in used]
        inits += [numpy_helper.from_array(v, k) for k, v in consts.items() if k in used]
        shape = [4, 12, 12] if name.startswith("gather_where") else [4, 12]
        g = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
        trained = sorted(k for k in weights if k in used)
        params = {"loss_output_name": "loss", "training_optimizer_name": "SGDOptimizer",
                  "weights_to_train": set(trained), "optimizer_attributes_map": {w: {} for w in trained},
                  "optimizer_int_attributes_map": {w: {} for w in trained}}
        feeds = np.random.default_rng(2)
        steps = [Step({"x": feeds.standard_normal(shape).astype(np.float32),
                       "Learning_Rate": np.array([lr], np.float32)}) for lr in (0.1, 0.05, 0.2)]
        cases[name] = Case(model, params, steps)
    return cases


@pytest.fixture(scope="module")
def op_traces() -> dict:
    cases = _op_chains()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peer, ours = run_cases(list(cases.values()))
    return dict(zip(cases, zip(peer, ours)))


@pytest.mark.parametrize("name", ["gather_where_clip", "slice_split_concat", "expand_tile_pad", "pool_lse_l2",
                                  "reciprocal_cos_cast", "gather_elements_topk"])
def test_more_gradient_rules_step_as_1_16_3s(op_traces: dict, name: str) -> None:
    peer, ours = op_traces[name]
    _compare(name, peer, ours)
    assert len(peer.state) == 3 and peer.state[2]  # (three steps compared)


# test_legacy_ort116_numerics' cases 1.16.3 refuses or gets wrong (its own tests say which), and those whose
# comparison there is not step by step
_NOT_STEPWISE = {"peer_prepacked", "peer_default_order", "peer_nchwc", "lamb", "sgd_accumulation",
                 "adam_accumulation", "sgd_mixed_precision", "adam_mixed_precision", "vector_loss",
                 "small_bias",
                 "adam_fp16_moments", "adam_clip_gpu_semantics", "dropout_training_mode_false",
                 "cnn_bn_running_statistics", "adam_mse_opset9"}


@pytest.fixture(scope="module")
def backend_traces() -> dict:
    from tests.session import test_legacy_ort116_numerics as numerics

    cases = {k: c for k, c in numerics._cases().items() if k not in _NOT_STEPWISE}
    for c in cases.values():
        c.ours_config = {"onnxtrain.backend": "onnxruntime"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peer, ours = run_cases(list(cases.values()))
    return dict(zip(cases, zip(peer, ours)))


def test_the_onnxruntime_backend_steps_as_1_16_3s(backend_traces: dict) -> None:
    assert len(backend_traces) >= 40
    for name, (peer, ours) in backend_traces.items():
        _compare(name, peer, ours)


@pytest.mark.parametrize("case", sorted(LR_NAMES))
def test_a_learning_rate_feed_named_like_a_value_of_the_training_graph_is_refused(traces: dict,
                                                                                   case: str) -> None:
    peer, ours = traces[case]
    name, refused = LR_NAMES[case][2], LR_NAMES[case][3]
    if not refused:  # (a name the session adds in other configurations only: free, as in 1.16.3)
        _compare(case, peer, ours)
        return
    assert peer.error is not None and f"Duplicate definition of name ({name})" in peer.error, peer.error
    assert ours.error is not None, f"{case}: onnxtrain made the session"
    assert ours.error.startswith("FailValueError"), ours.error  # (a Fail, as 1.16.3's)
    assert f"lr_params_feed_name {name!r}" in ours.error and "training graph" in ours.error, ours.error
