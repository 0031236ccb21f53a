"""``RunOptions.terminate`` set from another thread stops a run in progress, as onnxruntime's does (the
oracle, side by side): a long Loop stops within a fraction of a second with a RuntimeError (onnxruntime's
``Fail``); the flag was read only before the run starts, so the run went on to its end. On the onnxruntime
backend the flag, the logging fields and the run config entries reach onnxruntime's own run options."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from tests.engine.run_stops import StopAtRead
from tests.session.helpers import backend_options, params

F = TensorProto.FLOAT


def _long_loop() -> bytes:
    """y = tanh(…tanh(x·W)·W…), N iterations of a 64×64 product."""
    body = helper.make_graph(
        [helper.make_node("MatMul", ["s_in", "W"], ["mm"]), helper.make_node("Tanh", ["mm"], ["s_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("s_in", F, [64, 64])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("s_out", F, [64, 64])])
    weights = (np.random.default_rng(0).standard_normal((64, 64)) * 0.1).astype(np.float32)
    w = numpy_helper.from_array(weights, "W")
    g = helper.make_graph([helper.make_node("Loop", ["N", "", "x"], ["y"], body=body)], "g",
                          [helper.make_tensor_value_info("N", TensorProto.INT64, []),
                           helper.make_tensor_value_info("x", F, [64, 64])],
                          [helper.make_tensor_value_info("y", F, [64, 64])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _session(lib: str):
    if lib == "onnxruntime":
        return ort, ort.InferenceSession(_long_loop(), providers=["CPUExecutionProvider"])
    so = onnxtrain.SessionOptions()
    if lib == "onnxtrain-backend":
        so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    return onnxtrain, onnxtrain.InferenceSession(_long_loop(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("which", ["onnxruntime", "onnxtrain", "onnxtrain-backend"])
def test_terminate_set_during_a_run_stops_it(which: str) -> None:
    lib, sess = _session(which)
    feeds = {"N": np.array(10_000_000, np.int64), "x": np.ones((64, 64), np.float32)}
    ro = lib.RunOptions()
    threading.Timer(0.2, lambda: setattr(ro, "terminate", True)).start()
    start = time.perf_counter()
    with pytest.raises(Exception, match="terminate") as e:  # (onnxruntime's Fail is no RuntimeError)
        sess.run(None, feeds, ro)
    assert type(e.value).__name__ in ("Fail", "Terminated", "EngineError")
    assert time.perf_counter() - start < 5.0
    if lib is onnxtrain:
        # a Terminated, as the README says (a Loop's body re-raised it as a plain EngineError), from the
        # iteration it stopped at (the Loop was run again from the start to name the node: "iteration 0")
        from onnxtrain.engine.interface import Terminated

        assert isinstance(e.value, Terminated)
        if which == "onnxtrain":
            stopped_at = int(re.search(r"iteration (\d+)", str(e.value)).group(1))  # type: ignore[union-attr]
            assert stopped_at > 10
    if lib is onnxtrain:  # the session runs again afterwards (onnxruntime 1.32's Loop stays terminated)
        y = sess.run(None, {"N": np.array(2, np.int64), "x": feeds["x"]}, lib.RunOptions())[0]
        assert y.shape == (64, 64)
        assert not ro._linked  # the backend's run options are let go with the run


def test_a_failing_loop_runs_once(monkeypatch) -> None:
    """A Loop whose body fails at iteration 3 runs its body 4 times and raises the body's error naming the
    iteration: the engine ran a failed node a second time to name it (8 body runs; a node that wrote in place
    or drew random values before failing would do it twice)."""
    from onnxtrain.engine.control_flow import Body

    body = helper.make_graph(
        [helper.make_node("Less", ["i", "K"], ["ok"]),
         helper.make_node("Where", ["ok", "good", "bad"], ["shape"]),
         helper.make_node("Reshape", ["s_in", "shape"], ["s_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("s_in", F, [4])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("s_out", F, [4])])
    consts = [numpy_helper.from_array(np.array(3, np.int64), "K"),
              numpy_helper.from_array(np.array([4], np.int64), "good"),
              numpy_helper.from_array(np.array([3], np.int64), "bad")]
    g = helper.make_graph([helper.make_node("Loop", ["N", "", "x"], ["y"], body=body, name="loop")], "g",
                          [helper.make_tensor_value_info("N", TensorProto.INT64, []),
                           helper.make_tensor_value_info("x", F, [4])],
                          [helper.make_tensor_value_info("y", F, [4])], consts)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    runs = []
    real = Body.ran
    monkeypatch.setattr(Body, "ran", lambda self, *a: (runs.append(1), real(self, *a))[1])
    sess = onnxtrain.InferenceSession(model)
    from onnxtrain.errors import Fail

    with pytest.raises(Fail, match="iteration 3") as e:
        sess.run(None, {"N": np.array(10, np.int64), "x": np.ones(4, np.float32)})
    assert "Reshape" in str(e.value)
    assert len(runs) == 4


_TAGGED = r"""
import sys
import numpy as np
sys.path.insert(0, sys.argv[2])
from test_run_terminate import _session
import onnxruntime, onnxtrain
which = sys.argv[1]
(onnxruntime if which == "onnxruntime" else onnxtrain).set_default_logger_severity(0)
lib, sess = _session(which)
ro = lib.RunOptions()
ro.log_severity_level = 0
ro.logid = "tagged-run-7"
sess.run(None, {"N": np.array(2, np.int64), "x": np.ones((64, 64), np.float32)}, ro)
"""


@pytest.mark.parametrize("which", ["onnxruntime", "onnxtrain-backend"])
def test_a_runs_log_tag_reaches_onnxruntime(which: str) -> None:
    import os

    done = subprocess.run([sys.executable, "-c", _TAGGED, which, os.path.dirname(__file__)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Running with tag: tagged-run-7" in done.stderr + done.stdout


@pytest.mark.parametrize("which", ["onnxruntime", "onnxtrain-backend"])
def test_a_runs_config_entries_reach_onnxruntime(which: str) -> None:
    """An arena to shrink that does not exist: onnxruntime refuses the run, so the entry reached it."""
    lib, sess = _session(which)
    ro = lib.RunOptions()
    ro.add_run_config_entry("memory.enable_memory_arena_shrinkage", "gpu:7")
    with pytest.raises(Exception, match="memory arena shrink list: gpu:7"):
        sess.run(None, {"N": np.array(2, np.int64), "x": np.ones((64, 64), np.float32)}, ro)
    ro = lib.RunOptions()
    ro.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")  # a valid one: it runs
    assert sess.run(None, {"N": np.array(2, np.int64), "x": np.ones((64, 64), np.float32)}, ro)[0].shape \
        == (64, 64)


def _wide_mlp() -> bytes:
    """x [N, 256] → Gemm 512 → Relu → Gemm 128 → cross-entropy: weights large enough that the update of
    each runs in steps of its own."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.05).astype(np.float32), n)
             for n, s in (("W1", (512, 256)), ("b1", (512,)), ("W2", (128, 512)), ("b2", (128,)))]
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["h"], transB=1),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "W2", "b2"], ["z"], transB=1),
             helper.make_node("SoftmaxCrossEntropyLoss", ["z", "y"], ["loss"])]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 256]),
                                         helper.make_tensor_value_info("y", TensorProto.INT64, ["N"])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_terminate_never_leaves_a_training_step_half_applied(backend: str) -> None:
    """A stop requested at each point of a legacy training step in turn: the state is the step's before or
    after, never a mix (the numpy engine stopped between the update's steps, some weights and moments
    written in place and others not; the backend forwarded the stop into onnxruntime's in-place update)."""
    p, so = params("AdamOptimizer"), backend_options(backend)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((4, 256)).astype(np.float32), "y": rng.integers(0, 128, 4),
             "Learning_Rate": np.array([0.01], np.float32)}
    s = onnxtrain.TrainingSession(_wide_mlp(), p, so)
    s.run(["loss"], feeds)
    before = {k: v.copy() for k, v in s.get_state().items()}
    ref = onnxtrain.TrainingSession(_wide_mlp(), p, so)
    ref.load_state(before)
    ref.run(["loss"], feeds)
    after = ref.get_state()
    stopped = 0
    for at in range(1, 1000):
        try:
            s.run(["loss"], feeds, run_options=StopAtRead(at))
        except RuntimeError as e:
            assert "terminate" in str(e), e
            stopped += 1
            now = s.get_state()
            assert all(np.array_equal(now[k], before[k]) for k in now), f"stopped at read {at}: state changed"
            continue
        now = s.get_state()
        assert all(np.array_equal(now[k], after[k]) for k in now)
        break
    else:
        raise AssertionError("no run got past the stops")
    assert stopped >= 1
    # stops set from another thread at random points of the run (the backend's are forwarded into
    # onnxruntime's run, which the reads above do not reach): each leaves a whole step, old or new
    stepped = {k for k in after if not np.array_equal(after[k], before[k])}  # what a whole step changes
    for trial in range(20):
        before = {k: v.copy() for k, v in s.get_state().items()}
        ro = onnxtrain.RunOptions()
        timer = threading.Timer(0.0005 * (trial % 10), ro.__setattr__, ("terminate", True))
        timer.start()
        try:
            s.run(["loss"], feeds, run_options=ro)
        except RuntimeError as e:
            assert "terminate" in str(e), e
        timer.join()
        now = s.get_state()
        moved = {k for k in now if not np.array_equal(now[k], before[k])}
        assert moved in (set(), stepped), moved


def test_an_unnamed_failing_node_is_named_by_its_output() -> None:
    """A failing node without a name was reported as "node '' (Reshape)"; its first output names it now."""
    from onnxtrain.errors import Fail

    g = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", F, [4])],
                          [helper.make_tensor_value_info("y", F, None)],
                          [numpy_helper.from_array(np.array([3], np.int64), "shape")])
    sess = onnxtrain.InferenceSession(helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    with pytest.raises(Fail, match=r"node \(unnamed, making 'y'\) \(Reshape\) failed on inputs \[x: "):
        sess.run(None, {"x": np.ones(4, np.float32)})
