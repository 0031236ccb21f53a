"""``RunOptions.terminate`` set from another thread stops a run in progress, as onnxruntime's does (the
oracle, side by side): a long Loop stops within a fraction of a second with a RuntimeError (onnxruntime's
``Fail``); the flag was read only before the run starts, so the run went on to its end."""

from __future__ import annotations

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


@pytest.mark.parametrize("lib", [ort, onnxtrain], ids=["onnxruntime", "onnxtrain"])
def test_terminate_set_during_a_run_stops_it(lib) -> None:
    sess = lib.InferenceSession(_long_loop(), providers=["CPUExecutionProvider"])
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
