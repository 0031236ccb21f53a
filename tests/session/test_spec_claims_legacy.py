"""Claims of the legacy spec (../shared/spec/legacy-training-session.md) that no other test showed.

§6: every ``TrainingParameters`` property set away from its default either acts (the state, the session's
inputs/outputs, the training graph or a written file differ from a default session's) or is refused or
warned about by name; so is every ``SessionOptions`` and ``RunOptions`` field a training session takes.
§5: the layouts of the state APIs. §3: the gradient outputs are the raw gradients of the micro-step.
§14: container properties are copies. §16.1: one SGD step is −lr·∂loss/∂w. Oracles: torch autograd and
float64 closed forms written here.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain import RunOptions, SessionOptions, TrainingParameters, TrainingSession
from onnxtrain.ir.builder import make_model
from onnxtrain.parameters import _DEFAULTS
from tests.session.helpers import backend_options, batches, mlp_model, params, weights_of

WEIGHTS = ("W1", "b1", "W2", "b2")
LR = np.array([0.1], np.float32)

# property -> (a value other than its default, what a session does with it on one process: "acts",
# "warns" (naming the property) or "refused" (an error naming it)); the MLP trained by Adam
PROPERTIES: dict[str, tuple[Any, str]] = {
    "loss_output_name": ("logits", "warns"),  # not one value: the sum's gradients, said so
    "weights_to_train": ({"W2"}, "acts"),
    "weights_not_to_train": ({"W1"}, "acts"),
    "immutable_weights": ({"Div": [(1, 8.0)]}, "warns"),  # no such scalar in the MLP
    "training_optimizer_name": ("LambOptimizer", "acts"),
    "lr_params_feed_name": ("lr", "acts"),
    "optimizer_attributes_map": ({w: {"alpha": 0.5} for w in WEIGHTS}, "acts"),
    "optimizer_int_attributes_map": ({w: {"do_bias_correction": 0} for w in WEIGHTS}, "acts"),
    "loss_scale": (4.0, "warns"),  # unused, as in onnxruntime (spec D1)
    # onnxruntime 1.2-1.3's names of a model's own loss scaling: read under mixed precision only
    "scaled_loss_output_name": ("scaled_loss", "warns"),
    "loss_scale_input_name": ("scale", "warns"),
    "world_rank": (1, "refused"),  # not started by mpiexec
    "world_size": (2, "refused"),
    "data_parallel_size": (2, "refused"),
    "enable_adasum": (True, "warns"),  # one data-parallel rank
    "deepspeed_zero_stage": (1, "warns"),
    "gradient_accumulation_steps": (2, "acts"),
    "enable_grad_norm_clip": (False, "acts"),
    "use_fp16_moments": (True, "acts"),
    "use_memory_efficient_gradient": (True, "warns"),  # no LayerNormalization
    "set_gradients_as_graph_outputs": (True, "acts"),
    "propagate_cast_ops_level": (2, "warns"),
    "propagate_cast_ops_allow": (["Relu"], "warns"),
    "model_after_graph_transforms_path": ("after.onnx", "acts"),
    "model_with_gradient_graph_path": ("gradient.onnx", "acts"),
    "model_with_training_graph_path": ("training.onnx", "acts"),
    "legacy_cpu_adam": (True, "acts"),
    # README: the session counts N micro-steps and updates on the N-th; with N = 1, every run, as in "legacy"
    "gradient_accumulation_mode": ("auto", "documented no-op"),
    "use_mixed_precision": (True, "acts"),
    "allow_layer_norm_mod_precision": (True, "warns"),
    "mixed_precision_dtype": ("bfloat16", "warns"),  # without use_mixed_precision
    "attn_dropout_recompute": (True, "warns"),  # nothing the option selects
    "gelu_recompute": (True, "warns"),
    "transformer_layer_recompute": (True, "warns"),
    "number_recompute_layers": (2, "warns"),
    "recompute_checkpoints": (["h"], "acts"),
    "horizontal_parallel_size": (2, "refused"),
    # onnxtrain sums float32 gradients, which is what False asked for; without mixed precision either
    # value means the same
    "perform_fp16_allreduce": (False, "documented no-op"),
    "pipeline_parallel_size": (2, "refused"),
    "num_pipeline_micro_batches": (2, "warns"),
    "pipeline_cut_info_string": ("h", "warns"),
    "sliced_schema": ({"x": [4, 8]}, "warns"),
    "sliced_axes": ({"x": 0}, "warns"),
    "sliced_tensor_names": (["x"], "warns"),
    # README ("Data parallelism over MPI"): accepted and changes nothing (onnxruntime's NCCL switch, spec D4)
    "allreduce_post_accumulation": (True, "documented no-op"),
}


def _mentions(text: str, name: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", text) is not None


def _observe(p: TrainingParameters, so: SessionOptions | None = None, steps: int = 2) -> dict[str, Any]:
    """What a session of ``p`` shows: its state after ``steps`` Adam runs on large inputs (so that clipping
    acts), inputs, outputs and training graph; or the error it raised. Warnings are recorded."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        try:
            sess = TrainingSession(mlp_model().SerializeToString(), p, so)
            lr_name = p.lr_params_feed_name
            for x, y in batches(steps, 8):
                feeds = {"x": x * 30, "y": y, lr_name: LR}
                if sess.loss_scale_input_name:
                    feeds[sess.loss_scale_input_name] = np.array([8.0], np.float32)
                sess.run(None, feeds)
            out: dict[str, Any] = {
                "state": sess.get_state(), "inputs": [i.name for i in sess.get_inputs()],
                "outputs": [o.name for o in sess.get_outputs()],
                "graph": [n.op_type for n in sess._graphs.full.graph.node], "session": sess,
            }
        except Exception as e:  # noqa: BLE001 - the error is what is observed
            out = {"error": e}
    out["warnings"] = [str(w.message) for w in got]
    return out


def _same_state(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def default_session() -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a default session warns about nothing
        return _observe(params("AdamOptimizer"))


def test_the_sweep_covers_every_property() -> None:
    assert set(PROPERTIES) == set(_DEFAULTS)
    for name, (value, _) in PROPERTIES.items():
        assert value != _DEFAULTS[name], name


@pytest.mark.parametrize("name", sorted(PROPERTIES))
def test_a_property_away_from_its_default_acts_or_says_so(name: str, default_session, tmp_path,
                                                         monkeypatch) -> None:
    """Spec §6: no property set by a script is silently ignored."""
    monkeypatch.chdir(tmp_path)
    value, expected = PROPERTIES[name]
    got = _observe(params("AdamOptimizer", **{name: value}))
    named = [w for w in got["warnings"] if _mentions(w, name)]
    if expected == "refused":
        assert "error" in got and _mentions(str(got["error"]), name), got
        return
    assert "error" not in got, got["error"]
    if expected == "warns":
        assert named, f"no warning names {name}: {got['warnings']}"
        return
    assert not named, named
    base = default_session
    changed = (not _same_state(got["state"], base["state"]) or got["inputs"] != base["inputs"]
               or got["outputs"] != base["outputs"] or got["graph"] != base["graph"])
    if name.endswith("_path"):
        changed = os.path.exists(value) and onnx.load(value).graph.node  # the dump was written
    if expected == "acts":
        assert changed, f"{name}={value!r} changed nothing and said nothing"
    else:  # documented to change nothing: it does not, and the session takes it quietly
        assert not changed and not got["warnings"], got["warnings"]


def test_gradient_accumulation_mode_auto_acts_with_accumulation_steps() -> None:
    """With gradient_accumulation_steps > 1, ``auto`` is taken quietly and counts the micro-steps."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sess = TrainingSession(mlp_model().SerializeToString(),
                               params("SGDOptimizer", gradient_accumulation_mode="auto",
                                      gradient_accumulation_steps=2))
    assert sess.next_run_updates is False


# ---- SessionOptions and RunOptions fields ----------------------------------------------------------------

def _fields(obj: Any) -> set[str]:
    return {k for k in vars(obj) if not k.startswith("_")}


def test_use_per_session_threads_false_is_said_to_change_nothing() -> None:
    """onnxruntime refuses ``use_per_session_threads = False`` unless its environment has global thread
    pools; every onnxtrain session has its own threads, and the session says so rather than ignore it."""
    import onnxruntime

    model = mlp_model().SerializeToString()
    theirs = onnxruntime.SessionOptions()
    theirs.use_per_session_threads = False
    with pytest.raises(Exception, match="per session threadpools"):  # noqa: B017 - onnxruntime's Fail
        onnxruntime.InferenceSession(model, theirs, providers=["CPUExecutionProvider"])
    for backend in ("numpy", "onnxruntime"):
        so = backend_options(backend)
        so.use_per_session_threads = False
        with pytest.warns(UserWarning, match="use_per_session_threads"):
            TrainingSession(model, params("SGDOptimizer"), so)


# SessionOptions field -> (a value other than its default, what a training session on the numpy engine does)
SESSION_FIELDS: dict[str, tuple[Any, str]] = {
    "enable_profiling": (True, "acts"),  # end_profiling() writes the trace
    "profile_file_prefix": ("mine_", "acts with enable_profiling"),
    "optimized_model_filepath": ("optimized.onnx", "acts"),
    "graph_optimization_level": (0, "acts"),  # no plan-time fusions (tests/engine)
    "intra_op_num_threads": (1, "acts"),  # (tests/engine/test_batch_split.py and others)
    "execution_mode": (1, "warns"),
    "execution_order": ("PRIORITY_BASED", "warns"),
    "inter_op_num_threads": (2, "warns"),
    "enable_mem_pattern": (False, "warns"),
    "enable_mem_reuse": (False, "warns"),
    "enable_cpu_mem_arena": (False, "warns"),
    "use_per_session_threads": (False, "warns"),
    # the numpy engine gives the same bits run after run: what the option asks for
    "use_deterministic_compute": (True, "acts"),
    # README: the numpy engine has no logger (onnxtrain's messages are Python warnings); on the onnxruntime
    # backend they reach onnxruntime's session (test_log_fields_reach_onnxruntime)
    "log_severity_level": (0, "documented no-op"),
    "log_verbosity_level": (1, "documented no-op"),
    "logid": ("mine", "documented no-op"),
}


def test_the_session_options_sweep_covers_every_field() -> None:
    assert set(SESSION_FIELDS) == _fields(SessionOptions())


@pytest.mark.parametrize("name", sorted(k for k, (_, e) in SESSION_FIELDS.items() if e == "warns"))
def test_session_options_without_effect_on_the_numpy_engine_say_so(name: str) -> None:
    so = SessionOptions()
    setattr(so, name, SESSION_FIELDS[name][0])
    got = _observe(params("AdamOptimizer"), so, steps=1)
    assert "error" not in got, got["error"]
    assert any(_mentions(w, name) for w in got["warnings"]), got["warnings"]


def test_profiling_options_write_the_named_trace(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    so = SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = "mine_"
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    got = _observe(params("AdamOptimizer"), so, steps=1)
    path = got["session"].end_profiling()
    assert os.path.basename(path).startswith("mine_") and os.path.getsize(path) > 0
    onnx.checker.check_model(onnx.load(so.optimized_model_filepath))


def test_deterministic_compute_gives_the_same_bits_twice() -> None:
    so = SessionOptions()
    so.use_deterministic_compute = True
    a, b = (_observe(params("AdamOptimizer"), so, steps=3) for _ in range(2))
    assert _same_state(a["state"], b["state"])


def test_log_fields_reach_onnxruntime(capfd) -> None:
    """On the onnxruntime backend the session's ``logid`` and ``log_severity_level`` are onnxruntime's."""
    so = backend_options("onnxruntime")
    so.log_severity_level = 0
    so.log_verbosity_level = 1
    so.logid = "spec-claims-logid"
    capfd.readouterr()
    TrainingSession(mlp_model().SerializeToString(), params("SGDOptimizer"), so)
    err = capfd.readouterr().err
    assert "onnxruntime:spec-claims-logid" in err, err[-2000:]


# RunOptions field -> (a value other than its default, what a training run does)
RUN_FIELDS: dict[str, tuple[Any, str]] = {
    "only_execute_path_to_fetches": (True, "acts"),  # no update (test_run_options_act)
    "training_mode": (False, "acts"),  # Dropout off (tests/session/test_dropout_mode_inputs.py)
    "terminate": (True, "acts"),  # the run is refused
    # README ("Inference"): the numpy engine has no logger; on the onnxruntime backend they reach its run
    "log_severity_level": (0, "documented no-op"),
    "log_verbosity_level": (1, "documented no-op"),
    "logid": ("mine", "documented no-op"),
    "run_tag": ("mine", "documented no-op"),
}


def test_the_run_options_sweep_covers_every_field() -> None:
    assert set(RUN_FIELDS) == _fields(RunOptions())


def test_run_options_act() -> None:
    from onnxtrain.capi.onnxruntime_pybind11_state import Fail

    sess = TrainingSession(mlp_model().SerializeToString(), params("SGDOptimizer"))
    x, y = batches(1, 8)[0]
    feeds = {"x": x, "y": y, "Learning_Rate": LR}
    before = sess.get_state()
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    sess.run(["loss"], feeds, ro)
    assert _same_state(sess.get_state(), before)
    ro = RunOptions()
    ro.terminate = True
    with pytest.raises(Fail, match="terminate"):
        sess.run(["loss"], feeds, ro)
    assert _same_state(sess.get_state(), before)


# ---- §5 state APIs ----------------------------------------------------------------------------------------

STATE_NAMES = {  # spec §5.1 / §3.3: the state's names for each optimizer, sorted
    "SGDOptimizer": list(WEIGHTS),
    "AdamOptimizer": [*WEIGHTS,
                      *(f"{k}_{w}" for k in ("Moment_1", "Moment_2", "Update_Count") for w in WEIGHTS)],
    "LambOptimizer": [*WEIGHTS, *(f"{k}_{w}" for k in ("Moment_1", "Moment_2") for w in WEIGHTS), "Step"],
}


def _run(sess: TrainingSession, steps: int = 1, scale: float = 8.0) -> None:
    for x, y in batches(steps, 8):
        feeds = {"x": x, "y": y, "Learning_Rate": LR}
        if sess.loss_scale_input_name:
            feeds[sess.loss_scale_input_name] = np.array([scale], np.float32)
        sess.run(["loss"], feeds)


@pytest.mark.parametrize("opt", sorted(STATE_NAMES))
def test_state_and_optimizer_state_layouts(opt: str) -> None:
    """§5.1: get_state is sorted by name and holds the trained weights and the optimizer's state only;
    §5.4: get_optimizer_state's layout, counters int64 [1] from 1; §5.6: nothing partitioned."""
    sess = TrainingSession(mlp_model().SerializeToString(), params(opt, weights_not_to_train={"b1"}))
    state = sess.get_state()
    want = sorted(n for n in STATE_NAMES[opt] if not n.endswith("b1"))
    assert list(state) == want
    shapes = {k: v.shape for k, v in weights_of(mlp_model()).items()}
    layout = sess.get_optimizer_state()
    if opt == "SGDOptimizer":
        assert layout == {}
    else:
        per_weight = {k: v for k, v in layout.items() if k != "shared_optimizer_state"}
        assert sorted(per_weight) == ["W1", "W2", "b2"]
        keys = ["Moment_1", "Moment_2"] + (["Update_Count"] if opt == "AdamOptimizer" else [])
        for w, d in per_weight.items():
            assert sorted(d) == keys, (w, d.keys())
            for k in ("Moment_1", "Moment_2"):
                assert d[k].shape == shapes[w] and d[k].dtype == np.float32 and not d[k].any()
        counters = ([d["Update_Count"] for d in per_weight.values()] if opt == "AdamOptimizer"
                    else [layout["shared_optimizer_state"]["Step"]])
        if opt == "LambOptimizer":
            assert list(layout["shared_optimizer_state"]) == ["Step"]  # not "step" (spec D6)
        for c in counters:
            assert c.dtype == np.int64 and c.shape == (1,) and c[0] == 1
        _run(sess, 2)
        layout = sess.get_optimizer_state()
        counters = ([d["Update_Count"] for k, d in layout.items() if k != "shared_optimizer_state"]
                    if opt == "AdamOptimizer" else [layout["shared_optimizer_state"]["Step"]])
        assert all(c[0] == 3 for c in counters)
    assert sess.get_partition_info_map() == {}


def test_model_state_with_the_mixed_precision_weights() -> None:
    """§5.3: ``mixed_precision`` is empty without mixed precision, else the float16 casts of the masters."""
    plain = TrainingSession(mlp_model().SerializeToString(), params("AdamOptimizer"))
    got = plain.get_model_state(include_mixed_precision_weights=True)
    assert sorted(got) == ["full_precision", "mixed_precision"] and got["mixed_precision"] == {}
    assert list(plain.get_model_state()) == ["full_precision"]
    mp = TrainingSession(mlp_model().SerializeToString(), params("AdamOptimizer", use_mixed_precision=True))
    _run(mp, 2)
    got = mp.get_model_state(include_mixed_precision_weights=True)
    assert sorted(got["full_precision"]) == sorted(got["mixed_precision"]) == sorted(WEIGHTS)
    for w, master in got["full_precision"].items():
        half = got["mixed_precision"][w]
        assert master.dtype == np.float32 and half.dtype == np.float16
        np.testing.assert_array_equal(half, master.astype(np.float16), err_msg=w)
        np.testing.assert_array_equal(mp.get_state()[f"{w}_fp16"], half, err_msg=w)


def test_initial_optimizer_state_checks_and_defaults() -> None:
    """§5.5: counters int64 [1], moments of the weight's shape (an error naming the state otherwise);
    what is left out starts at zero moments and count 1."""
    model = mlp_model().SerializeToString()
    bad = [("Update_Count", np.array([3], np.int32), TypeError),
           ("Update_Count", np.array(3, np.int64), ValueError),
           ("Moment_1", np.ones((8, 16), np.float32), ValueError)]
    for key, value, error in bad:
        p = params("AdamOptimizer")
        p.set_optimizer_initial_state({"W1": {key: value}})
        with pytest.raises(error, match=f"{key}_W1"):
            TrainingSession(model, p)
    p = params("AdamOptimizer")
    m1 = np.full((16, 8), 0.25, np.float32)
    p.set_optimizer_initial_state({"W1": {"Moment_1": m1, "Update_Count": np.array([7], np.int64)}})
    got = TrainingSession(model, p).get_optimizer_state()
    np.testing.assert_array_equal(got["W1"]["Moment_1"], m1)
    assert got["W1"]["Update_Count"][0] == 7 and not got["W1"]["Moment_2"].any()
    assert got["W2"]["Update_Count"][0] == 1 and not got["W2"]["Moment_1"].any()
    # README: a narrower float type is widened exactly (onnxruntime wanted the moment's own); a wider one
    # would round and is refused
    half = (np.arange(128, dtype=np.float32) / 7).astype(np.float16).reshape(16, 8)
    p = params("AdamOptimizer")
    p.set_optimizer_initial_state({"W1": {"Moment_2": half}})
    got = TrainingSession(model, p).get_optimizer_state()["W1"]["Moment_2"]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, half.astype(np.float32))
    p = params("AdamOptimizer", use_fp16_moments=True)
    p.set_optimizer_initial_state({"W1": {"Moment_2": half.astype(np.float32)}})
    with pytest.raises(TypeError, match="Moment_2_W1"):
        TrainingSession(model, p)


def test_is_output_fp32_node() -> None:
    """§5.7: true for a float32 node output, false for another type, an error naming the value for a graph
    input, an initializer or an unknown name. Under mixed precision an intermediate value computed in
    float16 is not, while the model's float32 outputs stay float32 (README: onnxruntime's answered false
    for those outside the loss's subgraph)."""
    from onnxtrain.capi.onnxruntime_pybind11_state import InvalidArgument

    model = mlp_model()
    model.graph.node.append(helper.make_node("ArgMax", ["logits"], ["label"], axis=1, keepdims=0))
    model.graph.output.append(helper.make_tensor_value_info("label", T.INT64, ["N"]))
    for kw in ({}, {"use_mixed_precision": True}):
        sess = TrainingSession(model.SerializeToString(), params("SGDOptimizer", **kw))
        assert sess.is_output_fp32_node("loss") and sess.is_output_fp32_node("logits")
        assert sess.is_output_fp32_node("h") == (not kw)  # the first Gemm's: float16 under mixed precision
        assert not sess.is_output_fp32_node("label")
        for name in ("x", "W1", "nope"):
            with pytest.raises(InvalidArgument, match=repr(name)):
                sess.is_output_fp32_node(name)


# ---- §3 the gradient outputs ------------------------------------------------------------------------------

def _torch_gradients(model: onnx.ModelProto, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """The MLP's loss gradients by torch autograd in float64."""
    torch = pytest.importorskip("torch")
    w = {k: torch.tensor(v.astype(np.float64), requires_grad=True) for k, v in weights_of(model).items()}
    h = torch.relu(torch.from_numpy(x.astype(np.float64)) @ w["W1"].T + w["b1"])
    logits = h @ w["W2"].T + w["b2"]
    torch.nn.functional.cross_entropy(logits, torch.from_numpy(y)).backward()
    return {k: v.grad.numpy() for k, v in w.items()}


@pytest.mark.parametrize("mp", [False, True], ids=["float32", "mixed-precision"])
def test_gradient_outputs_are_the_micro_steps_own(mp: bool) -> None:
    """§3.2: ``<w>_grad`` is the raw gradient of the run's micro-batch: not accumulated over the micro-steps,
    loss-scaled under mixed precision (and then ``<w>_fp16_grad`` too, its float16 cast). The weights are
    those the gradients were taken at: SGD at learning rate 0 leaves them."""
    model = mlp_model()
    sess = TrainingSession(model.SerializeToString(),
                           params("SGDOptimizer", gradient_accumulation_steps=2, use_mixed_precision=mp,
                                  set_gradients_as_graph_outputs=True))
    scale = 64.0 if mp else 1.0
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    names = [f"{w}_grad" for w in WEIGHTS] + ([f"{w}_fp16_grad" for w in WEIGHTS] if mp else [])
    for step, (x, y) in enumerate(batches(2, 8)):
        feeds = {"x": x, "y": y, "Learning_Rate": np.zeros(1, np.float32)}
        if mp:
            feeds[sess.loss_scale_input_name] = np.array([scale], np.float32)
        micro = step == 0  # the legacy protocol: accumulate only, then the full run
        got = sess.run([*names, "Group_Accumulated_Gradients"] if micro else names, feeds,
                       ro if micro else None)
        got = dict(zip(names, got))
        want = _torch_gradients(model, x, y)
        for w in WEIGHTS:
            tol = 2e-2 if mp else 1e-5
            np.testing.assert_allclose(got[f"{w}_grad"], scale * want[w], rtol=tol, atol=tol * scale * 1e-2,
                                       err_msg=f"step {step} {w}")
            if mp:
                np.testing.assert_array_equal(got[f"{w}_fp16_grad"], got[f"{w}_grad"].astype(np.float16))


# ---- §14 pitfalls, §16 checklist --------------------------------------------------------------------------

def test_container_properties_are_copies() -> None:
    """§14.5: in-place changes of a property's container are lost, as the binding's converted copies;
    assigning the whole container takes."""
    p = TrainingParameters()
    p.weights_to_train.add("W1")
    p.optimizer_attributes_map["W1"] = {"alpha": 0.5}
    p.immutable_weights["Div"] = [(1, 8.0)]
    p.propagate_cast_ops_allow.append("Relu")
    assert p.weights_to_train == set() and p.optimizer_attributes_map == {}
    assert p.immutable_weights == {} and p.propagate_cast_ops_allow == []
    p.weights_to_train = {"W1"}
    assert p.weights_to_train == {"W1"}


def test_one_sgd_step_on_linear_regression_is_minus_lr_times_the_gradient() -> None:
    """§16.1: MatMul + Add + Sub + Mul + ReduceSum, SGD: one run moves ``coefs`` by −lr·2·Xᵀ(X·c + b − y)
    (float64 closed form)."""
    rng = np.random.default_rng(3)
    c0 = rng.standard_normal((3, 1)).astype(np.float32)
    b0 = np.array([0.5], np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["X", "coefs"], ["p"]),
         helper.make_node("Add", ["p", "intercept"], ["q"]),
         helper.make_node("Sub", ["q", "label"], ["r"]), helper.make_node("Mul", ["r", "r"], ["r2"]),
         helper.make_node("ReduceSum", ["r2"], ["loss"], keepdims=0)],
        "linreg", [helper.make_tensor_value_info("X", T.FLOAT, ["N", 3]),
                   helper.make_tensor_value_info("label", T.FLOAT, ["N", 1])],
        [helper.make_tensor_value_info("loss", T.FLOAT, []),
         helper.make_tensor_value_info("q", T.FLOAT, ["N", 1])],
        [numpy_helper.from_array(c0, "coefs"), numpy_helper.from_array(b0, "intercept")])
    sess = TrainingSession(make_model(g, 17).SerializeToString(), params("SGDOptimizer"))
    assert [i.name for i in sess.get_inputs()] == ["X", "label", "Learning_Rate"]  # §16.2
    assert [o.name for o in sess.get_outputs()] == ["loss", "q", "global_gradient_norm"]
    x = rng.standard_normal((10, 3)).astype(np.float32)
    y = rng.standard_normal((10, 1)).astype(np.float32)
    lr = 0.01
    sess.run(["loss"], {"X": x, "label": y, "Learning_Rate": np.array([lr], np.float32)})
    x64, c64 = x.astype(np.float64), c0.astype(np.float64)
    r = x64 @ c64 + b0.astype(np.float64) - y
    state = sess.get_state()
    np.testing.assert_allclose(state["coefs"], c64 - lr * 2 * x64.T @ r, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(state["intercept"], b0 - lr * 2 * r.sum(0), rtol=1e-6, atol=1e-7)


# ---- §12.3 custom stop-gradient edges ---------------------------------------------------------------------

@pytest.fixture
def custom_stops():
    """register_custom_stop_gradient_edges, with the registrations undone after the test."""
    from onnxtrain.autodiff import registry
    from onnxtrain.capi._pybind_state import register_custom_stop_gradient_edges

    saved = dict(registry._CUSTOM_STOPS)
    yield register_custom_stop_gradient_edges
    registry._CUSTOM_STOPS.clear()
    registry._CUSTOM_STOPS.update(saved)


def _product_model() -> onnx.ModelProto:
    """loss = ReduceSum(Mul(x, W) + Mul(x, V)): W and V initializers."""
    rng = np.random.default_rng(5)
    g = helper.make_graph(
        [helper.make_node("Mul", ["x", "W"], ["a"]), helper.make_node("Mul", ["V", "x"], ["b"]),
         helper.make_node("Add", ["a", "b"], ["c"]),
         helper.make_node("ReduceSum", ["c"], ["loss"], keepdims=0)],
        "product", [helper.make_tensor_value_info("x", T.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("loss", T.FLOAT, [])],
        [numpy_helper.from_array(rng.standard_normal((2, 3)).astype(np.float32), "W"),
         numpy_helper.from_array(rng.standard_normal((2, 3)).astype(np.float32), "V")])
    return make_model(g, 17)


def test_custom_stop_gradient_edges(custom_stops) -> None:
    """§12.3: ``register_custom_stop_gradient_edges("domain::op", slots)`` (onnxruntime's binding): those
    input slots get no gradient, in the GradientGraphBuilder and in the legacy session's weight discovery."""
    from onnxtrain import GradientGraphBuilder
    from onnxtrain.autodiff.builder import GradientError

    model = _product_model().SerializeToString()
    custom_stops("::Mul", {1})  # Mul's second input: W in x·W, but x in V·x
    b = GradientGraphBuilder(model, {"loss"}, ["x", "V"], "loss")
    b.build()
    built = onnx.load_from_string(b.get_model())
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    import onnxruntime

    got = onnxruntime.InferenceSession(built.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["x_grad", "V_grad"], {"x": x})
    w = weights_of(_product_model())
    np.testing.assert_allclose(got[0], w["W"], rtol=1e-6)  # d/dx through x·W only (V·x's x is stopped)
    np.testing.assert_allclose(got[1], x, rtol=1e-6)
    with pytest.raises(GradientError, match="'W'"):
        GradientGraphBuilder(model, {"loss"}, ["W"], "loss").build()
    sess = TrainingSession(model, params("SGDOptimizer"))
    assert sorted(sess.get_state()) == ["V"]
    with pytest.raises(TypeError, match="register_custom_stop_gradient_edges"):
        custom_stops("::Mul", 1)
    with pytest.warns(UserWarning, match="'com.microsoft' change nothing"):
        custom_stops("com.microsoft::FusedMatMul", {1})


# ---- §3.1/§3.2 the inputs and outputs the session adds ----------------------------------------------

@pytest.mark.parametrize("opt", ["", "SGDOptimizer", "AdamOptimizer"])
@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("mp", [False, True])
@pytest.mark.parametrize("steps", [1, 2])
def test_added_inputs_and_outputs(opt: str, clip: bool, mp: bool, steps: int) -> None:
    """Spec §3: after the model's own, ``loss_scale`` (mixed precision) then the learning rate (an optimizer),
    float32 [1] each; ``Group_Accumulated_Gradients`` (optimizer and N > 1), ``global_gradient_norm``
    (optimizer with clipping or mixed precision: the optimizer graph computes it), ``all_gradients_finite``
    (optimizer and mixed precision); the flags bool [1], the norm a float32 scalar."""
    if not opt and steps > 1:
        pytest.skip("accumulation needs an optimizer (test_accumulation_without_an_optimizer_is_refused)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no optimizer: it says so)
        sess = TrainingSession(mlp_model().SerializeToString(),
                               params(opt, enable_grad_norm_clip=clip, use_mixed_precision=mp,
                                      gradient_accumulation_steps=steps))
    inputs = [(i.name, i.type, i.shape) for i in sess.get_inputs()]
    want = [("x", "tensor(float)", ["N", 8]), ("y", "tensor(int64)", ["N"])]
    want += [("loss_scale", "tensor(float)", [1])] if mp else []
    want += [("Learning_Rate", "tensor(float)", [1])] if opt else []
    assert inputs == want
    assert sess.loss_scale_input_name == ("loss_scale" if mp else None)
    outputs = {o.name: (o.type, o.shape) for o in sess.get_outputs()}
    assert list(outputs)[:2] == ["loss", "logits"]
    extra = {}
    if opt and steps > 1:
        extra["Group_Accumulated_Gradients"] = ("tensor(bool)", [1])
    if opt and (clip or mp):
        extra["global_gradient_norm"] = ("tensor(float)", [])
    if opt and mp:
        extra["all_gradients_finite"] = ("tensor(bool)", [1])
    assert {k: v for k, v in outputs.items() if k not in ("loss", "logits")} == extra
    x, y = batches(1, 8)[0]
    feeds = {"x": x, "y": y, "Learning_Rate": LR, "loss_scale": np.array([4.0], np.float32)}
    got = sess.run(list(extra), {i.name: feeds[i.name] for i in sess.get_inputs()})
    for (name, (_, shape)), value in zip(extra.items(), got):
        assert list(value.shape) == shape
        assert value.dtype == (np.float32 if name.startswith("global") else bool)


def test_training_mode_is_an_overridable_initializer() -> None:
    """Spec U1/§4.5: a model with a 3-input Dropout gets the shared ``training_mode``, listed among the
    overridable initializers, not the inputs; fed False, the Dropout passes its input as onnxruntime's
    inference of the model in eval mode does."""
    import onnxruntime

    model = mlp_model()
    for n in model.graph.node:
        if n.op_type == "Relu":
            n.output[0] = "hr0"
    model.graph.node.insert(2, helper.make_node("Dropout", ["hr0", "ratio", "mode"], ["hr"], seed=3))
    model.graph.initializer.extend([numpy_helper.from_array(np.array(0.5, np.float32), "ratio"),
                                    numpy_helper.from_array(np.array(True), "mode")])
    sess = TrainingSession(model.SerializeToString(), params("SGDOptimizer"))
    assert [i.name for i in sess.get_inputs()] == ["x", "y", "Learning_Rate"]
    overridable = [(i.name, i.type) for i in sess.get_overridable_initializers()]
    assert overridable == [("training_mode", "tensor(bool)")]
    x, y = batches(1, 8)[0]
    before = sess.get_state()
    got = sess.run(["loss", "logits"], {"x": x, "y": y, "Learning_Rate": np.zeros(1, np.float32),
                                        "training_mode": np.array(False)})
    eval_model = onnx.ModelProto()
    eval_model.CopyFrom(model)
    next(t for t in eval_model.graph.initializer if t.name == "mode").CopyFrom(
        numpy_helper.from_array(np.array(False), "mode"))
    ort = onnxruntime.InferenceSession(eval_model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = ort.run(["loss", "logits"], {"x": x, "y": y})
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert _same_state(sess.get_state(), before)  # SGD at learning rate 0
    # without the feed, the model's own mode (True): the Dropout drops
    trained = sess.run(["logits"], {"x": x, "y": y, "Learning_Rate": np.zeros(1, np.float32)})[0]
    assert not np.allclose(trained, want[1], rtol=1e-3)


@pytest.mark.parametrize("opt", ["SGDOptimizer", "AdamOptimizer", "LambOptimizer"])
def test_a_skipped_accumulated_step_discards_the_sums(opt: str) -> None:
    """Spec §4.3/§16.8: under mixed precision, an accumulation whose gradients are not finite skips the update
    (weights as the model's, counters at 1) and still resets the buffers: the next accumulation updates as
    a session that never saw the skipped one."""
    model = mlp_model().SerializeToString()

    def session() -> TrainingSession:
        return TrainingSession(model, params(opt, use_mixed_precision=True, gradient_accumulation_steps=2))

    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    data = batches(4, 8)

    def feeds(x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
        return {"x": x, "y": y, "Learning_Rate": np.array([0.01], np.float32),
                "loss_scale": np.array([1024.0], np.float32)}

    skipped, fresh = session(), session()
    x0, y0 = data[0]
    skipped.run(["loss", "Group_Accumulated_Gradients"], feeds(x0 * np.float32(1e30), y0), ro)
    assert not skipped.run(["all_gradients_finite"], feeds(*data[1]))[0][0]
    state = skipped.get_state()
    initial = weights_of(mlp_model())
    for w in WEIGHTS:
        np.testing.assert_array_equal(state[w], initial[w], err_msg=w)
    counters = [v for k, v in state.items() if k.startswith(("Update_Count_", "Step"))]
    assert all(c[0] == 1 for c in counters)
    for sess in (skipped, fresh):
        sess.run(["loss", "Group_Accumulated_Gradients"], feeds(*data[2]), ro)
        assert sess.run(["all_gradients_finite"], feeds(*data[3]))[0][0]
    assert _same_state(skipped.get_state(), fresh.get_state())


# ---- §1 the public surface ---------------------------------------------------------------------------------

def test_constructor_takes_a_path_or_bytes_and_refuses_other_kinds(tmp_path) -> None:
    """§1.2: a str path or the serialized model (a PathLike too); anything else a TypeError naming the
    argument. §1.1: the four names where onnxruntime-training had them."""
    import onnxtrain
    from onnxtrain.capi._pybind_state import PropagateCastOpsStrategy
    from onnxtrain.training import GradientGraphBuilder
    from onnxtrain.training import TrainingParameters as TP

    assert GradientGraphBuilder is onnxtrain.GradientGraphBuilder and TP is TrainingParameters
    assert PropagateCastOpsStrategy is onnxtrain.PropagateCastOpsStrategy
    model = mlp_model()
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    x, y = batches(1, 8)[0]
    losses = []
    for given in (str(path), path, model.SerializeToString()):
        sess = TrainingSession(given, params("SGDOptimizer"))
        losses.append(sess.run(["loss"], {"x": x, "y": y, "Learning_Rate": LR})[0])
    assert losses[0] == losses[1] == losses[2]
    for bad in (3, None, [1, 2]):
        with pytest.raises(TypeError, match="path_or_bytes"):
            TrainingSession(bad, params("SGDOptimizer"))
    with pytest.raises(TypeError, match="parameters must be a TrainingParameters"):
        TrainingSession(model.SerializeToString(), {"loss_output_name": "loss"})


@pytest.mark.parametrize("name, message", [("", "loss_output_name is empty"),
                                           ("nope", "'nope' is not a value of the model"),
                                           ("x", "'x' is a graph input of the model, not a value"),
                                           ("W1", "'W1' is an initializer of the model, not a value")])
def test_a_loss_name_the_model_does_not_compute_is_refused_saying_why(name: str, message: str) -> None:
    """§6: loss_output_name names a tensor the model computes; an empty, unknown, input or initializer name
    fails at construction, naming the property and what the name is."""
    from onnxtrain.capi.onnxruntime_pybind11_state import Fail

    p = params("SGDOptimizer")
    p.loss_output_name = name
    with pytest.raises(Fail, match=re.escape(message)) as e:
        TrainingSession(mlp_model().SerializeToString(), p)
    assert "loss_output_name" in str(e.value)


@pytest.mark.parametrize("clip", [False, True])
def test_lamb_keeps_elements_whose_step_is_not_finite(clip: bool) -> None:
    """§7.4/§16.5: an infinite gradient element gives a non-finite step there: Lamb steps it by 0 and keeps
    its moments, the other elements step as the float64 reference of the spec's formulas (the trust ratio
    over the finite ones); with clipping, the infinite global norm divides every gradient to 0 or NaN."""
    from tests.session.helpers import lamb_ref

    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((2, 3)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("Mul", ["x", "W"], ["p"]),
         helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0)],
        "g", [helper.make_tensor_value_info("x", T.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("loss", T.FLOAT, [])], [numpy_helper.from_array(w0, "W")])
    p = params("LambOptimizer", enable_grad_norm_clip=clip)
    sess = TrainingSession(make_model(g, 17).SerializeToString(), p)
    w, m1, m2 = w0.astype(np.float64), np.zeros((2, 3)), np.zeros((2, 3))
    for t in range(1, 4):
        x = rng.standard_normal((2, 3)).astype(np.float32)
        if t == 2:
            x[0, 1] = np.inf  # d loss / d W = x
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            sess.run(["loss"], {"x": x, "Learning_Rate": LR})
            grad = x.astype(np.float64)
            norm = np.sqrt((grad**2).sum())
            if clip and norm > 1:
                grad = grad / norm
            w, m1, m2 = lamb_ref(w, grad, m1, m2, t, float(LR[0]))
        state, opt = sess.get_state(), sess.get_optimizer_state()["W"]
        assert np.isfinite(state["W"]).all()
        np.testing.assert_allclose(state["W"], w, rtol=1e-6, atol=1e-7, err_msg=f"step {t}")
        np.testing.assert_allclose(opt["Moment_1"], m1, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(opt["Moment_2"], m2, rtol=1e-6, atol=1e-9)


def test_gradient_graph_builder_differentiates_an_intermediate_value() -> None:
    """§12.1: an x may be a value a node computes (here the first Gemm's output ``h``); its gradient output
    equals the closed form, computed in float64, as onnxruntime runs the built model."""
    import onnxruntime

    from onnxtrain import GradientGraphBuilder

    model = mlp_model(loss="mse")
    b = GradientGraphBuilder(model.SerializeToString(), {"loss"}, ["h", "W2"], "loss")
    b.build()
    built = onnx.load_from_string(b.get_model())
    assert [o.name for o in built.graph.output] == ["loss", "logits", "h_grad", "W2_grad"]
    x, y = batches(1, 4, loss="mse")[0]
    ort = onnxruntime.InferenceSession(built.SerializeToString(), providers=["CPUExecutionProvider"])
    dh, dw2 = ort.run(["h_grad", "W2_grad"], {"x": x, "y": y})
    w = {k: v.astype(np.float64) for k, v in weights_of(model).items()}
    h = x.astype(np.float64) @ w["W1"].T + w["b1"]
    hr = np.maximum(h, 0)
    d = hr @ w["W2"].T + w["b2"] - y
    dout = 2 * d / d.size  # of the mean of squares
    np.testing.assert_allclose(dh, (dout @ w["W2"]) * (h > 0), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dw2, dout.T @ hr, rtol=1e-5, atol=1e-7)
