"""Building a legacy TrainingSession reads the trained weights' values once, into the state: the graphs are
built from a copy of the model without them, and what the build freed goes back to the kernel. Measured in
a fresh process (VmHWM, reset just before the session is built, after a small session has loaded the
modules); the session's values are checked against a float64 forward pass of the same weights in numpy."""

from __future__ import annotations

import sys

import pytest

from tests.memory_scripts import MATMUL_CHAIN, run_measured

_SCRIPT = MATMUL_CHAIN + r"""
import ctypes, json, gc
import onnxtrain

def model(n, size):
    m = matmul_chain(n, size, 2, loss=True)
    m.ir_version = 9
    return m.SerializeToString()

def params():
    p = onnxtrain.TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    return p

def status(key):
    return int([l for l in open("/proc/self/status") if l.startswith(key)][0].split()[1]) * 1024

onnxtrain.TrainingSession(model(2, 8), params())  # the modules a session needs, loaded
data = model(16, 1024)  # 64 MiB of weights
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)  # the pages model() freed, given back: RSS is what is held
open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here
before = status("VmRSS:")
sess = onnxtrain.TrainingSession(data, params())
peak = status("VmHWM:") - before
held = status("VmRSS:") - before
x = np.full((2, 1024), 0.01, np.float32)
loss = sess.run(["loss"], {"x": x, "Learning_Rate": np.array([0.0], np.float32)})[0]
state = sess.get_state()
print(json.dumps({"peak": peak, "held": held, "loss": float(loss), "w0": float(state["W0"][3, 5]),
                  "w15": float(state["W15"][7, 1])}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_session_reads_the_trained_weights_once() -> None:
    # glibc's allocator as it is (the engine's settings keep freed pages, which a peak would not show)
    got = run_measured(_SCRIPT)
    weights = 16 * 1024 * 1024 * 4
    # the loaded model and the state (one copy each, and one tensor in flight); a copy of the model with the
    # weights for the graphs made it three (2.07 against 3.07 times the weights)
    assert got["peak"] < 2.5 * weights, got["peak"] / weights
    # once built, the session holds the state: the loaded model's pages went back to the kernel (glibc had
    # kept them in the heap: 2.07 against 1.00 times the weights)
    assert got["held"] < 1.3 * weights, got["held"] / weights
    import numpy as np

    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((1024, 1024), np.float32) * 0.05 for _ in range(16)]
    h = np.full((2, 1024), 0.01, np.float64)
    for w in ws:
        h = h @ w.astype(np.float64)
    assert got["loss"] == pytest.approx(float((h * h).sum()), rel=1e-3)
    assert got["w0"] == ws[0][3, 5] and got["w15"] == ws[15][7, 1]  # lr 0: the values as loaded


_FLAT_SCRIPT = MATMUL_CHAIN + r"""
import ctypes, json, gc
import onnxtrain

def model(n, size):
    m = matmul_chain(n, size, 2, loss=True)
    m.ir_version = 9
    return m.SerializeToString()

def session(data):
    p = onnxtrain.TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "AdamOptimizer"
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    return onnxtrain.TrainingSession(data, p, so)

def status(key):
    return int([l for l in open("/proc/self/status") if l.startswith(key)][0].split()[1]) * 1024

session(model(2, 8))  # the modules a session needs, loaded
data = model(8, 256)  # 8 weights of 65,536 values: one flat group of 524,288
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here
before = status("VmRSS:")
sess = session(data)
groups = [len(g.weights) for g in sess._flat.groups]
x = np.full((2, 256), 0.01, np.float32)
sess.run(["loss"], {"x": x, "Learning_Rate": np.array([1e-3], np.float32)})
print(json.dumps({"peak": status("VmHWM:") - before, "groups": groups}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_the_backends_flat_update_of_one_group_builds_in_little_memory() -> None:
    """The clipped flat Adam update of one merged group on the onnxruntime backend (the legacy default): its
    norm's reductions have the backend infer the update graph's types, and ONNX's data propagation over the
    group's 1-D values of 524,288 held about 600 MiB (586 against 20 MiB here; the bench's unclipped
    transformer, whose bias corrections had an Expand for a while: 673 against 156 MiB peak RSS)."""
    pytest.importorskip("onnxruntime")
    got = run_measured(_FLAT_SCRIPT)
    assert got["groups"] == [8]
    # the weights are 2 MiB: with the Adam state, the gradients and onnxruntime's arena about 20 MiB here
    assert got["peak"] < 64 * 2**20, got["peak"] / 2**20
