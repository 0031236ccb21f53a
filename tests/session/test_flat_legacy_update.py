"""The legacy session's update over flat buffers on the onnxruntime backend (``onnxtrain/session_flat.py``):
the same bits as the per-weight update graph (``onnxtrain.flat_update = "0"``) step by step, losses and
state, with the numpy engine (which runs the single step graph) as a second reference within float32
rounding, and torch's float64 Adam steps as the independent oracle; the steps
whose step counts differ, a state loaded between steps, and the settings that keep the per-weight graph."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import onnxtrain
from onnxtrain import session_flat, session_halves
from tests.session.helpers import mlp_model, params

pytest.importorskip("onnxruntime")


def _session(backend: str, opt: str, flat: str = "1", maps: dict | None = None,
             **kw) -> onnxtrain.TrainingSession:
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", backend)
    so.add_session_config_entry("onnxtrain.flat_update", flat)
    p = params(opt, **{"enable_grad_norm_clip": False, **kw})
    for attr, value in (maps or {}).items():
        setattr(p, attr, value)
    model = mlp_model(din=12, dh=20, dout=5)  # W1 240 values, b1 20, W2 100, b2 5
    return onnxtrain.TrainingSession(model.SerializeToString(), p, so)


def _train(sess: onnxtrain.TrainingSession, steps: int, seed: int = 5) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        feeds = {"x": rng.standard_normal((6, 12)).astype(np.float32),
                 "y": rng.integers(0, 5, 6).astype(np.int64),
                 "Learning_Rate": np.array([0.05], np.float32)}
        out.append(sess.run(["loss", "logits"], feeds))
    return out


def _same(a: onnxtrain.TrainingSession, b: onnxtrain.TrainingSession, got: list, want: list) -> None:
    for x, y in zip(got, want):
        for u, v in zip(x, y):
            np.testing.assert_array_equal(u, v)
    sa, sb = a.get_state(), b.get_state()
    assert sa.keys() == sb.keys()
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)


def _close_to_numpy(sess: onnxtrain.TrainingSession, got: list, opt: str, maps: dict | None = None,
                    **kw) -> None:
    """The session's losses, logits and state within float32 rounding of the numpy engine's, at the scale of
    each array (rtol 1e-5, atol 1e-5 of its largest value): a logit is a sum of terms the size of the largest
    ones, so a small one carries their rounding. Two float32 runs of onnxruntime's and OpenBLAS's kernels part
    by a few epsilons of that scale over the steps (AMD EPYC, Adam without bias correction: 2.9e-6 on a logit
    of 0.067 among logits up to 8.4, each run within 3.4 epsilons of its terms' magnitude of torch's float64
    steps, :func:`test_adam_steps_as_torch_float64`), which an absolute 1e-6 did not allow."""
    ref = _session("numpy", opt, maps=maps, **kw)
    want = _train(ref, len(got))
    for x, y in zip(got, want):
        for u, v in zip(x, y):
            np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5 * np.abs(v).max())
    sa, sr = sess.get_state(), ref.get_state()
    for k in sr:
        np.testing.assert_allclose(sa[k], sr[k], rtol=1e-5, atol=1e-5 * np.abs(sr[k]).max(), err_msg=k)


ADAM_MAPS = {  # the weights fall into two attribute sets: W1 and b1, W2 and b2
    "AdamOptimizer": {
        "optimizer_attributes_map": {"W1": {"lambda": 0.01}, "b1": {"lambda": 0.01},
                                     "W2": {"alpha": 0.8}, "b2": {"alpha": 0.8}},
        "optimizer_int_attributes_map": {w: {"weight_decay_mode": 1} for w in ("W1", "b1", "W2", "b2")},
    },
}


STEP_CASES = [
    ("AdamOptimizer", None, {}, [4]),
    ("AdamOptimizer", ADAM_MAPS["AdamOptimizer"], {}, [2, 2]),
    ("AdamOptimizer", {"optimizer_int_attributes_map": {w: {"do_bias_correction": 0}
                                                        for w in ("W1", "b1", "W2", "b2")}}, {}, [4]),
    ("AdamOptimizer", None, {"use_fp16_moments": True}, [4]),
    ("SGDOptimizer", None, {}, [4]),
    ("AdamOptimizer", None, {"enable_grad_norm_clip": True}, [4]),
    ("AdamOptimizer", {"optimizer_attributes_map": {"W1": {"max_norm_clip": 0.5},
                                                    "b1": {"max_norm_clip": 0.5}, "W2": {}, "b2": {}}},
     {"enable_grad_norm_clip": True}, [2, 2]),
    ("AdamOptimizer", None, {"enable_grad_norm_clip": True, "legacy_cpu_adam": True}, [4]),
    ("SGDOptimizer", None, {"enable_grad_norm_clip": True}, [4]),
    ("AdamOptimizer", None, {"gradient_accumulation_steps": 3}, [4]),
    ("AdamOptimizer", None, {"gradient_accumulation_steps": 2, "gradient_accumulation_mode": "auto",
                             "enable_grad_norm_clip": True}, [4]),
]
STEP_IDS = ["adam", "adam-two-attribute-sets", "adam-no-bias-correction", "adam-fp16-moments", "sgd",
            "adam-clipped", "adam-clipped-two-max-norms", "adam-clipped-cpu-kernel", "sgd-clip-flag",
            "adam-accumulating-3", "adam-accumulating-2-auto-clipped"]


@pytest.mark.parametrize("opt,maps,kw,groups", STEP_CASES, ids=STEP_IDS)
def test_the_flat_update_steps_as_the_per_weight_graph(opt: str, maps: dict | None, kw: dict,
                                                       groups: list[int]) -> None:
    flat = _session("onnxruntime", opt, maps=maps, **kw)
    assert flat._flat is not None and [len(g.weights) for g in flat._flat.groups] == groups
    perw = _session("onnxruntime", opt, flat="0", maps=maps, **kw)
    assert perw._halves and perw._flat is None
    got = _train(flat, 6)
    _same(flat, perw, got, _train(perw, 6))
    assert "update" not in flat._plans  # the per-weight graph was never needed
    _close_to_numpy(flat, got, opt, maps, **kw)
    assert got[-1][0] != got[0][0]  # it trained


@pytest.mark.parametrize("correct", [True, False], ids=["bias-correction", "no-bias-correction"])
def test_adam_steps_as_torch_float64(correct: bool) -> None:
    """The flat update's Adam steps on the onnxruntime backend against the same MLP and Adam in torch float64
    (onnxruntime-training's AdamOptimizer: α, β as float32 holds them, ε 1e-8 added to sqrt(m2), bias
    correction on or off): each step's logits within 16 float32 epsilons of their terms' magnitude
    (Σ|h||W2| + |b2|; measured up to 3.4), the loss and the last weights within 16 epsilons of the largest
    logit's and weight's magnitude. Bias correction applied where it is off misses by 1e5 epsilons."""
    torch = pytest.importorskip("torch")
    from onnx import numpy_helper

    maps = None if correct else {"optimizer_int_attributes_map": {w: {"do_bias_correction": 0}
                                                                  for w in ("W1", "b1", "W2", "b2")}}
    flat = _session("onnxruntime", "AdamOptimizer", maps=maps)
    assert flat._flat is not None
    got = _train(flat, 6)
    eps = float(np.finfo(np.float32).eps)
    weights = {t.name: torch.tensor(numpy_helper.to_array(t), dtype=torch.float64, requires_grad=True)
               for t in mlp_model(din=12, dh=20, dout=5).graph.initializer}
    m1 = {k: torch.zeros_like(v) for k, v in weights.items()}
    m2 = {k: torch.zeros_like(v) for k, v in weights.items()}
    alpha, beta, lr = (float(np.float32(v)) for v in (0.9, 0.999, 0.05))
    rng = np.random.default_rng(5)  # _train's batches
    for t, (loss, logits) in enumerate(got, start=1):
        x = torch.tensor(rng.standard_normal((6, 12)).astype(np.float32), dtype=torch.float64)
        y = torch.tensor(rng.integers(0, 5, 6).astype(np.int64))
        h = torch.relu(x @ weights["W1"].T + weights["b1"])
        want = h @ weights["W2"].T + weights["b2"]
        scale = (h.abs() @ weights["W2"].abs().T + weights["b2"].abs()).detach().numpy()
        off = np.abs(logits - want.detach().numpy()) / (eps * scale)
        assert off.max() <= 16, f"step {t}: a logit {off.max():.3g} epsilons of its terms' magnitude off"
        want_loss = torch.nn.functional.cross_entropy(want, y)
        assert abs(float(loss) - want_loss.item()) <= 16 * eps * scale.max(), t
        grads = torch.autograd.grad(want_loss, list(weights.values()))
        with torch.no_grad():
            for (k, w), g in zip(weights.items(), grads):
                m1[k] = alpha * m1[k] + (1 - alpha) * g
                m2[k] = beta * m2[k] + (1 - beta) * g * g
                c1, c2 = (1 - alpha ** t, 1 - beta ** t) if correct else (1.0, 1.0)
                w -= lr * (m1[k] / c1) / (torch.sqrt(m2[k] / c2) + 1e-8)
    state = flat.get_state()
    for k, w in weights.items():
        w64 = w.detach().numpy()
        np.testing.assert_allclose(state[k], w64, rtol=0, atol=16 * eps * np.abs(w64).max(), err_msg=k)


def test_a_large_weight_keeps_its_own_arrays(monkeypatch) -> None:
    monkeypatch.setattr(session_flat, "SINGLE_MIN", 200)  # W1 (240 values) is "large"
    flat = _session("onnxruntime", "AdamOptimizer")
    assert [(sorted(g.weights), g.merged) for g in flat._flat.groups] == [(["W1"], False),
                                                                           (["W2", "b1", "b2"], True)]
    perw = _session("onnxruntime", "AdamOptimizer", flat="0")
    got = _train(flat, 4)
    _same(flat, perw, got, _train(perw, 4))
    # the merged weights and moments are views of the group's buffers; the large weight is not
    store = flat._store
    merged = flat._flat.groups[1]
    assert all(np.shares_memory(store[w], merged.flat) for w in merged.weights)
    assert all(np.shares_memory(store[f"Moment_2_{w}"], merged.buffers["Moment_2"]) for w in merged.weights)
    assert not any(np.shares_memory(store["W1"], g.flat) for g in flat._flat.groups if g.merged)


def test_a_step_whose_counts_differ_runs_the_per_weight_graph() -> None:
    flat = _session("onnxruntime", "AdamOptimizer")
    perw = _session("onnxruntime", "AdamOptimizer", flat="0")
    got, want = _train(flat, 2), _train(perw, 2)
    state = perw.get_state()
    state["Update_Count_b2"] = np.array([7], np.int64)  # one small weight's count apart from the others'
    for s in (flat, perw):
        s.load_state(state)
    assert not flat._flat.applies(flat._store)
    got += _train(flat, 3, seed=6)
    assert "update" in flat._plans
    want += _train(perw, 3, seed=6)
    _same(flat, perw, got, want)
    assert flat.get_state()["Update_Count_b2"][0] == 10 and flat.get_state()["Update_Count_W1"][0] == 6


def test_a_state_loaded_between_steps_is_copied_into_the_buffers() -> None:
    flat = _session("onnxruntime", "AdamOptimizer")
    perw = _session("onnxruntime", "AdamOptimizer", flat="0")
    _train(flat, 2)
    _train(perw, 3, seed=9)
    state = perw.get_state()  # another run's weights, moments and counts
    flat.load_state(state)
    assert flat._flat.applies(flat._store)
    got, want = _train(flat, 3, seed=7), _train(perw, 3, seed=7)
    _same(flat, perw, got, want)
    # get_state hands out copies: changing them leaves the session's buffers alone
    copy = flat.get_state()
    copy["b1"][:] = 123.0
    assert not np.any(flat.get_state()["b1"] == 123.0)


@pytest.mark.parametrize("opt,kw", [
    ("AdamOptimizer", {"use_mixed_precision": True}),
    ("LambOptimizer", {}),
], ids=["mixed-precision", "lamb"])
@pytest.mark.filterwarnings("ignore:the onnxruntime backend")
def test_steps_the_flat_update_does_not_take(opt: str, kw: dict) -> None:
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    p = params(opt, **{"enable_grad_norm_clip": False, **kw})
    sess = onnxtrain.TrainingSession(mlp_model(din=12, dh=20, dout=5).SerializeToString(), p, so)
    assert sess._halves and sess._flat is None


def test_the_numpy_engine_keeps_its_single_step_graph_for_few_merged_weights() -> None:
    sess = _session("numpy", "AdamOptimizer")  # 4 weights: under NUMPY_MIN_MERGED
    assert not sess._halves and sess._flat is None and "full" in sess._plans


@pytest.mark.parametrize("opt,maps,kw,groups", STEP_CASES, ids=STEP_IDS)
def test_the_numpy_engine_steps_in_halves_as_its_single_graph(monkeypatch, opt: str, maps: dict | None,
                                                              kw: dict, groups: list[int]) -> None:
    """With many merged weights the numpy engine runs the gradients graph and the flat update: the same bits
    as its single step graph (``onnxtrain.flat_update = "0"``), step by step, losses, logits and state."""
    monkeypatch.setattr(session_halves, "NUMPY_MIN_MERGED", 2)
    halves = _session("numpy", opt, maps=maps, **kw)
    assert halves._halves and [len(g.weights) for g in halves._flat.groups] == groups
    single = _session("numpy", opt, flat="0", maps=maps, **kw)
    assert not single._halves and single._flat is None
    got = _train(halves, 6)
    _same(halves, single, got, _train(single, 6))
    assert "full" not in halves._plans and "update" not in halves._plans  # neither was needed
    assert got[-1][0] != got[0][0]  # it trained


def _deep_mlp(layers: int) -> onnx.ModelProto:
    """x[N, 6] → (Gemm 6×6, Relu) × layers → Gemm 6×3 → SoftmaxCrossEntropyLoss: 2·layers + 2 weights (W0
    also declared as a graph input: a feed may override it)."""
    from onnx import TensorProto as T
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(8)
    inits, nodes, h = [], [], "x"
    for i in range(layers + 1):
        dout = 3 if i == layers else 6
        inits += [numpy_helper.from_array((rng.standard_normal((dout, 6)) * 0.5).astype(np.float32), f"W{i}"),
                  numpy_helper.from_array((rng.standard_normal(dout) * 0.1).astype(np.float32), f"b{i}")]
        nodes.append(helper.make_node("Gemm", [h, f"W{i}", f"b{i}"], [f"g{i}"], transB=1))
        h = f"g{i}"
        if i < layers:
            nodes.append(helper.make_node("Relu", [h], [f"r{i}"]))
            h = f"r{i}"
    nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", [h, "y"], ["loss"]))
    g = helper.make_graph(nodes, "deep_mlp", [helper.make_tensor_value_info("x", T.FLOAT, ["N", 6]),
                                              helper.make_tensor_value_info("y", T.INT64, ["N"]),
                                              helper.make_tensor_value_info("W0", T.FLOAT, [6, 6])],
                          [helper.make_tensor_value_info("loss", T.FLOAT, [])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _deep_session(flat: str = "1", **kw) -> onnxtrain.TrainingSession:
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.flat_update", flat)
    p = params("AdamOptimizer", **{"enable_grad_norm_clip": False, **kw})
    return onnxtrain.TrainingSession(_deep_mlp(8).SerializeToString(), p, so)  # 18 weights


def _deep_feeds(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"x": rng.standard_normal((5, 6)).astype(np.float32), "y": rng.integers(0, 3, 5).astype(np.int64),
            "Learning_Rate": np.array([0.02], np.float32)}


def test_the_numpy_engine_steps_in_halves_with_many_small_weights() -> None:
    halves, single = _deep_session(), _deep_session(flat="0")
    assert session_halves.NUMPY_MIN_MERGED <= 18
    assert halves._halves and [len(g.weights) for g in halves._flat.groups] == [18]
    rng = np.random.default_rng(0)
    for _ in range(5):
        feeds = _deep_feeds(rng)
        np.testing.assert_array_equal(halves.run(["loss"], feeds)[0], single.run(["loss"], feeds)[0])
    _same(halves, single, [], [])


def test_a_numpy_run_feeding_a_trained_weight_runs_the_single_graph() -> None:
    """onnxruntime 1.16.3's override of a trained weight by a feed (the run computes with the fed value, the
    weight stays, its moments are updated) holds where the numpy engine steps in halves: that run takes the
    single graph, and the next steps the halves again, on the same state."""
    halves, single = _deep_session(), _deep_session(flat="0")
    assert halves._halves and "W0" in halves._fed_weights
    rng = np.random.default_rng(1)
    for step in range(4):
        feeds = _deep_feeds(rng)
        if step == 1:
            feeds["W0"] = np.full((6, 6), 0.25, np.float32)
        np.testing.assert_array_equal(halves.run(["loss"], feeds)[0], single.run(["loss"], feeds)[0])
    assert "full" in halves._plans
    _same(halves, single, [], [])


def test_numpy_halves_fetch_gradients_and_the_norm() -> None:
    kw = {"set_gradients_as_graph_outputs": True, "enable_grad_norm_clip": True}
    halves, single = _deep_session(**kw), _deep_session(flat="0", **kw)
    assert halves._halves
    rng = np.random.default_rng(2)
    for step in range(4):
        fetch = ["loss", "W0_grad", "b8_grad"] + (["global_gradient_norm"] if step == 2 else [])
        feeds = _deep_feeds(rng)
        for name, a, b in zip(fetch, halves.run(fetch, feeds), single.run(fetch, feeds)):
            np.testing.assert_array_equal(a, b, err_msg=name)
    _same(halves, single, [], [])


def test_a_bad_flat_update_entry_is_named() -> None:
    with pytest.raises(ValueError, match="onnxtrain.flat_update"):
        _session("onnxruntime", "AdamOptimizer", flat="yes")


@pytest.mark.parametrize("clip", [False, True])
def test_the_flat_update_graph_is_valid_onnx(clip: bool) -> None:
    sess = _session("onnxruntime", "AdamOptimizer", maps=ADAM_MAPS["AdamOptimizer"],
                    enable_grad_norm_clip=clip)
    model = sess._flat.model
    inputs = [v.name for v in model.graph.input]
    assert sorted(n for n in inputs if n.startswith("onnxtrain_flat_")) == [
        "onnxtrain_flat_float32_0", "onnxtrain_flat_float32_0_grad",
        "onnxtrain_flat_float32_1", "onnxtrain_flat_float32_1_grad"]
    # clipped: the norm is computed from every weight's own gradient, each an input of the graph
    assert all((f"{w}_grad" in inputs) == clip for w in ("W1", "b1", "W2", "b2"))
    onnx.checker.check_model(model, full_check=True)


def test_fetched_gradients_are_the_steps_own() -> None:
    """With ``set_gradients_as_graph_outputs`` a run fetches the gradients the flat update read (copies: the
    group's gradient buffer is written again by the next step)."""
    kw = {"set_gradients_as_graph_outputs": True}
    flat = _session("onnxruntime", "AdamOptimizer", **kw)
    perw = _session("onnxruntime", "AdamOptimizer", flat="0", **kw)
    assert flat._flat is not None
    rng = np.random.default_rng(3)
    fetch = ["loss", "W1_grad", "b1_grad", "W2_grad", "b2_grad"]
    first: list | None = None
    for _ in range(3):
        feeds = {"x": rng.standard_normal((6, 12)).astype(np.float32),
                 "y": rng.integers(0, 5, 6).astype(np.int64),
                 "Learning_Rate": np.array([0.05], np.float32)}
        got, want = flat.run(fetch, feeds), perw.run(fetch, feeds)
        for name, a, b in zip(fetch, got, want):
            np.testing.assert_array_equal(a, b, err_msg=name)
        if first is None:
            first, kept = got, [a.copy() for a in got]
    for a, b in zip(first, kept):  # later steps left the first step's fetched arrays alone
        np.testing.assert_array_equal(a, b)
    _same(flat, perw, [], [])


def test_a_run_fetching_the_norm_runs_the_per_weight_graph() -> None:
    """The global norm is an output of the per-weight update graph only: a run that fetches it takes that
    graph, and the next steps go back to the flat one, on the same state."""
    flat = _session("onnxruntime", "AdamOptimizer", enable_grad_norm_clip=True)
    perw = _session("onnxruntime", "AdamOptimizer", flat="0", enable_grad_norm_clip=True)
    assert flat._flat is not None and flat._flat.per_weight_grads
    rng = np.random.default_rng(11)
    for step in range(4):
        fetch = ["loss", "global_gradient_norm"] if step == 1 else ["loss"]
        feeds = {"x": rng.standard_normal((6, 12)).astype(np.float32),
                 "y": rng.integers(0, 5, 6).astype(np.int64),
                 "Learning_Rate": np.array([0.05], np.float32)}
        got, want = flat.run(fetch, feeds), perw.run(fetch, feeds)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
    assert "update" in flat._plans
    _same(flat, perw, [], [])


def _two_dtype_model() -> onnx.ModelProto:
    """float32 weights W32, b32 before a Cast, float64 weights W64, b64 after it; loss = Σ h²."""
    from onnx import TensorProto as T
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(rng.standard_normal((3, 2)).astype(np.float32), "W32"),
             numpy_helper.from_array(rng.standard_normal(2).astype(np.float32), "b32"),
             numpy_helper.from_array(rng.standard_normal(2), "W64"),
             numpy_helper.from_array(rng.standard_normal(2), "b64")]
    nodes = [helper.make_node("MatMul", ["x", "W32"], ["h"]), helper.make_node("Add", ["h", "b32"], ["h2"]),
             helper.make_node("Cast", ["h2"], ["hd"], to=T.DOUBLE),
             helper.make_node("Mul", ["hd", "W64"], ["h3"]), helper.make_node("Add", ["h3", "b64"], ["h4"]),
             helper.make_node("ReduceSumSquare", ["h4"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "two_dtypes", [helper.make_tensor_value_info("x", T.FLOAT, [4, 3])],
                          [helper.make_tensor_value_info("loss", T.DOUBLE, [])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("clip", [False, True])
def test_weights_of_two_dtypes_make_two_groups(clip: bool) -> None:
    sessions = {}
    for backend, flat in (("onnxruntime", "1"), ("onnxruntime", "0"), ("numpy", "1")):
        so = onnxtrain.SessionOptions()
        so.add_session_config_entry("onnxtrain.backend", backend)
        so.add_session_config_entry("onnxtrain.flat_update", flat)
        p = params("AdamOptimizer", enable_grad_norm_clip=clip)
        sessions[backend, flat] = onnxtrain.TrainingSession(_two_dtype_model().SerializeToString(), p, so)
    flat, perw, ref = sessions.values()
    assert [(sorted(g.weights), g.dtype.name) for g in flat._flat.groups] == [(["W32", "b32"], "float32"),
                                                                              (["W64", "b64"], "float64")]
    rng = np.random.default_rng(4)
    for _ in range(4):
        feeds = {"x": rng.standard_normal((4, 3)).astype(np.float32),
                 "Learning_Rate": np.array([0.1], np.float32)}
        got, want, close = flat.run(["loss"], feeds), perw.run(["loss"], feeds), ref.run(["loss"], feeds)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_allclose(got[0], close[0], rtol=1e-6)
    _same(flat, perw, [], [])
    state = flat.get_state()
    assert state["W64"].dtype == np.float64 and state["Moment_1_W64"].dtype == np.float64


def test_numpy_halves_with_batchnorm_and_dropout_as_the_single_graph() -> None:
    """A torch export with BatchNorm (running statistics updated by the step) and Dropout (a seeded draw each
    step) over 34 small weights: the halves and the single graph give the same losses, weights, moments and
    running statistics, bit for bit."""
    import io
    import warnings

    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layers = []
            for _ in range(8):
                layers += [torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(),
                           torch.nn.Dropout(0.2)]
            self.body = torch.nn.Sequential(*layers, torch.nn.Linear(6, 3))

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.body(x), y)

    torch.manual_seed(0)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Net().train(), (torch.randn(5, 6), torch.randint(0, 3, (5,))), f,
                          input_names=["x", "y"], output_names=["loss"], opset_version=15, dynamo=False,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    runs = {}
    for flat in ("1", "0"):
        so = onnxtrain.SessionOptions()
        so.add_session_config_entry("onnxtrain.flat_update", flat)
        onnxtrain.set_seed(7)
        p = params("AdamOptimizer", enable_grad_norm_clip=True)
        sess = onnxtrain.TrainingSession(f.getvalue(), p, so)
        assert sess._halves == (flat == "1")
        rng = np.random.default_rng(3)
        losses = [sess.run(["loss"], {"x": rng.standard_normal((5, 6)).astype(np.float32),
                                      "y": rng.integers(0, 3, 5).astype(np.int64),
                                      "Learning_Rate": np.array([0.05], np.float32)})[0] for _ in range(4)]
        runs[flat] = (sess, losses)
    (halves, got), (single, want) = runs["1"], runs["0"]
    assert len(halves._flat.groups) == 1 and len(halves._flat.groups[0].weights) == 34
    state = halves.get_state()
    assert any("running_mean" in k for k in state) and not np.all(state[next(
        k for k in state if "running_mean" in k)] == 0)
    _same(halves, single, [got], [want])


def _deep_mlp_passing(weights: list[str]) -> onnx.ModelProto:
    """:func:`_deep_mlp` with one more output per weight of ``weights``: ``<w>_out``, an Identity of it."""
    from onnx import helper

    model = _deep_mlp(8)
    g = model.graph
    shapes = {t.name: list(t.dims) for t in g.initializer}
    for w in weights:
        g.node.append(helper.make_node("Identity", [w], [f"{w}_out"]))
        g.output.append(helper.make_tensor_value_info(f"{w}_out", onnx.TensorProto.FLOAT, shapes[w]))
    return model


@pytest.mark.parametrize("single_min", [None, 30], ids=["all-merged", "large-weights-apart"])
def test_numpy_halves_outputs_passing_a_weight_are_the_callers(monkeypatch, single_min) -> None:
    """A model output that passes a trained weight through (an Identity) is the weight before the step, as the
    single graph gives it, and stays so: the update writes the merged weights into the group's buffer (and
    a weight of its own into its donated array), not into the array the caller got."""
    from onnx import numpy_helper

    monkeypatch.setattr(session_halves, "NUMPY_MIN_MERGED", 2)
    if single_min is not None:
        monkeypatch.setattr(session_flat, "SINGLE_MIN", single_min)  # the 6x6 weights keep their arrays
    model = _deep_mlp_passing(["b3", "W8", "W2"])
    initial = {t.name: numpy_helper.to_array(t).copy() for t in model.graph.initializer}
    sessions = []
    for flat in ("1", "0"):
        so = onnxtrain.SessionOptions()
        so.add_session_config_entry("onnxtrain.flat_update", flat)
        p = params("AdamOptimizer", enable_grad_norm_clip=False)
        sessions.append(onnxtrain.TrainingSession(model.SerializeToString(), p, so))
    halves, single = sessions
    assert halves._halves and not single._halves
    names = ["loss", "b3_out", "W8_out", "W2_out"]
    rng = np.random.default_rng(4)
    got, want = [], []
    for _ in range(3):
        feeds = _deep_feeds(rng)
        got.append(halves.run(names, feeds))
        want.append(single.run(names, feeds))
    for w in ("b3", "W8", "W2"):  # the first step's outputs: the initial weights (still)
        np.testing.assert_array_equal(got[0][names.index(f"{w}_out")], initial[w], err_msg=w)
    for step, (a, b) in enumerate(zip(got, want)):
        for name, u, v in zip(names, a, b):
            np.testing.assert_array_equal(u, v, err_msg=f"step {step}: {name}")
    _same(halves, single, [], [])


def test_numpy_halves_make_no_gradient_arrays_for_the_backend(monkeypatch) -> None:
    """The numpy engine's kernels allocate the gradients: its steps in halves make no zero arrays of the
    weights' shapes for onnxruntime's ``reuse`` (they were made at every step and held through it)."""
    halves = _deep_session()
    assert halves._halves
    rng = np.random.default_rng(5)
    halves.run(["loss"], _deep_feeds(rng))
    store = halves._store
    made = []
    zeros_like = np.zeros_like

    def counting(a, *args, **kw):
        if any(a is store[w] for w in halves._graphs.trainable):
            made.append(a.shape)
        return zeros_like(a, *args, **kw)

    monkeypatch.setattr(np, "zeros_like", counting)
    halves.run(["loss"], _deep_feeds(rng))
    assert made == []


def test_numpy_halves_after_loads_as_the_single_graph(monkeypatch) -> None:
    """The numpy engine in halves after load_state between steps: a state whose merged step counts differ
    (the per-weight update graph runs, donating the weights that own their arrays while the others are views
    of the group's buffers), then another run's state (copied into the buffers): the single graph's bits."""
    monkeypatch.setattr(session_halves, "NUMPY_MIN_MERGED", 2)
    halves, single = _session("numpy", "AdamOptimizer"), _session("numpy", "AdamOptimizer", flat="0")
    assert halves._halves and not single._halves
    got, want = _train(halves, 2), _train(single, 2)
    state = single.get_state()
    state["Update_Count_b2"] = np.array([7], np.int64)
    for s in (halves, single):
        s.load_state(state)
    assert not halves._flat.applies(halves._store)
    got += _train(halves, 3, seed=6)
    want += _train(single, 3, seed=6)
    assert "update" in halves._plans
    _same(halves, single, got, want)
    other = _session("numpy", "AdamOptimizer", flat="0")
    _train(other, 3, seed=9)
    for s in (halves, single):
        s.load_state(other.get_state())
    assert halves._flat.applies(halves._store)
    _same(halves, single, _train(halves, 3, seed=7), _train(single, 3, seed=7))


@pytest.mark.parametrize("backend", ["onnxruntime", "numpy"])
def test_step_counts_stay_in_the_sessions_arrays(monkeypatch, backend: str) -> None:
    """The flat update's new step counts are written into the session's own count arrays (on the backend
    from arrays the update keeps, so that every output of its run has an array and its binding stays from
    step to step), with the per-weight graph's bits; arrays handed out before (get_state's, the optimizer's
    initial state given by the caller) keep their values."""
    if backend == "numpy":
        monkeypatch.setattr(session_halves, "NUMPY_MIN_MERGED", 2)
    monkeypatch.setattr(session_flat, "SINGLE_MIN", 200)  # W1 keeps its arrays: a group of one, a merged one
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", backend)
    p = params("AdamOptimizer", enable_grad_norm_clip=False)
    given = {"W1": {"Update_Count": np.array([3], np.int64)}, "b2": {"Update_Count": np.array([3], np.int64)},
             "W2": {"Update_Count": np.array([3], np.int64)}, "b1": {"Update_Count": np.array([3], np.int64)}}
    p.set_optimizer_initial_state(given)
    flat = onnxtrain.TrainingSession(mlp_model(din=12, dh=20, dout=5).SerializeToString(), p, so)
    assert flat._halves and [(len(g.weights), g.merged) for g in flat._flat.groups] == [(1, False), (3, True)]
    so0 = onnxtrain.SessionOptions()
    so0.add_session_config_entry("onnxtrain.backend", backend)
    so0.add_session_config_entry("onnxtrain.flat_update", "0")
    perw = onnxtrain.TrainingSession(mlp_model(din=12, dh=20, dout=5).SerializeToString(), p, so0)
    before = flat.get_state()
    counts = {k: v for k, v in flat._store.items() if k.startswith("Update_Count")}
    got, want = _train(flat, 2), _train(perw, 2)
    assert all(flat._store[k] is v for k, v in counts.items())  # the same arrays, stepped in place
    got += _train(flat, 2, seed=6)
    want += _train(perw, 2, seed=6)
    _same(flat, perw, got, want)
    assert all(flat.get_state()[k][0] == 7 for k in counts)
    assert all(before[k][0] == 3 for k in counts) and all(d["Update_Count"][0] == 3 for d in given.values())
    if backend == "onnxruntime":  # every output of the update's run written into an array given to it
        plan = flat._flat.plan
        assert plan._kept is not None and set(plan._kept.outputs) == set(plan.output_names)


@pytest.mark.parametrize("backend", ["onnxruntime", "numpy"])
def test_step_counts_past_the_largest_int64_as_the_per_weight_graph(monkeypatch, backend: str) -> None:
    """Step counts loaded at the largest int64: the flat update's next counts wrap to the lowest int64 as the
    per-weight graph's Add does (then count as no step taken: no bias correction), and the losses, weights
    and moments keep the per-weight graph's bits, a weight with its own arrays and a merged group alike."""
    if backend == "numpy":
        monkeypatch.setattr(session_halves, "NUMPY_MIN_MERGED", 2)
    monkeypatch.setattr(session_flat, "SINGLE_MIN", 200)  # W1 keeps its arrays: a group of one, a merged one
    sessions = []
    for flat in ("1", "0"):
        so = onnxtrain.SessionOptions()
        so.add_session_config_entry("onnxtrain.backend", backend)
        so.add_session_config_entry("onnxtrain.flat_update", flat)
        p = params("AdamOptimizer", enable_grad_norm_clip=False)
        model = mlp_model(din=12, dh=20, dout=5).SerializeToString()
        sessions.append(onnxtrain.TrainingSession(model, p, so))
    sess, perw = sessions
    assert [(len(g.weights), g.merged) for g in sess._flat.groups] == [(1, False), (3, True)]
    names = [f"Update_Count_{w}" for w in ("W1", "b1", "W2", "b2")]
    got, want = _train(sess, 2), _train(perw, 2)
    top, low = np.iinfo(np.int64).max, np.iinfo(np.int64).min
    for s in (sess, perw):
        s.load_state({n: np.array([top], np.int64) for n in names})
    got += _train(sess, 3, seed=6)
    want += _train(perw, 3, seed=6)
    assert "update" not in sess._plans  # (the counts stayed equal: the flat update ran every step)
    _same(sess, perw, got, want)
    assert [int(sess.get_state()[n][0]) for n in names] == [low + 2] * 4
