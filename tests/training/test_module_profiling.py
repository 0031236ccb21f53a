"""``SessionOptions.enable_profiling`` and ``optimized_model_filepath`` of the on-device ``Module`` and
``Optimizer`` on the numpy engine.

Before, a Module warned that it applied neither. Now each of its models (training, eval) and the
Optimizer's update has a chrome trace of its own, named when the Module or Optimizer is made and written
when it is collected, and the optimized model's path gets the eval model (the training model without
one), then the optimizer model: what onnxruntime-training 1.19.2 does, checked here against it. The
traces' events name the models' nodes; the written models pass onnx's full check and give in onnxruntime
the outputs the Module and Optimizer give.
"""

from __future__ import annotations

import gc
import json
import os
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module, Optimizer
from tests.ortt import PREAMBLE, run_script


def _model(ir_version: int = 10) -> onnx.ModelProto:
    """x @ W + B → Relu → @ V: a small net with named nodes."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in (("W", (4, 5)), ("B", (5,)), ("V", (5, 3)))]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="first_matmul"),
             helper.make_node("Add", ["h", "B"], ["hb"], name="bias_add"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "V"], ["y"], name="second_matmul")]
    g = helper.make_graph(nodes, "net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = ir_version
    return m


def _feeds() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.standard_normal((2, 4)).astype(np.float32), rng.standard_normal((2, 3)).astype(np.float32)


@pytest.fixture
def generated(tmp_path):
    """onnxtrain's artifacts of the net (MSE loss, AdamW), in tmp_path/art."""
    folder = tmp_path / "art"
    folder.mkdir()
    artifacts.generate_artifacts(_model(), requires_grad=["W", "B", "V"], loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=folder)
    return str(folder)


BACKENDS = ["numpy", "onnxruntime"]


def _options(out: str, profile: bool = True, optimized: bool = True,
             backend: str = "numpy") -> onnxtrain.SessionOptions:
    so = onnxtrain.SessionOptions()
    if backend != "numpy":
        so.add_session_config_entry("onnxtrain.backend", backend)
        # onnxruntime's trace then names the model's nodes too, not the fusions that replace them
        so.graph_optimization_level = onnxtrain.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.enable_profiling = profile
    so.profile_file_prefix = os.path.join(out, "trace")
    if optimized:
        so.optimized_model_filepath = os.path.join(out, "optimized.onnx")
    return so


# the same source runs in onnxruntime-training's venv and in this process: what files the options make,
# and when (trace files empty or written after each stage; which model the optimized model's path holds)
_OBSERVE = r'''
import gc, os, time
import numpy as np
import onnx


def observe(api, SessionOptions, folder, out):
    so = SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(out, "trace")
    so.optimized_model_filepath = os.path.join(out, "optimized.onnx")

    def traces():
        return sorted(f for f in os.listdir(out) if f.endswith(".json"))

    def states(names):
        return sorted({"written" if os.path.getsize(os.path.join(out, f)) else "empty" for f in names})

    def kind():
        names = [i.name for i in onnx.load(so.optimized_model_filepath).graph.input]
        if "learning_rate" in names:
            return "optimizer"
        return "training" if any("accumulation" in n for n in names) else "eval"

    stages = []
    state = api.CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    m = api.Module(os.path.join(folder, "training_model.onnx"), state,
                   os.path.join(folder, "eval_model.onnx"), session_options=so)
    module_files = traces()
    stages.append(["module made", states(module_files), [], kind()])
    time.sleep(1.1)  # (onnxruntime-training names traces by the second: the optimizer's gets its own)
    o = api.Optimizer(os.path.join(folder, "optimizer_model.onnx"), m)
    optimizer_files = [f for f in traces() if f not in module_files]
    stages.append(["optimizer made", states(module_files), states(optimizer_files), kind()])
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((2, 4)).astype(np.float32), rng.standard_normal((2, 3)).astype(np.float32)
    m.train()
    m(x, y)
    o.step()
    m.eval()
    m(x, y)
    stages.append(["steps run", states(module_files), states(optimizer_files), kind()])
    del o
    gc.collect()
    stages.append(["optimizer collected", states(module_files), states(optimizer_files), kind()])
    del m
    gc.collect()
    stages.append(["module collected", states(module_files), states(optimizer_files), kind()])
    return {"stages": stages, "traces": len(module_files) + len(optimizer_files)}
'''

_ORT_SCRIPT = PREAMBLE + _OBSERVE + r'''
import onnxruntime as ort
from onnxruntime.training import api, artifacts
folder, out = sys.argv[1], sys.argv[2]
os.makedirs(folder, exist_ok=True)
artifacts.generate_artifacts(onnx.load(os.path.join(folder, "net.onnx")), requires_grad=["W", "B", "V"],
                             loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.AdamW,
                             artifact_directory=folder)
print(json.dumps(observe(api, ort.SessionOptions, folder, out)))
'''


def test_files_appear_when_onnxruntime_training_writes_them(tmp_path):
    """onnxruntime-training 1.19.2's artifacts, run by it and by onnxtrain with the same options: each
    session's trace is there (empty) from its Module or Optimizer's making and written when that is
    collected; the optimized model's path holds the eval model after the Module, the optimizer model after
    the Optimizer. onnxtrain made neither file before (a warning said so)."""
    folder, ortt_out, our_out = tmp_path / "art", tmp_path / "ortt", tmp_path / "ours"
    for d in (folder, ortt_out, our_out):
        d.mkdir()
    onnx.save(_model(), str(folder / "net.onnx"))
    reference = run_script(_ORT_SCRIPT, str(folder), str(ortt_out))
    ns: dict = {}
    exec(compile(_OBSERVE, "<observe>", "exec"), ns)  # noqa: S102 - the source onnxruntime-training ran
    import onnxtrain.training.api as api

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no warning that the options are not applied)
        ours = ns["observe"](api, onnxtrain.SessionOptions, str(folder), str(our_out))
    assert ours["stages"] == reference["stages"]
    assert reference["stages"][0] == ["module made", ["empty"], [], "eval"]
    assert reference["stages"][-1] == ["module collected", ["written"], ["written"], "optimizer"]
    # onnxruntime-training's training and eval sessions, made in the same second, share one name (one
    # overwrites the other's trace); onnxtrain's names tell them apart, as its InferenceSession's do
    assert ours["traces"] == 3 and reference["traces"] <= 3


def _node_events(path: str) -> tuple[list[str], list[list[str]]]:
    """A trace's ``Session`` event names and, per ``model_run``, the names of the nodes it ran."""
    with open(path) as f:
        events = json.load(f)
    assert all(e["ph"] == "X" and e["dur"] >= 0 for e in events)
    session = [e["name"] for e in events if e["cat"] == "Session"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e["cat"] == "Session" and e["name"] == "model_run")
    runs: list[list[str]] = [[] for _ in spans]
    for e in sorted(events, key=lambda e: e["ts"]):
        if e["cat"] == "Node":
            assert e["name"].endswith("_kernel_time")
            # the run whose span is nearest: onnxruntime's node times come from its own clock, converted,
            # and the first node of a run can land a few µs before the run's begin (seen under load)
            k = min(range(len(spans)), key=lambda i: max(spans[i][0] - e["ts"], e["ts"] - spans[i][1], 0))
            runs[k].append(e["name"][: -len("_kernel_time")])
    return session, runs


@pytest.mark.parametrize("backend", BACKENDS)
def test_traces_hold_each_model_run_and_its_nodes(tmp_path, generated, backend):
    """One trace per model: the training trace one ``model_run`` per step with an event for each node of
    the training model that the step ran (all but its Constant nodes when it accumulates), the eval trace
    one per evaluation with every node of the eval model, in the graph's order, the optimizer trace one
    per update; each begins with onnxruntime's loading and initialization events. On the onnxruntime
    backend (which wrote its own files, four, named after its graphs, and left them) the node events are
    those of onnxruntime's traces, whose files are removed."""
    out = str(tmp_path)
    train_model = onnx.load(os.path.join(generated, "training_model.onnx"))
    eval_model = onnx.load(os.path.join(generated, "eval_model.onnx"))
    state = CheckpointState.load_checkpoint(os.path.join(generated, "checkpoint"))
    module = Module(os.path.join(generated, "training_model.onnx"), state,
                    os.path.join(generated, "eval_model.onnx"),
                    session_options=_options(out, optimized=False, backend=backend))
    opt = Optimizer(os.path.join(generated, "optimizer_model.onnx"), module)
    traces = sorted(f for f in os.listdir(out) if f.startswith("trace_"))  # (not onnxruntime's own)
    assert len(traces) == 3 and all(os.path.getsize(os.path.join(out, f)) == 0 for f in traces)
    x, y = _feeds()
    for _ in range(2):
        module.train()
        module(x, y)
        module(x, y)  # accumulating: the training model's other plan, the same trace
        opt.step()
        module.lazy_reset_grad()
        module.eval()
        module(x, y)
    del module, opt
    gc.collect()
    assert sorted(set(os.listdir(out)) - {"art"}) == traces
    runs = []
    for f in traces:  # (claimed in this order: the training, eval and optimizer sessions')
        session, node_runs = _node_events(os.path.join(out, f))
        assert session[:2] == ["model_loading_uri", "session_initialization"]
        assert session.count("model_run") == len(node_runs)
        runs.append(node_runs)
    train_runs, eval_runs, opt_runs = runs
    assert (len(train_runs), len(eval_runs), len(opt_runs)) == (4, 2, 2)
    train_nodes = {n.name for n in train_model.graph.node}
    for run in train_runs:
        assert set(run) <= train_nodes and len(run) == len(set(run))
        assert {"first_matmul", "bias_add", "relu", "second_matmul"} <= set(run)
        assert any("_Grad/" in n for n in run)
    # the accumulating step runs the whole training model (its Constant nodes are values, as in onnxruntime)
    assert set(train_runs[1]) == {n.name for n in train_model.graph.node if n.op_type != "Constant"}
    eval_nodes = sorted(n.name for n in eval_model.graph.node)
    assert [sorted(run) for run in eval_runs] == [eval_nodes] * 2
    if backend == "numpy":  # (in the graph's order)
        assert eval_runs == [[n.name for n in eval_model.graph.node]] * 2
    assert all(opt_runs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_optimized_models_run_in_onnxruntime(tmp_path, generated, backend):
    """The optimized model's path gets the eval model with the Module, the training model without an eval
    model, the optimizer model once an Optimizer is made: each passes onnx's full check, and onnxruntime
    running it gives the Module's evaluation, the training step's loss and gradients and the Optimizer's
    updated weights and moments. On the onnxruntime backend nothing was written."""
    out = str(tmp_path)
    path = os.path.join(out, "optimized.onnx")
    x, y = _feeds()
    params = ["W", "B", "V"]

    def checked() -> ort.InferenceSession:
        onnx.checker.check_model(onnx.load(path), full_check=True)
        return ort.InferenceSession(path, providers=["CPUExecutionProvider"])

    state = CheckpointState.load_checkpoint(os.path.join(generated, "checkpoint"))
    weights = {p: state.parameters[p].data.copy() for p in params}
    module = Module(os.path.join(generated, "training_model.onnx"), state,
                    os.path.join(generated, "eval_model.onnx"),
                    session_options=_options(out, profile=False, backend=backend))
    sess = checked()
    (got,) = sess.run(None, {"x": x, "target": y, **weights})
    np.testing.assert_allclose(module.eval()(x, y), got, rtol=1e-6)

    os.remove(path)
    module = Module(os.path.join(generated, "training_model.onnx"), state,
                    session_options=_options(out, profile=False, backend=backend))
    sess = checked()
    feeds = {"x": x, "target": y, **weights, "lazy_reset_grad": np.array([True])}
    feeds.update({f"{p}_grad.accumulation.buffer": np.zeros_like(weights[p]) for p in params})
    expected = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    loss = module(x, y)
    np.testing.assert_allclose(loss, expected[module.output_names()[0]], rtol=1e-6)
    for p in params:
        np.testing.assert_allclose(state.parameters[p].grad, expected[f"{p}_grad.accumulation.out"],
                                   rtol=1e-5, atol=1e-7)

    grads = {p: state.parameters[p].grad.copy() for p in params}
    opt = Optimizer(os.path.join(generated, "optimizer_model.onnx"), module)
    sess = checked()
    feeds = {"learning_rate": np.array([opt.get_learning_rate()], np.float32),
             "step": np.array([1], np.int64)}
    for i in sess.get_inputs():
        if i.name in weights:
            feeds[i.name] = weights[i.name]
        elif i.name.endswith("_grad"):
            feeds[i.name] = grads[i.name[: -len("_grad")]]
        elif i.name not in feeds:  # the moments, zero before the first step
            feeds[i.name] = np.zeros_like(weights[i.name.split(".")[0]])
    expected = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    opt.step()
    for p in params:
        np.testing.assert_allclose(state.parameters[p].data, expected[f"{p}.out"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_the_options_nothing_is_written_and_the_plans_are_plain(tmp_path, generated, backend):
    """Without the options no file is made and the Module's and Optimizer's plans are the engine's own
    (a step pays nothing for profiling)."""
    from onnxtrain.training.api._profile import ProfiledPlan

    out = str(tmp_path)
    state = CheckpointState.load_checkpoint(os.path.join(generated, "checkpoint"))
    module = Module(os.path.join(generated, "training_model.onnx"), state,
                    os.path.join(generated, "eval_model.onnx"),
                    session_options=_options(out, profile=False, optimized=False, backend=backend))
    opt = Optimizer(os.path.join(generated, "optimizer_model.onnx"), module)
    x, y = _feeds()
    module(x, y)
    module(x, y)
    opt.step()
    plans = [module._overwrite_plan, module._full_plan, module._eval_plan, opt._plan]
    assert not any(isinstance(p, ProfiledPlan) or p.profiling for p in plans)
    del module, opt
    gc.collect()
    assert os.listdir(out) == ["art"]


def test_a_trace_in_a_missing_folder_warns_and_training_goes_on(tmp_path, generated):
    """A ``profile_file_prefix`` in a folder that does not exist: onnxruntime-training 1.19.2 makes the
    Module, trains and writes nothing, without a word; onnxtrain's Module raised FileNotFoundError when it
    was made (the trace's name is claimed then). Now it warns, naming the option, and trains unprofiled."""
    so = _options(str(tmp_path / "missing" / "folder"), optimized=False)
    state = CheckpointState.load_checkpoint(os.path.join(generated, "checkpoint"))
    with pytest.warns(UserWarning, match="profile_file_prefix.*not profiled"):
        module = Module(os.path.join(generated, "training_model.onnx"), state,
                        os.path.join(generated, "eval_model.onnx"), session_options=so)
    x, y = _feeds()
    loss = module(x, y)
    reference = Module(os.path.join(generated, "training_model.onnx"),
                       CheckpointState.load_checkpoint(os.path.join(generated, "checkpoint")))
    np.testing.assert_array_equal(loss, reference(x, y))
    del module
    gc.collect()
    assert sorted(os.listdir(tmp_path)) == ["art"]
