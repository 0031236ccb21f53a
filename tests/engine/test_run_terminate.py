"""``RunOptions.terminate`` set from another thread stops a run in progress, as onnxruntime's does (the
oracle, side by side): a long Loop stops within a fraction of a second with a RuntimeError (onnxruntime's
``Fail``); the flag was read only before the run starts, so the run went on to its end. On the onnxruntime
backend the flag, the logging fields and the run config entries reach onnxruntime's own run options."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain

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
    if lib is onnxtrain:  # the session runs again afterwards (onnxruntime 1.32's Loop stays terminated)
        y = sess.run(None, {"N": np.array(2, np.int64), "x": feeds["x"]}, lib.RunOptions())[0]
        assert y.shape == (64, 64)
        assert not ro._linked  # the backend's run options are let go with the run


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
