"""The onnxruntime backend against the numpy engine (the reference): same losses, weights and outputs.

Weights are compared as ``‖a − b‖ / ‖a‖`` per state tensor after 20 steps (float32 summation orders
differ between the engines, so the figure is a few 1e-7 to a few 1e-6, not 0).
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

import numpy as np
import onnx
import pytest

from onnxtrain import InferenceSession, RunOptions, SessionOptions
from onnxtrain.engine.backends import (
    BACKENDS,
    CONFIG_KEY,
    backend_of,
    check_backend,
    make_plan,
    resolve_providers,
)
from onnxtrain.engine.ort_plan import DISABLED_OPTIMIZERS, ENV_ALLOCATORS_KEY, SPIN_KEY, STOP_KEY, OrtPlan
from onnxtrain.engine.plan import Plan
from onnxtrain.ir.graphs import walk_graphs
from onnxtrain.parameters import TrainingParameters
from onnxtrain.session import TrainingSession
from tests.session.helpers import batches, mlp_model, params

ort = pytest.importorskip("onnxruntime")

STEPS = 20
TOL = 1e-5
# LeNet-BN: the conv biases feeding a training-mode BatchNormalization have a zero gradient up to
# rounding; Adam normalises that rounding noise into full-size steps, so their values (and the running
# means that follow them) are noise-driven in any two float32 engines. They are frozen under Adam.
LENET_PRE_BN_BIASES = {"model.features.0.bias", "model.features.4.bias"}


def options(backend: str) -> SessionOptions:
    so = SessionOptions()
    so.add_session_config_entry(CONFIG_KEY, backend)
    return so


def rel(a: np.ndarray, b: np.ndarray) -> float:
    a64 = np.asarray(a, np.float64)
    norm = np.linalg.norm(a64)
    diff = np.linalg.norm(a64 - np.asarray(b, np.float64))
    return float(diff / norm) if norm else float(diff)


def legacy_run(model, opt: str, backend: str, feeds: list[dict], lr: float = 0.01, evaluate: bool = False,
               **params):
    """Train on ``feeds``; ``evaluate``: a forward-only run on each batch after its step, as a validation
    pass between steps would be, and a run of only the path to the gradients' norm (neither updates)."""
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = opt
    for k, v in params.items():
        setattr(p, k, v)
    sess = TrainingSession(model, p, options(backend))
    sess.initial_state = sess.get_state()
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    losses = []
    for f in feeds:
        losses.append(float(sess.run(["loss"], {**f, "Learning_Rate": np.array([lr], np.float32)})[0]))
        if evaluate:
            sess.run(["loss"], f, ro)
            sess.run(["global_gradient_norm"], f, ro)
    return losses, sess.get_state(), sess


def assert_same_training(model, opt: str, feeds: list[dict], evaluate: bool = False, **params) -> None:
    ref_losses, ref_state, ref = legacy_run(model, opt, "numpy", feeds, evaluate=evaluate, **params)
    losses, state, sess = legacy_run(model, opt, "onnxruntime", feeds, evaluate=evaluate, **params)
    assert isinstance(ref._plan, Plan) and isinstance(sess._plan, OrtPlan)
    assert sorted(state) == sorted(ref_state)
    moved = [rel(ref.initial_state[k], ref_state[k]) for k in sess._graphs.trainable]
    assert max(moved) > 1e-3, moved  # it trains
    worst = max(abs(a - b) / abs(a) for a, b in zip(ref_losses, losses))
    assert worst < TOL, (worst, ref_losses, losses)
    # state kept in float16 (use_fp16_moments) to within its own resolution (a 2⁻¹¹ relative step)
    errors = {k: rel(ref_state[k], state[k]) / (50 if np.asarray(ref_state[k]).dtype == np.float16 else 1)
              for k in ref_state}
    assert max(errors.values()) < TOL, sorted(errors.items(), key=lambda kv: -kv[1])[:5]


# ---- names, options, providers ------------------------------------------------------------------

def test_backend_names_and_config_entry():
    assert BACKENDS == ("numpy", "onnxruntime")
    assert backend_of(None) == "numpy" and backend_of(SessionOptions()) == "numpy"
    assert backend_of(options("onnxruntime")) == "onnxruntime"
    ort_options = ort.SessionOptions()  # scripts written for onnxruntime pass its options to Module
    assert backend_of(ort_options) == "numpy"
    ort_options.add_session_config_entry(CONFIG_KEY, "onnxruntime")
    assert backend_of(ort_options) == "onnxruntime"
    with pytest.raises(ValueError, match="backend 'torch'; valid names: numpy, onnxruntime"):
        check_backend("torch")
    with pytest.raises(ValueError, match="valid names: numpy, onnxruntime"):
        TrainingSession(mlp_model(), _sgd_params(), options("tensorflow"))
    with pytest.raises(ValueError, match="valid names"):
        InferenceSession(mlp_model(), options("bogus"))
    assert isinstance(make_plan(mlp_model()), Plan)
    assert isinstance(make_plan(mlp_model(), "onnxruntime"), OrtPlan)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_split_entry_is_checked_on_every_backend(backend):
    """The numpy engine's ``onnxtrain.batch_split`` entry: a wrong value is an error on either backend
    (onnxruntime sessions have no batch split, but a misspelt value is still the caller's mistake)."""
    so = options(backend)
    so.add_session_config_entry("onnxtrain.batch_split", "2")
    with pytest.raises(ValueError, match="batch_split' must be one of '0', '1', 'process', got '2'"):
        InferenceSession(mlp_model(), so)
    so.add_session_config_entry("onnxtrain.batch_split", "0")
    assert InferenceSession(mlp_model(), so).get_outputs()


def _sgd_params() -> TrainingParameters:
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    return p


def test_missing_onnxruntime_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime now raises ImportError
    with pytest.raises(ImportError, match="pip install onnxruntime"):
        make_plan(mlp_model(), "onnxruntime")
    with pytest.raises(ImportError, match="onnxruntime backend needs the onnxruntime package"):
        TrainingSession(mlp_model(), _sgd_params(), options("onnxruntime"))
    assert isinstance(TrainingSession(mlp_model(), _sgd_params())._plan, Plan)  # numpy needs nothing


def test_providers_cpu_fallback_and_cuda_pass_through(monkeypatch):
    assert resolve_providers("onnxruntime") == (
        (["CUDAExecutionProvider"] if "CUDAExecutionProvider" in ort.get_available_providers() else [])
        + ["CPUExecutionProvider"], [{}] * (1 + ("CUDAExecutionProvider" in ort.get_available_providers())))
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.warns(UserWarning, match="CUDAExecutionProvider is not available"):
        names, _ = resolve_providers("onnxruntime", ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert names == ["CPUExecutionProvider"]
    gpu = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    monkeypatch.setattr(ort, "get_available_providers", lambda: gpu)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        names, opts = resolve_providers("onnxruntime", [("CUDAExecutionProvider", {"device_id": 0})])
    assert names == ["CUDAExecutionProvider", "CPUExecutionProvider"] and opts == [{"device_id": "0"}, {}]
    assert resolve_providers("onnxruntime")[0] == ["CUDAExecutionProvider", "CPUExecutionProvider"]


def test_session_reports_onnxruntime_providers():
    sess = TrainingSession(mlp_model(), _sgd_params(), options("onnxruntime"),
                           providers=["CPUExecutionProvider"])
    assert sess.get_providers() == ["CPUExecutionProvider"]
    assert sess._plan.providers == ["CPUExecutionProvider"]


# ---- the legacy TrainingSession -----------------------------------------------------------------

@pytest.mark.parametrize("opt", ["SGDOptimizer", "AdamOptimizer"])
def test_legacy_mlp_20_steps_match_numpy(opt):
    feeds = [{"x": x, "y": y} for x, y in batches(STEPS, 16)]
    assert_same_training(mlp_model(), opt, feeds)


@pytest.mark.parametrize("opt", ["AdamOptimizer", "LambOptimizer"])
def test_legacy_fp16_moments_20_steps_match_numpy(opt):
    """Moments kept in float16 (a Cast on load and on store in the update graph)."""
    feeds = [{"x": x, "y": y} for x, y in batches(STEPS, 16)]
    assert_same_training(mlp_model(), opt, feeds, use_fp16_moments=True)


@pytest.mark.parametrize("opt", ["SGDOptimizer", "AdamOptimizer"])
def test_legacy_lenet_bn_20_steps_match_numpy(opt):
    """Training-mode BatchNormalization (running statistics in the store) under onnxruntime's default
    optimisation level with ConstantSharing disabled; with SGD, an evaluation run and a run of the path to
    the gradients' norm after every step, which leave the statistics alone (onnxruntime wrote the new
    statistics into the store's arrays it was given, until the forward-only graph held them as constants
    and path runs got copies)."""
    pytest.importorskip("torch")
    from tests import models

    model, _, _ = models.export("lenet_bn", training=True, with_loss=True, dropout=0.0)
    feeds = [models.example_inputs("lenet_bn", batch=8, with_loss=True, seed=k) for k in range(STEPS)]
    frozen = LENET_PRE_BN_BIASES if opt == "AdamOptimizer" else set()
    assert_same_training(model.SerializeToString(), opt, feeds, evaluate=opt == "SGDOptimizer",
                         weights_not_to_train=frozen)


def pointwise_conv_model(channels: int = 48, large: int = 2752) -> bytes:
    """Two 1×1 Convs (weights ending in axes of 1, of 132,096 values each: each keeps its own update nodes in
    the legacy session's flat update) and a mean-squared loss."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    w1 = numpy_helper.from_array((rng.standard_normal((large, channels, 1, 1)) / 7).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((rng.standard_normal((channels, large, 1, 1)) / 50).astype(np.float32), "w2")
    nodes = [helper.make_node("Conv", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["out"]), helper.make_node("Sub", ["out", "y"], ["d"]),
             helper.make_node("Mul", ["d", "d"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)]
    f = TensorProto.FLOAT
    g = helper.make_graph(nodes, "pointwise", [helper.make_tensor_value_info("x", f, ["N", channels, 3, 3]),
                                               helper.make_tensor_value_info("y", f, ["N", channels, 3, 3])],
                          [helper.make_tensor_value_info("loss", f, [])], [w1, w2])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("opt", ["SGDOptimizer", "AdamOptimizer"])
def test_legacy_pointwise_convs_20_steps_match_numpy(opt):
    """1×1 Convs: their weight gradients as one product per offset over the whole batch, and the updates'
    scalar operands given the weights' rank (onnxruntime's slow broadcast onto a last axis of 1)."""
    rng = np.random.default_rng(4)
    feeds = [{"x": rng.standard_normal((6, 48, 3, 3)).astype(np.float32),
              "y": rng.standard_normal((6, 48, 3, 3)).astype(np.float32)} for _ in range(STEPS)]
    assert_same_training(pointwise_conv_model(), opt, feeds)


def test_legacy_gpt_block_20_steps_match_numpy():
    """A causal-attention block (its mask a Where with -inf, which the backend runs as an Add of the masked
    fill) and a tanh-GELU MLP: the same losses and weights on both backends."""
    pytest.importorskip("torch")
    from tests import models

    model, _, _ = models.export("gpt_block", training=True, with_loss=True, dropout=0.0)
    feeds = [models.example_inputs("gpt_block", batch=4, with_loss=True, seed=k) for k in range(STEPS)]
    losses, _, sess = legacy_run(model.SerializeToString(), "AdamOptimizer", "onnxruntime", feeds[:1],
                                 lr=0.001)
    where_fills = [n for g in walk_graphs(sess._plan.onnxruntime_model.graph) for n in g.node
                   if n.name.endswith("_Fill")]
    assert where_fills, "the attention mask's Where was not rewritten"
    # the key part of the qkv bias shifts each row of scores by a constant, which softmax ignores: its
    # gradient is rounding noise, which Adam scales to full-size steps (as LeNet's pre-BN biases above)
    assert_same_training(model.SerializeToString(), "AdamOptimizer", feeds,
                         weights_not_to_train={"model.attn.qkv.bias"})


def test_control_flow_models_train_the_same_on_both_backends():
    """A scripted list RNN (a Loop carrying a sequence) trains to the same losses and weights on onnxruntime
    as on the numpy engine: the backward Loop, the sequence ops and the stashed iterations run there too."""
    torch = pytest.importorskip("torch")
    from tests.autodiff.test_control_flow_grad import ListRNN, export_scripted

    torch.manual_seed(0)
    model = export_scripted(ListRNN(), torch.randn(5, 2, 4))
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 6, STEPS)
    feeds = [{"x": rng.standard_normal((int(n), 2, 4)).astype(np.float32)} for n in lengths]
    assert_same_training(model.SerializeToString(), "SGDOptimizer", feeds)


def test_legacy_gradient_accumulation_and_forward_only_match_numpy():
    feeds = [{"x": x, "y": y} for x, y in batches(12, 8)]
    assert_same_training(mlp_model(), "AdamOptimizer", feeds, gradient_accumulation_steps=3,
                         gradient_accumulation_mode="auto")
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    outs = []
    for backend in BACKENDS:
        sess = TrainingSession(mlp_model(), _sgd_params(), options(backend))
        outs.append(sess.run(["logits"], {"x": feeds[0]["x"], "y": feeds[0]["y"]}, ro)[0])
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-6, atol=1e-6)


def test_state_is_bound_not_copied_and_arrays_held_elsewhere_survive_the_next_step(monkeypatch):
    """The single step graph (``ONNXTRAIN_ORT_PIECES=0``; by default the step runs as two graphs): the
    store's arrays are bound as the next step's inputs (no copy in). A weight whose old value nothing
    reads once its update can be computed (the first layer's: no input gradient) is updated in its own
    array; the second layer's, which the backward pass still reads, comes back in onnxruntime's buffer (no
    copy back), and the array of the step before keeps its values. Feeds and get_state() copies are never
    written."""
    monkeypatch.setenv("ONNXTRAIN_ORT_PIECES", "0")
    feeds = [{"x": x, "y": y, "Learning_Rate": np.array([0.1], np.float32)} for x, y in batches(3, 8)]
    sess = TrainingSession(mlp_model(), _sgd_params(), options("onnxruntime"))
    plan = sess._plans["full"]
    # the biases' and W1's old values are only read on the way to their updates; W2's by the backward pass
    assert sorted(plan._inplace.values()) == ["W1", "b1", "b2"]
    sess.run(["loss"], feeds[0])
    w1, w2 = sess._store["W1"], sess._store["W2"]
    assert w2.base is not None  # a view of onnxruntime's buffer
    state = sess.get_state()
    kept1, kept2 = w1.copy(), w2.copy()
    x = feeds[1]["x"].copy()
    sess.run(["loss"], feeds[1])
    assert sess._store["W1"] is w1 and not np.array_equal(w1, kept1)  # updated in place
    np.testing.assert_array_equal(w2, kept2)  # last step's W2 was an input, not an output
    assert not np.shares_memory(sess._store["W2"], w2)
    np.testing.assert_array_equal(feeds[1]["x"], x)
    np.testing.assert_array_equal(state["W1"], kept1)


def test_profiling_writes_a_trace_of_onnxruntimes_nodes(tmp_path):
    """The legacy session's trace on the onnxruntime backend holds onnxruntime's own per-node events (it
    held one event per run), in time order, and its runs' nodes twice for two runs; onnxruntime's files
    are folded in and removed."""
    so = options("onnxruntime")
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "prof_")
    sess = TrainingSession(mlp_model(), _sgd_params(), so)
    x, y = batches(1, 8)[0]
    for _ in range(2):
        sess.run(["loss"], {"x": x, "y": y, "Learning_Rate": np.array([0.1], np.float32)})
    path = sess.end_profiling()
    assert os.listdir(tmp_path) == [os.path.basename(path)]
    with open(path) as f:
        events = [e for e in json.load(f) if e["cat"] == "Node"]
    ops = [e["args"]["op_name"] for e in events]
    assert "onnxruntime" not in ops and {"Gemm", "Sub"} <= set(ops), ops  # forward and SGD's update
    names = [e["name"] for e in events]
    assert all(names.count(n) == 2 for n in names)
    starts = [e["ts"] for e in events]
    assert starts == sorted(starts) and all(e["dur"] >= 0 for e in events)


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_profile_holds_the_path_only_runs(tmp_path, backend):
    """A run of only the path to its fetches (another graph than the step's) is in the trace, node by node
    (the path's runs were left out on the numpy engine)."""
    so = options(backend)
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "prof_")
    sess = TrainingSession(mlp_model(), _sgd_params(), so)
    x, y = batches(1, 8)[0]
    feeds = {"x": x, "y": y, "Learning_Rate": np.array([0.1], np.float32)}
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    sess.run(["loss"], feeds, ro)
    with open(sess.end_profiling()) as f:
        ops = {e["args"]["op_name"] for e in json.load(f) if e["cat"] == "Node"}
    assert "Gemm" in ops or "FusedGemm" in ops, ops
    assert not ops & {"Sub", "onnxruntime"}, ops  # nodes, and no update on the path to the loss


def test_inference_profile_names_the_nodes_onnxruntime_profiles(tmp_path):
    """An InferenceSession's trace on the backend lists the nodes (name and op) that plain onnxruntime's
    own profile of the graph the backend runs lists (the oracle)."""
    so = options("onnxruntime")
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "ours_")
    model = mlp_model()
    sess = InferenceSession(model.SerializeToString(), so)
    x, y = batches(1, 8)[0]
    feeds = {"x": x, "y": y}
    sess.run(None, feeds)
    with open(sess.end_profiling()) as f:
        our_events = [e for e in json.load(f) if e["cat"] == "Node"]
    ours = {(e["name"], e["args"]["op_name"]) for e in our_events}
    plain = ort.SessionOptions()
    plain.enable_profiling = True
    plain.profile_file_prefix = str(tmp_path / "plain_")
    plain.add_session_config_entry("session.disable_optimizers", ",".join(DISABLED_OPTIMIZERS))
    theirs_session = ort.InferenceSession(sess._plan.onnxruntime_model.SerializeToString(), plain,
                                         providers=["CPUExecutionProvider"])
    theirs_session.run(None, feeds)
    with open(theirs_session.end_profiling()) as f:
        their_events = [e for e in json.load(f) if e["cat"] == "Node"]
    theirs = {(e["name"], e["args"]["op_name"]) for e in their_events}
    assert ours and ours == theirs
    # each event carries onnxruntime's arguments, its memory and thread statistics among them
    keys = {e["name"]: set(e["args"]) for e in their_events}
    assert {e["name"]: set(e["args"]) for e in our_events} == keys
    assert all({"activation_size", "mem_bytes_in_use", "thread_scheduling_stats"} <= k for k in keys.values())


# ---- the on-device Module and Optimizer ---------------------------------------------------------

@pytest.fixture(scope="module", params=["SGD", "AdamW"])
def mlp_artifacts(request, tmp_path_factory):
    from onnxtrain.training import artifacts

    folder = str(tmp_path_factory.mktemp(f"mlp_{request.param}"))
    model = mlp_model(din=8, dh=32, dout=4)
    artifacts.generate_artifacts(model, requires_grad=[t.name for t in model.graph.initializer], loss=None,
                                 optimizer=getattr(artifacts.OptimType, request.param),
                                 artifact_directory=folder)
    return folder


def first(out) -> float:
    """The loss: the first of the module's outputs."""
    return float(np.asarray(out[0] if isinstance(out, tuple) else out).reshape(-1)[0])


def ondevice_run(folder: str, backend: str):
    from onnxtrain.training.api import CheckpointState, Module, Optimizer

    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    module = Module(os.path.join(folder, "training_model.onnx"), state,
                    os.path.join(folder, "eval_model.onnx"), session_options=options(backend))
    opt = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    opt.set_learning_rate(0.05)
    losses = []
    for x, y in batches(STEPS, 16):
        losses.append(first(module(x, y)))
        opt.step()
        module.lazy_reset_grad()
    module.eval()
    x, y = batches(1, 64, seed=99)[0]
    eval_loss = first(module(x, y))
    params = {n: p.data.copy() for n, p in state.parameters}
    return losses, eval_loss, params, module, opt


def test_ondevice_module_and_optimizer_match_numpy(mlp_artifacts):
    ref_losses, ref_eval, ref_params, _, _ = ondevice_run(mlp_artifacts, "numpy")
    losses, eval_loss, params, module, opt = ondevice_run(mlp_artifacts, "onnxruntime")
    assert isinstance(module._train_plan, OrtPlan) and isinstance(module._eval_plan, OrtPlan)
    assert isinstance(opt._plan, OrtPlan)  # the optimizer follows its module's backend
    assert ref_losses[-1] < ref_losses[0]
    assert max(abs(a - b) / abs(a) for a, b in zip(ref_losses, losses)) < TOL
    assert abs(eval_loss - ref_eval) / abs(ref_eval) < TOL
    errors = {k: rel(ref_params[k], params[k]) for k in ref_params}
    assert max(errors.values()) < TOL, errors


def test_ondevice_gradients_stay_in_their_arrays_on_onnxruntime(mlp_artifacts):
    """On onnxruntime a step after lazy_reset_grad writes the new gradients into the old ones' arrays (as
    an accumulating step does), with the numpy engine's values."""
    from onnxtrain.training.api import CheckpointState, Module

    def module(backend: str) -> tuple[Module, CheckpointState]:
        state = CheckpointState.load_checkpoint(os.path.join(mlp_artifacts, "checkpoint"))
        return Module(os.path.join(mlp_artifacts, "training_model.onnx"), state,
                      session_options=options(backend)), state

    (ref, ref_state), (mod, state) = module("numpy"), module("onnxruntime")
    for k, (x, y) in enumerate(batches(3, 16)):
        ref.lazy_reset_grad()
        mod.lazy_reset_grad()
        before = {n: p.grad for n, p in state.parameters}
        ref(x, y)
        mod(x, y)
        for n, p in state.parameters:
            if k:  # the first step finds the zeros made with the state
                assert p.grad is before[n], n
            np.testing.assert_allclose(p.grad, ref_state.parameters[n].grad, rtol=1e-5, atol=1e-6, err_msg=n)


def test_reuse_writes_outputs_into_the_arrays_given_when_they_fit():
    """OrtPlan.run(reuse=...): an output of static shape and type comes back in the array given, with the
    values of a plain run; arrays of another shape or type, not contiguous, read-only or fed as an input,
    and outputs of dynamic shape, are left alone."""
    from onnx import TensorProto as T
    from onnx import helper as h

    graph = h.make_graph(
        [h.make_node("Add", ["a", "b"], ["c"]), h.make_node("Mul", ["a", "b"], ["d"])], "reuse",
        [h.make_tensor_value_info("a", T.FLOAT, [4, 3]), h.make_tensor_value_info("b", T.FLOAT, [4, 3])],
        [h.make_tensor_value_info("c", T.FLOAT, [4, 3]), h.make_tensor_value_info("d", T.FLOAT, ["N", 3])])
    plan = make_plan(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), "onnxruntime")
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((4, 3)).astype(np.float32) for _ in range(2))
    buf = np.full((4, 3), np.nan, np.float32)
    got = plan.run({"a": a, "b": b}, ["c", "d"], reuse={"c": buf})
    assert got[0] is buf
    np.testing.assert_array_equal(buf, a + b)
    np.testing.assert_array_equal(got[1], a * b)
    readonly = np.zeros((4, 3), np.float32)
    readonly.flags.writeable = False
    a_before = a.copy()
    for name, bad in [("c", np.zeros((3, 4), np.float32)), ("c", np.zeros((4, 3), np.float64)),
                      ("c", np.zeros((3, 4), np.float32).T), ("c", readonly), ("c", a),
                      ("d", np.zeros((4, 3), np.float32))]:
        kept = bad.copy()
        got = plan.run({"a": a, "b": b}, ["c", "d"], reuse={name: bad})
        assert got[0] is not bad and got[1] is not bad, (name, bad.shape, bad.dtype)
        np.testing.assert_array_equal(bad, kept)
        np.testing.assert_array_equal(got[0], a_before + b)


# ---- InferenceSession ---------------------------------------------------------------------------

def test_inference_session_outputs_equal():
    model = mlp_model(din=8, dh=32, dout=4)
    model.graph.input.append(onnx.helper.make_tensor_value_info("W1", onnx.TensorProto.FLOAT, [32, 8]))
    x = batches(1, 16)[0][0]
    ref = InferenceSession(model).run(None, {"x": x, "y": np.zeros(16, np.int64)})
    sess = InferenceSession(model, options("onnxruntime"))
    assert isinstance(sess._plan, OrtPlan)
    out = sess.run(None, {"x": x, "y": np.zeros(16, np.int64)})
    for a, b in zip(ref, out):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    w = {"W1": np.zeros((32, 8), np.float32)}  # overridable initializers are fed too
    np.testing.assert_allclose(sess.run(["logits"], {"x": x, "y": np.zeros(16, np.int64), **w})[0],
                               InferenceSession(model).run(["logits"], {"x": x, "y": np.zeros(16, np.int64),
                                                                        **w})[0], rtol=1e-5, atol=1e-6)


def test_training_mode_batchnorm_with_initializers_is_stable_across_runs():
    """The ConstantSharing regression: onnxruntime merges equal initializers and training-mode
    BatchNormalization overwrites them, so outputs drift from the second run on unless it is disabled."""
    pytest.importorskip("torch")
    from tests import models

    model, feeds, _ = models.export("lenet_bn", training=True, with_loss=False, dropout=0.0)
    ref = InferenceSession(model).run(None, feeds)[0]
    sess = InferenceSession(model, options("onnxruntime"))
    for _ in range(3):
        np.testing.assert_allclose(sess.run(None, feeds)[0], ref, rtol=1e-5, atol=1e-5)


def test_newer_ir_version_is_lowered_for_onnxruntime():
    model = mlp_model()
    model.ir_version = 99  # newer than any onnxruntime reads; the opsets only need IR 8
    plan = make_plan(model, "onnxruntime")
    x, y = batches(1, 4)[0]
    np.testing.assert_allclose(plan.run({"x": x, "y": y}, ["loss"])[0],
                               Plan(mlp_model()).run({"x": x, "y": y}, ["loss"])[0], rtol=1e-6)
    assert model.ir_version == 99  # the caller's model is left alone


def test_unknown_feed_and_output_are_named():
    from onnxtrain.engine.plan import EngineError

    plan = make_plan(mlp_model(), "onnxruntime")
    x, y = batches(1, 4)[0]
    with pytest.raises(EngineError, match="unknown feed 'z'"):
        plan.run({"x": x, "y": y, "z": x})
    with pytest.raises(EngineError, match="unknown output 'nope'"):
        plan.run({"x": x, "y": y}, ["nope"])
    with pytest.raises(EngineError, match="onnxruntime failed"):
        plan.run({"x": x[:, :3], "y": y})


# ---- onnxtrain train ----------------------------------------------------------------------------

def test_cli_digits_mlp_on_onnxruntime_reaches_the_same_accuracy(tmp_path):
    from onnxtrain.cli import main
    from tests.train.conftest import config_path

    sets = ["--set", "training.epochs=2", "--set", "training.checkpoint_every=null",
            "--set", "output.plot=false"]
    scores = {}
    for backend in BACKENDS:
        out = str(tmp_path / backend)
        assert main(["train", config_path("digits_mlp"), "--output-dir", out, "-q", *sets,
                     "--set", f"training.backend={backend}"]) == 0
        with open(os.path.join(out, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
        scores[backend] = [r for r in records if "eval_accuracy" in r][-1]
    assert scores["onnxruntime"]["eval_accuracy"] == scores["numpy"]["eval_accuracy"] > 0.85
    assert scores["onnxruntime"]["eval_loss"] == pytest.approx(scores["numpy"]["eval_loss"], rel=1e-4)


def test_config_backend_key(tmp_path):
    from onnxtrain.train.config import ConfigError, load_config
    from tests.train.conftest import config_path

    assert load_config(config_path("digits_mlp")).training.backend == "numpy"
    cfg = load_config(config_path("digits_mlp"), ["training.backend=onnxruntime"])
    assert cfg.training.backend == "onnxruntime"
    with pytest.raises(ConfigError, match="training.backend: expected one of 'numpy', 'onnxruntime'"):
        load_config(config_path("digits_mlp"), ["training.backend=cuda"])


def test_onnx_models_stay_standard():
    """The backend needs no private ops: every graph handed over is plain ONNX (checker passes)."""
    sess = TrainingSession(mlp_model(), _sgd_params(), options("onnxruntime"))
    onnx.checker.check_model(sess._plan.model)


def test_session_config_entries_reach_onnxruntime():
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.disable_optimizers", "GeluFusion")
    sess = InferenceSession(mlp_model().SerializeToString(), so)
    ort_options = sess._plan._session.get_session_options()
    assert ort_options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    # the caller's disabled optimizers and ours (ConstantSharing) both
    disabled = ort_options.get_session_config_entry("session.disable_optimizers").split(",")
    assert set(disabled) == {"GeluFusion", *DISABLED_OPTIMIZERS}
    with pytest.raises(RuntimeError, match="does not have configuration"):
        ort_options.get_session_config_entry("onnxtrain.backend")  # ours stays ours


def test_training_mode_dropout_drops_in_inference_graphs() -> None:
    """A Dropout whose training_mode is a constant true (a model exported in training mode) drops on the
    backend as on the numpy engine: onnxruntime's EliminateDropout deleted it (every run gave the
    no-dropout output)."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("Abs", ["x"], ["a"]), helper.make_node("Dropout", ["a", "ratio", "tm"], ["d"]),
             helper.make_node("Relu", ["d"], ["y"])]  # (onnxruntime removed a Dropout between two nodes)
    inits = [numpy_helper.from_array(np.array(0.5, np.float32), "ratio"),
             numpy_helper.from_array(np.array(True), "tm")]
    g = helper.make_graph(nodes, "drop", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 64])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    x = np.ones((64, 64), np.float32)
    for backend in ("numpy", "onnxruntime"):
        sess = InferenceSession(model, options(backend))
        a, b = (sess.run(None, {"x": x})[0] for _ in range(2))
        for y in (a, b):
            assert set(np.unique(y)) == {0.0, 2.0}, backend
            assert 0.4 < (y == 0).mean() < 0.6, backend
        assert not np.array_equal(a, b), backend


def test_ondevice_steps_that_overwrite_run_without_the_accumulators(mlp_artifacts):
    """On onnxruntime a step after lazy_reset_grad() runs the training model without its accumulators
    (onnxruntime would compute them anyway); accumulating steps compile and run the full model. Both match
    the numpy engine over a mix of the two."""
    from onnxtrain.training.api import CheckpointState, Module, Optimizer

    runs = {}
    for backend in ("numpy", "onnxruntime"):
        state = CheckpointState.load_checkpoint(os.path.join(mlp_artifacts, "checkpoint"))
        module = Module(os.path.join(mlp_artifacts, "training_model.onnx"), state,
                        session_options=options(backend))
        opt = Optimizer(os.path.join(mlp_artifacts, "optimizer_model.onnx"), module)
        if backend == "onnxruntime":
            assert isinstance(module._overwrite_plan, OrtPlan) and module._full_plan is None
            names = {i.name for i in module._overwrite_plan.model.graph.input}
            assert "lazy_reset_grad" not in names
        losses, grads = [], []
        for k, (x, y) in enumerate(batches(9, 16)):
            losses.append(first(module(x, y)))
            grads.append({n: p.grad.copy() for n, p in state.parameters})
            if backend == "onnxruntime" and k == 0:
                assert module._full_plan is None  # nothing accumulated yet
            if k % 3 == 2:  # two calls accumulate into the third's gradients
                opt.step()
                module.lazy_reset_grad()
        runs[backend] = losses, grads, {n: p.data.copy() for n, p in state.parameters}
    assert isinstance(module._full_plan, OrtPlan)
    (ref_losses, ref_grads, ref_params), (losses, grads, params) = runs["numpy"], runs["onnxruntime"]
    assert max(abs(a - b) / abs(a) for a, b in zip(ref_losses, losses)) < TOL
    for want, got in zip(ref_grads, grads):
        assert max(rel(want[n], got[n]) for n in want) < TOL
    assert max(rel(ref_params[n], params[n]) for n in ref_params) < TOL


@pytest.mark.parametrize("one_graph", [False, True], ids=["two-graph-step", "single-graph-step"])
def test_legacy_accumulation_plan_threads_stop_spinning_after_their_run(monkeypatch, one_graph: bool):
    """With gradient accumulation the session runs its onnxruntime graphs in turn: the accumulating one's
    and the update's threads spin during their runs and stop when they end, those of the graph that starts
    a step (the gradients graph, or the single step graph) spin on as onnxruntime's do by default."""
    if one_graph:
        monkeypatch.setenv("ONNXTRAIN_ORT_PIECES", "0")
    p = _sgd_params()
    p.gradient_accumulation_steps = 2
    p.gradient_accumulation_mode = "auto"
    sess = TrainingSession(mlp_model(), p, options("onnxruntime"))
    lr = np.array([0.1], np.float32)
    for x, y in batches(2, 8):
        sess.run(["loss"], {"x": x, "y": y, "Learning_Rate": lr})
    assert sess._halves != one_graph
    first = sess._plans["full" if one_graph else "gradients"]
    assert _entry(first, SPIN_KEY) is None and _entry(first, STOP_KEY) is None
    followers = ["accumulate"] + ([] if one_graph else ["update" if sess._flat is None else "flat_update"])
    for plan in (sess._plans[k] for k in followers):
        assert _entry(plan, SPIN_KEY) is None and _entry(plan, STOP_KEY) == "1"


def _entry(plan: OrtPlan, key: str) -> str | None:
    """The plan's onnxruntime session's config entry ``key`` (None: unset, onnxruntime's default)."""
    try:
        return plan._session.get_session_options().get_session_config_entry(key)
    except RuntimeError:  # "does not have configuration": unset
        return None


def test_optimizer_threads_stop_spinning_after_its_run(mlp_artifacts):
    """On onnxruntime the optimizer's session runs right after the training model's: its threads spin during
    its run and stop when it ends, so they do not take the training model's cores (two pools spinning on
    after their runs took each other's cores on 2 cores), unless the caller says."""
    from onnxtrain.training.api import CheckpointState, Module, Optimizer

    def pair(so):
        state = CheckpointState.load_checkpoint(os.path.join(mlp_artifacts, "checkpoint"))
        module = Module(os.path.join(mlp_artifacts, "training_model.onnx"), state, session_options=so)
        return module, Optimizer(os.path.join(mlp_artifacts, "optimizer_model.onnx"), module)

    module, opt = pair(options("onnxruntime"))
    assert _entry(module._train_plan, STOP_KEY) is None and _entry(opt._plan, STOP_KEY) == "1"
    assert _entry(module._train_plan, SPIN_KEY) is None and _entry(opt._plan, SPIN_KEY) is None
    so = options("onnxruntime")
    so.add_session_config_entry(STOP_KEY, "0")  # the caller's choice stands, for both
    so.add_session_config_entry(SPIN_KEY, "1")
    module, opt = pair(so)
    for plan in (module._train_plan, opt._plan):
        assert _entry(plan, STOP_KEY) == "0" and _entry(plan, SPIN_KEY) == "1"
    # a standalone plan keeps onnxruntime's default; a follower plan made directly says so too
    assert _entry(make_plan(mlp_model(), "onnxruntime"), STOP_KEY) is None
    assert _entry(make_plan(mlp_model(), "onnxruntime", follower=True), STOP_KEY) == "1"


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="onnxruntime starts intra-op threads on 2 CPUs or more")
def test_follower_threads_use_no_cpu_once_its_run_ends():
    """Right after a run a standalone plan's threads spin on (CPU time while the caller sleeps); a follower's
    use next to none."""
    x, y = np.ones((256, 256), np.float32), np.zeros(256, np.int64)
    used = {}
    time.sleep(0.3)  # threads of earlier tests' plans (and OpenBLAS's) stop spinning first
    for follower in (True, False):  # the follower first: no other plan's threads may still spin then
        plan = make_plan(mlp_model(din=256, dh=512), "onnxruntime", follower=follower)
        windows = []
        for _ in range(3):  # the least CPU over three windows: a spinning plan spins in every one
            for _ in range(3):
                plan.run({"x": x, "y": y}, ["loss"])
            start = time.process_time()
            time.sleep(0.2)
            windows.append(time.process_time() - start)
        used[follower] = min(windows)
    assert used[True] < 0.003 and used[False] > 0.002, used  # the second: spinning shows in the measure


@pytest.mark.parametrize("flag", ["enable_mem_pattern", "enable_mem_reuse", "enable_cpu_mem_arena"])
def test_memory_options_reach_onnxruntime(flag):
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    assert getattr(so, flag) is True  # onnxruntime's default
    setattr(so, flag, False)
    sess = InferenceSession(mlp_model().SerializeToString(), so)
    assert getattr(sess._plan._session.get_session_options(), flag) is False
    assert getattr(InferenceSession(mlp_model().SerializeToString(), options("onnxruntime"))._plan._session
                   .get_session_options(), flag) is True


def _order(plan: OrtPlan) -> str:
    return plan._session.get_session_options().execution_order.name


def test_execution_order_keeps_the_graph_order_unless_the_options_say():
    """onnxruntime runs onnxtrain's graphs in their own node order (PRIORITY_BASED: by node index) unless
    the options name an order; a name, an int or onnxruntime's enum are taken, anything else is an error."""
    assert _order(make_plan(mlp_model(), "onnxruntime")) == "PRIORITY_BASED"
    assert _order(InferenceSession(mlp_model().SerializeToString(), options("onnxruntime"))._plan) \
        == "PRIORITY_BASED"
    for given in ("default", 0, ort.ExecutionOrder.DEFAULT):
        so = options("onnxruntime")
        so.execution_order = given
        assert _order(make_plan(mlp_model(), "onnxruntime", options=so)) == "DEFAULT"
    so = options("onnxruntime")
    with pytest.raises(TypeError, match="execution_order takes an ExecutionOrder .one of DEFAULT"):
        so.execution_order = "depth_first"  # refused when set, as onnxruntime's binding refuses it
    # onnxruntime's own SessionOptions always carry an order: theirs is taken as it is
    ort_so = ort.SessionOptions()
    ort_so.add_session_config_entry(CONFIG_KEY, "onnxruntime")
    assert _order(make_plan(mlp_model(), "onnxruntime", options=ort_so)) == "DEFAULT"


def test_execution_order_warns_on_the_numpy_engine():
    so = SessionOptions()
    so.execution_order = "PRIORITY_BASED"
    with pytest.warns(UserWarning, match="execution_order = PRIORITY_BASED has no effect on the numpy"):
        InferenceSession(mlp_model().SerializeToString(), so)
    so.execution_order = "DEFAULT"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        InferenceSession(mlp_model().SerializeToString(), so)


def _scale_model() -> onnx.ModelProto:
    """y = x * w, z = x + 1 (x: [N, 2], w: [2])."""
    f, h = onnx.TensorProto.FLOAT, onnx.helper
    graph = h.make_graph(
        [h.make_node("Mul", ["x", "w"], ["y"]), h.make_node("Add", ["x", "one"], ["z"])],
        "scale", [h.make_tensor_value_info("x", f, ["N", 2]), h.make_tensor_value_info("w", f, [2])],
        [h.make_tensor_value_info("y", f, ["N", 2]), h.make_tensor_value_info("z", f, ["N", 2])],
        [onnx.numpy_helper.from_array(np.ones(1, np.float32), "one")])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def test_kept_binding_reads_each_runs_arrays():
    """The onnxruntime plan keeps its IOBinding between runs: an array changed in place is read as it is now,
    a new array or shape is bound again, and an earlier run's outputs are not overwritten by a later run."""
    plan = make_plan(_scale_model(), "onnxruntime", keep_binding=True)
    x, w = np.arange(4, dtype=np.float32).reshape(2, 2), np.array([2, 3], np.float32)
    y1, z1 = plan.run({"x": x, "w": w})
    w *= 10  # the same array, new values
    x2 = x + 1
    y2, z2 = plan.run({"x": x2, "w": w})
    np.testing.assert_array_equal(y2, x2 * w)
    np.testing.assert_array_equal(z2, x2 + 1)
    np.testing.assert_array_equal(y1, x * [2, 3])  # the first run's results stand
    np.testing.assert_array_equal(z1, x + 1)
    x3, w3 = np.ones((3, 2), np.float32), np.array([-1, 4], np.float32)  # another shape, another w
    y3, _ = plan.run({"x": x3, "w": w3})
    np.testing.assert_array_equal(y3, x3 * w3)
    y4, = plan.run({"x": x3, "w": w3}, ["y"])  # other outputs asked for
    np.testing.assert_array_equal(y4, y3)
    x3[0] = 7  # x3 changed in place since it was bound
    y5, z5 = plan.run({"x": x3, "w": w3})
    np.testing.assert_array_equal(y5, x3 * w3)
    np.testing.assert_array_equal(z5, x3 + 1)


def test_kept_binding_with_runs_from_two_threads():
    """Two threads running one onnxruntime plan at once each get their own inputs' results."""
    import threading

    plan = make_plan(_scale_model(), "onnxruntime", keep_binding=True)
    errors = []

    def work(k: int) -> None:
        rng = np.random.default_rng(k)
        try:
            for _ in range(200):
                x = rng.standard_normal((8, 2)).astype(np.float32)
                w = rng.standard_normal(2).astype(np.float32)
                y, z = plan.run({"x": x, "w": w})
                np.testing.assert_array_equal(y, x * w)
                np.testing.assert_array_equal(z, x + 1)
        except AssertionError as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_only_training_plans_keep_their_binding(mlp_artifacts):
    """Training steps and optimizer updates keep onnxruntime's binding (and so their last arrays); an
    inference session lets go of its last batch once the run is over."""
    import gc
    import weakref

    from onnxtrain.training.api import CheckpointState, Module, Optimizer

    sess = TrainingSession(mlp_model(), _sgd_params(), options("onnxruntime"))
    sess.run(["loss"], {"x": np.ones((4, 8), np.float32), "y": np.zeros(4, np.int64),
                        "Learning_Rate": np.array([0.1], np.float32)})
    update = "update" if sess._flat is None else "flat_update"  # (session_flat.py)
    assert sess._halves and sess._plans["gradients"]._keep_binding and sess._plans[update]._keep_binding
    state = CheckpointState.load_checkpoint(os.path.join(mlp_artifacts, "checkpoint"))
    module = Module(os.path.join(mlp_artifacts, "training_model.onnx"), state,
                    os.path.join(mlp_artifacts, "eval_model.onnx"), session_options=options("onnxruntime"))
    opt = Optimizer(os.path.join(mlp_artifacts, "optimizer_model.onnx"), module)
    assert module._train_plan._keep_binding and opt._plan._keep_binding
    assert not module._eval_plan._keep_binding
    inference = InferenceSession(mlp_model().SerializeToString(), options("onnxruntime"))
    assert not inference._plan._keep_binding
    x = np.ones((4, 8), np.float32)
    inference.run(None, {"x": x, "y": np.zeros(4, np.int64)})
    gone = weakref.ref(x)
    del x
    gc.collect()
    assert gone() is None


def test_backend_sessions_share_one_cpu_arena():
    """The backend's training-step graphs use the arena registered once in onnxruntime's environment (one
    pool for a step's graphs), unless the caller says otherwise or turns the arena off; inference graphs
    keep their own; training is unchanged (the 20-step comparisons above run with it)."""
    assert _entry(make_plan(mlp_model(), "onnxruntime", keep_binding=True), ENV_ALLOCATORS_KEY) == "1"
    assert _entry(make_plan(mlp_model(), "onnxruntime"), ENV_ALLOCATORS_KEY) is None
    so = options("onnxruntime")
    so.add_session_config_entry(ENV_ALLOCATORS_KEY, "0")
    assert _entry(make_plan(mlp_model(), "onnxruntime", options=so, keep_binding=True),
                  ENV_ALLOCATORS_KEY) == "0"
    so = options("onnxruntime")
    so.enable_cpu_mem_arena = False
    assert _entry(make_plan(mlp_model(), "onnxruntime", options=so, keep_binding=True),
                  ENV_ALLOCATORS_KEY) is None
    sess = TrainingSession(mlp_model(), _sgd_params(), options("onnxruntime"))
    assert _entry(sess._plan, ENV_ALLOCATORS_KEY) == "1"


def test_sessions_keep_their_own_arena_when_onnxruntime_refuses_the_shared_one(monkeypatch):
    """When onnxruntime will not register the shared arena (say the process registered its own), sessions
    are made without asking for it, and still train."""
    from onnxtrain.engine import ort_plan

    def refuse(*_args):
        raise RuntimeError("an allocator is already registered")

    monkeypatch.setattr(ort_plan, "_arena", [])
    monkeypatch.setattr(ort, "create_and_register_allocator", refuse)
    sess = TrainingSession(mlp_model(), _sgd_params(), options("onnxruntime"))
    assert _entry(sess._plan, ENV_ALLOCATORS_KEY) is None
    x, y = batches(1, 8)[0]
    assert np.isfinite(sess.run(["loss"], {"x": x, "y": y, "Learning_Rate": np.array([0.1], np.float32)})[0])


def test_importing_onnxtrain_loads_no_network_or_crypto_modules():
    """``import onnxtrain`` (and onnx with it) maps neither OpenSSL (hashlib, ssl) nor asyncio: 3.6 MiB of
    libcrypto, and 6.3 MiB that typing_extensions < 4.16 pulled in through onnx.helper's deprecations."""
    import subprocess

    code = ("import sys, onnxtrain; "
            "print(sorted(m for m in ('asyncio', 'ssl', '_ssl', '_hashlib', 'hashlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_backend_runs_without_the_numpy_kernels(mlp_artifacts):
    """A Module, its Optimizer and a legacy session on onnxruntime never load the numpy engine's kernel
    registry (every kernel module: 5.7 MiB of the bench MLP's peak RSS when function expansion asked it
    which ops it lacks) nor its fusions (0.4 MiB of the LeNet's); onnxruntime runs ops that ONNX defines by
    a function itself."""
    import subprocess

    code = f"""
import numpy as np, onnxtrain
from onnxtrain.engine import registry
from onnxtrain.training.api import CheckpointState, Module, Optimizer
from tests.engine.test_backends import batches, legacy_run, mlp_model
so = onnxtrain.SessionOptions()
so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
folder = {mlp_artifacts!r}
state = CheckpointState.load_checkpoint(folder + "/checkpoint")
m = Module(folder + "/training_model.onnx", state, folder + "/eval_model.onnx", session_options=so)
opt = Optimizer(folder + "/optimizer_model.onnx", m)
x, y = batches(1, 16)[0]
m(x, y); opt.step(); m.eval(); m(x, y)
legacy_run(mlp_model(), "AdamOptimizer", "onnxruntime", [{{"x": x, "y": y}}] * 2, evaluate=True)
import sys
print("onnxtrain.engine.fusion" in sys.modules, registry._LOADED)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["False", "False"], out.stdout


def test_legacy_transformer_encoder_20_steps_match_numpy():
    """nn.TransformerEncoderLayer's attention (its projection unflattened to q, k and v by a Reshape whose
    shape ONNX's inference cannot read; ir/reshapes.py reads it): the gradients' zero Pads and their Sum
    run as one Concat on onnxruntime (engine/ort_pads.py), and train as on the numpy engine."""
    pytest.importorskip("torch")
    from tests import models

    # exported in eval mode, as the bench exports it: torch then writes the unflatten and q, k, v Gathers
    model, _, _ = models.export("transformer_encoder", training=False, with_loss=True, dropout=0.0)
    feeds = [models.example_inputs("transformer_encoder", batch=4, with_loss=True, seed=k)
             for k in range(STEPS)]
    _, _, sess = legacy_run(model.SerializeToString(), "AdamOptimizer", "onnxruntime", feeds[:1], lr=0.001)
    graph = sess._plan.onnxruntime_model.graph
    concats = [n for n in graph.node if n.op_type == "Concat" and len(n.input) == 3
               and all("Gather_" in i and "_Grad/" in i for i in n.input)]
    assert concats and not [n for n in graph.node if n.op_type == "Pad"], "q, k and v's Pads stayed"
    # the key part of the in-projection's bias shifts each row of scores by a constant, which softmax
    # ignores: its gradient is rounding noise, which Adam scales to full-size steps (as in the GPT block)
    assert_same_training(model.SerializeToString(), "AdamOptimizer", feeds,
                         weights_not_to_train={"model.layers.0.self_attn.in_proj_bias"})


def test_float16_mixed_precision_on_onnxruntime_warns_that_products_are_float32(monkeypatch):
    """onnxruntime's CPU provider has no float16 MatMul/Gemm: it computes them in float32 (the loss is the
    float32 loss bit for bit, and an overflowing loss scale goes unnoticed), which the backend says once."""
    from onnxtrain.engine import backends

    monkeypatch.setattr(backends, "_warned_float16", [])
    x, y = batches(1, 16)[0]
    feeds = {"x": x, "y": y, "Learning_Rate": np.array([0.0], np.float32)}
    with pytest.warns(UserWarning, match="no float16 MatMul, Gemm or Conv kernels"):
        p = params("SGDOptimizer", use_mixed_precision=True)
        mp = TrainingSession(mlp_model().SerializeToString(), p, options("onnxruntime"))
    fp32 = TrainingSession(mlp_model().SerializeToString(), params("SGDOptimizer"), options("onnxruntime"))
    (a,) = mp.run(["loss"], {**feeds, mp.loss_scale_input_name: np.array([1.0], np.float32)})
    (b,) = fp32.run(["loss"], feeds)
    assert a == b  # what the warning says: float32 products


def test_bfloat16_mixed_precision_on_onnxruntime_names_the_way_out():
    """onnxruntime's CPU provider has no bfloat16 Gemm: loading the graph fails with its NOT_IMPLEMENTED, to
    which the backend adds what it means (bfloat16 mixed precision) and what runs it (the numpy engine)."""
    from onnxtrain.engine.plan import EngineError

    p = params("SGDOptimizer", use_mixed_precision=True, mixed_precision_dtype="bfloat16")
    with pytest.raises(EngineError, match=r"NOT_IMPLEMENTED.*lacks bfloat16 kernels.*numpy engine"):
        TrainingSession(mlp_model().SerializeToString(), p, options("onnxruntime"))
    # the numpy engine trains the same session
    x, y = batches(1, 16)[0]
    sess = TrainingSession(mlp_model().SerializeToString(), p)
    (loss,) = sess.run(["loss"], {"x": x, "y": y, "Learning_Rate": np.array([0.1], np.float32),
                                  sess.loss_scale_input_name: np.array([1.0], np.float32)})
    assert np.isfinite(loss).all()


def test_unknown_provider_is_a_value_error_on_both_backends():
    """A provider name onnxruntime does not know is a ValueError on either backend when the constructor's
    fallback is off (enable_fallback=0; with it, the session falls back to the CPU, as onnxruntime's); a known
    one that is not available falls back to the CPU with a warning."""
    for backend in ("numpy", "onnxruntime"):
        with pytest.raises(ValueError, match="Unknown Provider Type: FooExecutionProvider"):
            InferenceSession(mlp_model().SerializeToString(), options(backend),
                             providers=["FooExecutionProvider"], enable_fallback=0)
    absent = next((p for p in ort.get_all_providers() if p not in ort.get_available_providers()), None)
    if absent is not None:
        with pytest.warns(UserWarning, match="falling back to CPUExecutionProvider"):
            InferenceSession(mlp_model().SerializeToString(), options("onnxruntime"), providers=[absent])


def test_every_provider_onnxruntime_lists_falls_back_to_the_cpu():
    """Each name onnxruntime's get_all_providers() gives (VitisAI, WebNN, CANN, Js, Rknpu and VSINPU were
    refused as unknown) runs on the CPU with a warning, as in onnxruntime; get_all_providers() is its list,
    in its order."""
    from onnxtrain import get_all_providers

    assert get_all_providers() == ort.get_all_providers()
    for name in ort.get_all_providers():
        if name in ort.get_available_providers():
            continue
        with pytest.warns(UserWarning, match="falling back to CPUExecutionProvider"):
            sess = InferenceSession(mlp_model().SerializeToString(), providers=[name, "CPUExecutionProvider"])
        assert sess.get_providers() == ["CPUExecutionProvider"]


def test_execution_order_is_none_until_set():
    so = SessionOptions()
    assert so.execution_order is None  # onnxruntime's object has the attribute too
    assert _order(make_plan(mlp_model(), "onnxruntime", options=options("onnxruntime"))) == "PRIORITY_BASED"


def test_an_output_asked_for_twice_comes_back_twice_on_both_backends():
    """run(["y", "y", "z"]) gives three arrays in that order (onnxruntime's binding holds a name once: the
    backend returned [y, z] and shifted every later output); a graph that lists an output twice too. The
    repeats are copies, so the caller owns each array."""
    f, h = onnx.TensorProto.FLOAT, onnx.helper
    g = h.make_graph([h.make_node("Add", ["x", "x"], ["y"]), h.make_node("Mul", ["x", "x"], ["z"])], "g",
                     [h.make_tensor_value_info("x", f, [3])],
                     [h.make_tensor_value_info("y", f, [3]), h.make_tensor_value_info("z", f, [3])])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    x = np.array([1.0, 2.0, 3.0], np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["y", "y", "z"], {"x": x})
    for backend in ("numpy", "onnxruntime"):
        got = InferenceSession(model.SerializeToString(), options(backend)).run(["y", "y", "z"], {"x": x})
        assert len(got) == 3
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
        got[0][0] = -1.0
        assert got[1][0] == 2.0, backend
    sess = TrainingSession(mlp_model().SerializeToString(), params(), options("onnxruntime"))
    x, y = batches(1, 16)[0]
    out = sess.run(["loss", "loss", "logits"], {"x": x, "y": y, "Learning_Rate": np.array([0.1], np.float32)})
    assert [o.shape for o in out] == [(), (), (16, 4)] and out[0] == out[1]


@pytest.mark.parametrize("zero_shape", [[], [1], [1, 1], [1, 1, 1]])
def test_where_with_a_zero_keeps_its_broadcast_shape_on_the_backend(zero_shape):
    """The backend's Where(mask, x, 0) → Mul rewrite: a one-value zero of higher rank than x and the mask
    broadcasts the output to its rank, which the Mul lost ((4,) for (1, 4)); now the rewrite keeps the
    Where there, and both backends give onnxruntime's shape and values."""
    f, h = onnx.TensorProto.FLOAT, onnx.helper
    zero = onnx.numpy_helper.from_array(np.zeros(zero_shape, np.float32), "zero")
    g = h.make_graph([h.make_node("Where", ["m", "x", "zero"], ["y"])], "g",
                     [h.make_tensor_value_info("m", onnx.TensorProto.BOOL, [4]),
                      h.make_tensor_value_info("x", f, [4])],
                     [h.make_tensor_value_info("y", f, None)], [zero])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    feeds = {"m": np.array([True, False, True, False]), "x": np.array([1.0, 2.0, -3.0, 4.0], np.float32)}
    cpu = ["CPUExecutionProvider"]
    want = ort.InferenceSession(model.SerializeToString(), providers=cpu).run(None, feeds)[0]
    for backend in ("numpy", "onnxruntime"):
        got = InferenceSession(model.SerializeToString(), options(backend)).run(None, feeds)[0]
        assert got.shape == want.shape, backend
        np.testing.assert_array_equal(got, want)


def test_the_float16_products_warning_is_only_for_float16_products():
    """A float16 cast that no MatMul, Gemm or Conv reads (an inference model's output cast, float16 moments)
    is not told that its products run in float32 (it was, for any Cast to float16)."""
    from onnxtrain.engine import backends

    f, h = onnx.TensorProto.FLOAT, onnx.helper
    g = h.make_graph([h.make_node("Relu", ["x"], ["r"]), h.make_node("Cast", ["r"], ["y"], to=10)], "g",
                     [h.make_tensor_value_info("x", f, [4])],
                     [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT16, [4])])
    cast_only = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    before = list(backends._warned_float16)
    backends._warned_float16.clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            backends._warn_float16_products(cast_only)
        product = onnx.ModelProto()
        product.CopyFrom(cast_only)
        w = onnx.numpy_helper.from_array(np.ones((4, 2), np.float16), "w")
        product.graph.initializer.append(w)
        product.graph.node.append(h.make_node("MatMul", ["y", "w"], ["z"]))
        with pytest.warns(UserWarning, match="no float16 MatMul, Gemm or Conv kernels"):
            backends._warn_float16_products(product)
    finally:
        backends._warned_float16[:] = before


def test_a_sequence_output_asked_for_twice_comes_back_as_two_lists():
    """The repeat's copy keeps the value's kind (a sequence is a list of arrays): it raised numpy's
    "inhomogeneous shape" for tensors of different sizes, as onnxruntime returns two lists."""
    f, h = onnx.TensorProto.FLOAT, onnx.helper
    nodes = [h.make_node("Concat", ["x", "x"], ["xx"], axis=0),
             h.make_node("SequenceConstruct", ["x", "xx"], ["s"]), h.make_node("Relu", ["x"], ["r"])]
    g = h.make_graph(nodes, "g",
                     [h.make_tensor_value_info("x", f, [3])],
                     [h.make_tensor_sequence_value_info("s", f, None), h.make_tensor_value_info("r", f, [3])])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    x = np.array([1.0, -2.0, 3.0], np.float32)
    for backend in ("numpy", "onnxruntime"):
        sess = InferenceSession(model.SerializeToString(), options(backend))
        s1, s2, r = sess.run(["s", "s", "r"], {"x": x})
        assert isinstance(s1, list) and isinstance(s2, list) and [a.shape for a in s2] == [(3,), (6,)]
        np.testing.assert_array_equal(s2[1], np.concatenate([x, x]))
        s2[0][0] = 7.0
        assert s1[0][0] == 1.0, backend


def test_bfloat16_and_float8_values_in_and_out_on_the_backend():
    """onnxruntime's binding has no numpy type for bfloat16 or float8: the backend binds such feeds as
    OrtValues over their memory and copies such outputs' bytes, so a graph that onnxruntime runs with them
    runs here too, with onnxruntime's values (given as OrtValues of the same bits) and the numpy engine's."""
    import onnxruntime as ort
    from onnx import TensorProto as T
    from onnx import helper

    from onnxtrain.ir.types import np_dtype

    nodes = [helper.make_node("Cast", ["x"], ["xf"], to=T.FLOAT),
             helper.make_node("Mul", ["xf", "xf"], ["y"]),
             helper.make_node("Cast", ["y"], ["y16"], to=T.BFLOAT16),
             helper.make_node("Cast", ["y"], ["y8"], to=T.FLOAT8E4M3FN)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.BFLOAT16, ["n"])],
                          [helper.make_tensor_value_info("y", T.FLOAT, ["n"]),
                           helper.make_tensor_value_info("y16", T.BFLOAT16, ["n"]),
                           helper.make_tensor_value_info("y8", T.FLOAT8E4M3FN, ["n"])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    x = np.array([1.5, -2.25, 3.0, 0.1], np.float32).astype(np_dtype(T.BFLOAT16))
    so = SessionOptions()
    so.add_session_config_entry(CONFIG_KEY, "onnxruntime")
    ours = InferenceSession(model.SerializeToString(), so).run(None, {"x": x})
    numpy_engine = InferenceSession(model.SerializeToString()).run(None, {"x": x})
    plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    theirs = plain.run_with_ort_values(None, {"x": ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
        x.view(np.uint16), T.BFLOAT16)})
    np.testing.assert_array_equal(ours[0], theirs[0].numpy())
    for k, code in ((1, T.BFLOAT16), (2, T.FLOAT8E4M3FN)):
        assert ours[k].dtype == np_dtype(code) and ours[k].shape == (4,)
        raw = np.frombuffer(bytes(ours[k].view(f"u{ours[k].itemsize}")), f"u{ours[k].itemsize}")
        np.testing.assert_array_equal(raw, numpy_engine[k].view(f"u{ours[k].itemsize}"))
        assert theirs[k].data_type() == f"tensor({'bfloat16' if k == 1 else 'float8e4m3fn'})"


def test_a_sequence_of_maps_on_the_backend_is_typed_and_copied_as_onnxruntime_does():
    """ZipMap's output (a sequence of maps, which onnxruntime runs on this backend): OrtValue.data_type()
    is the graph's type and IOBinding.copy_outputs_to_cpu() gives dicts, as plain onnxruntime does (it was
    typed from the first item as a string tensor, its items 0-d object arrays); so on the numpy engine,
    which has a ZipMap kernel too."""
    import onnxruntime as ort
    from onnx import TensorProto as T
    from onnx import helper

    import onnxtrain

    probs = helper.make_value_info("probabilities", helper.make_sequence_type_proto(
        helper.make_map_type_proto(T.INT64, helper.make_tensor_type_proto(T.FLOAT, []))))
    nodes = [helper.make_node("LinearClassifier", ["X"], ["label", "scores"], domain="ai.onnx.ml",
                              coefficients=[0.1, 0.2, -0.3, 0.5, -0.1, 0.2], intercepts=[0.1, -0.2],
                              classlabels_ints=[0, 1], post_transform="LOGISTIC"),
             helper.make_node("ZipMap", ["scores"], ["probabilities"], domain="ai.onnx.ml",
                              classlabels_int64s=[0, 1])]
    g = helper.make_graph(nodes, "clf", [helper.make_tensor_value_info("X", T.FLOAT, ["N", 3])],
                          [helper.make_tensor_value_info("label", T.INT64, ["N"]), probs])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)]
    model = helper.make_model(g, opset_imports=opsets, ir_version=9).SerializeToString()
    x = np.array([[1, 2, 3], [0.5, -1, 2]], np.float32)
    so = SessionOptions()
    so.add_session_config_entry(CONFIG_KEY, "onnxruntime")
    got = {}
    for name, mod, sess in (("ours", onnxtrain, InferenceSession(model, so)),
                            ("numpy", onnxtrain, InferenceSession(model)),
                            ("theirs", ort, ort.InferenceSession(model, providers=["CPUExecutionProvider"]))):
        values = sess.run_with_ort_values(None, {"X": mod.OrtValue.ortvalue_from_numpy(x)})
        io = sess.io_binding()
        io.bind_cpu_input("X", x)
        io.bind_output("label")
        io.bind_output("probabilities")
        sess.run_with_iobinding(io)
        got[name] = (values[1].data_type(), io.copy_outputs_to_cpu()[1])
    for ours in ("ours", "numpy"):
        assert got[ours][0] == got["theirs"][0] == "seq(map(int64,tensor(float)))"
        assert all(type(item) is dict for item in got[ours][1])
        for a, b in zip(got[ours][1], got["theirs"][1]):
            assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-6 for k in a)


def test_a_weight_used_by_two_outputs_of_a_split_trains_on_the_backend():
    """q, k, v = Split(X); loss = Σ (v·W)(q·W): W's gradient sums two Gemms, one reading the Split's third
    output, which onnxruntime's GemmSumFusion cannot take (an assertion when the session loads: the legacy
    session and Module on the backend failed). The backend's steps equal the numpy engine's."""
    rng = np.random.default_rng(0)
    f = onnx.TensorProto.FLOAT
    h = onnx.helper
    nodes = [h.make_node("Split", ["X"], ["q", "k", "v"], axis=1, num_outputs=3),
             h.make_node("MatMul", ["v", "W"], ["a"]), h.make_node("MatMul", ["q", "W"], ["b"]),
             h.make_node("Mul", ["a", "b"], ["ab"]), h.make_node("ReduceSum", ["ab"], ["loss"], keepdims=0)]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("X", f, [2, 6])],
                     [h.make_tensor_value_info("loss", f, [])],
                     [onnx.numpy_helper.from_array(rng.standard_normal((2, 3)).astype(np.float32), "W")])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 18)]).SerializeToString()
    x = rng.standard_normal((2, 6)).astype(np.float32)
    runs = {}
    for backend in ("numpy", "onnxruntime"):
        sess = TrainingSession(model, params(), options(backend))
        losses = [float(sess.run(["loss"], {"X": x, "Learning_Rate": np.array([0.05], np.float32)})[0])
                  for _ in range(3)]
        runs[backend] = (losses, sess.get_state()["W"])
    np.testing.assert_allclose(runs["onnxruntime"][0], runs["numpy"][0], rtol=1e-5)
    np.testing.assert_allclose(runs["onnxruntime"][1], runs["numpy"][1], rtol=1e-5)
    assert runs["numpy"][0][0] != runs["numpy"][0][2]
