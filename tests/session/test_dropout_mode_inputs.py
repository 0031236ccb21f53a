"""A Dropout whose training_mode is the model's own graph input (or computed from one) keeps it in the
legacy session: the caller's feed decides (it was pointed at the shared ``training_mode`` while the input
stayed required, so feeding False still dropped half the values). Dropouts whose mode is a constant share
``training_mode`` as in onnxruntime's legacy session."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain import TrainingParameters, TrainingSession

X = np.random.default_rng(0).uniform(0.5, 1.5, (32, 16)).astype(np.float32)
W = np.full((16, 16), 0.1, np.float32)
LR = np.array([0.5], np.float32)


def _model(computed: bool) -> bytes:
    """x @ W → Dropout(0.5, mode) → hd; loss = ReduceSum(hd); mode = t, or Not(t) when ``computed``."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"])]
    mode = "t"
    if computed:
        nodes.append(helper.make_node("Not", ["t"], ["nt"]))
        mode = "nt"
    nodes += [helper.make_node("Dropout", ["h", "ratio", mode], ["hd"], name="drop"),
              helper.make_node("ReduceSum", ["hd"], ["loss"], keepdims=0)]
    vi = helper.make_tensor_value_info
    inits = [numpy_helper.from_array(W, "W"), numpy_helper.from_array(np.array(0.5, np.float32), "ratio")]
    g = helper.make_graph(nodes, "g", [vi("x", T.FLOAT, [32, 16]), vi("t", T.BOOL, [])],
                          [vi("loss", T.FLOAT, []), vi("hd", T.FLOAT, [32, 16])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    return m.SerializeToString()


def _session(model: bytes) -> TrainingSession:
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    return TrainingSession(model, p)


@pytest.mark.parametrize("computed", [False, True], ids=["input", "computed"])
def test_the_callers_mode_switches_dropout(computed: bool) -> None:
    model = _model(computed)
    off = np.array(computed)  # Not(t) is the mode when computed
    sess = _session(model)
    want = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(
        ["hd"], {"x": X, "t": off})[0]
    hd, = sess.run(["hd"], {"x": X, "t": off, "Learning_Rate": LR})
    np.testing.assert_allclose(hd, want, rtol=1e-6)
    assert not (hd == 0).any()
    # without dropout the step is W - lr * x^T 1 (float64 oracle)
    want_w = W - LR[0] * (X.astype(np.float64).T @ np.ones((32, 16)))
    np.testing.assert_allclose(sess.get_state()["W"], want_w, rtol=1e-5)
    hd, = sess.run(["hd"], {"x": X, "t": ~off, "Learning_Rate": np.zeros(1, np.float32)})
    assert 0.35 < (hd == 0).mean() < 0.65


def test_a_constant_mode_is_the_shared_training_mode() -> None:
    m = onnx.load_from_string(_model(False))
    m.graph.initializer.append(numpy_helper.from_array(np.array(True), "t"))
    del m.graph.input[1]
    sess = _session(m.SerializeToString())
    lr0 = np.zeros(1, np.float32)
    hd, = sess.run(["hd"], {"x": X, "Learning_Rate": lr0})
    assert 0.35 < (hd == 0).mean() < 0.65  # the model's own mode
    hd, = sess.run(["hd"], {"x": X, "training_mode": np.array(False), "Learning_Rate": lr0})
    assert not (hd == 0).any()
