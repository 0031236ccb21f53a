"""A frozen weight (weights_not_to_train) that the model also lists as a graph input: from IR version 4 a run
may feed it, as onnxruntime lets a feed override such an initializer, and runs without the feed use the
initializer; below IR 4 (where exporters listed every initializer as an input) it is a constant, as in
onnxruntime and InferenceSession. Oracle: the step by hand in numpy."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.capi.options import RunOptions
from tests.session.helpers import backend_options, params

X = np.array([[1.0, -2.0], [0.5, 3.0]], np.float32)
W0 = np.array([[1.0, 0.5], [-1.0, 2.0]], np.float32)
LR = np.array([0.1], np.float32)


def _model(ir_version: int = 8) -> onnx.ModelProto:
    """loss = Σ(x·W + B)²; W both an initializer and a graph input."""
    inits = [numpy_helper.from_array(W0, "W"),
             numpy_helper.from_array(np.array([0.5, -0.5], np.float32), "B")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "B"], ["z"]),
             helper.make_node("Mul", ["z", "z"], ["z2"]),
             helper.make_node("ReduceSum", ["z2"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2]),
                                       helper.make_tensor_value_info("W", TensorProto.FLOAT, [2, 2])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
                           helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 2])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = ir_version
    return m


def _session(backend: str) -> onnxtrain.TrainingSession:
    p = params("SGDOptimizer")
    p.weights_not_to_train = {"W"}
    return onnxtrain.TrainingSession(_model().SerializeToString(), p, backend_options(backend))


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_a_frozen_weight_that_is_a_graph_input_may_be_fed(backend: str) -> None:
    sess = _session(backend)
    assert [a.name for a in sess.get_overridable_initializers()] == ["W"]
    assert [a.name for a in sess.get_inputs()] == ["x", "Learning_Rate"]
    b = np.array([0.5, -0.5], np.float32)
    for w in (2 * W0, None, -W0):  # fed, the initializer, fed again
        feed = {"x": X, "Learning_Rate": LR} | ({} if w is None else {"W": w})
        z = X @ (W0 if w is None else w) + b
        loss = sess.run(["loss"], feed)[0]
        np.testing.assert_allclose(loss, (z * z).sum(), rtol=1e-6)
        b = b - LR[0] * (2 * z).sum(0)
        np.testing.assert_allclose(sess.get_state()["B"], b, rtol=1e-5)
    assert list(sess.get_state()) == ["B"]  # the frozen weight is not state


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_an_evaluation_reads_the_fed_frozen_weight(backend: str) -> None:
    sess = _session(backend)
    ro = RunOptions()
    ro.training_mode = False
    ro.only_execute_path_to_fetches = True
    z = sess.run(["z"], {"x": X, "W": 3 * W0}, ro)[0]
    np.testing.assert_allclose(z, X @ (3 * W0) + np.array([0.5, -0.5], np.float32), rtol=1e-6)


def test_a_fed_frozen_weight_is_checked_as_an_input() -> None:
    sess = _session("numpy")
    with pytest.raises(TypeError, match="'W'.*float32.*float64"):
        sess.run(["loss"], {"x": X, "W": W0.astype(np.float64), "Learning_Rate": LR})
    with pytest.raises(ValueError, match="'W'.*dimension 1 must be 2, got 3"):
        sess.run(["loss"], {"x": X, "W": np.ones((2, 3), np.float32), "Learning_Rate": LR})


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_below_ir_4_a_frozen_weight_that_is_a_graph_input_is_a_constant(backend: str) -> None:
    # onnxruntime takes such initializers as constants at IR 3 (its overridable initializers: none) and
    # refused the feed inside a run; the session listed W as overridable on both backends
    p = params("SGDOptimizer")
    p.weights_not_to_train = {"W"}
    m = _model(ir_version=3)
    m.graph.input.append(helper.make_tensor_value_info("B", TensorProto.FLOAT, [2]))  # (IR 3: every one)
    sess = onnxtrain.TrainingSession(m.SerializeToString(), p, backend_options(backend))
    assert sess.get_overridable_initializers() == []
    with pytest.raises(onnxtrain.errors.InvalidFeed, match="unknown input 'W'"):
        sess.run(["loss"], {"x": X, "Learning_Rate": LR, "W": 2 * W0})
    z = X @ W0 + np.array([0.5, -0.5], np.float32)
    np.testing.assert_allclose(sess.run(["loss"], {"x": X, "Learning_Rate": LR})[0], (z * z).sum(), rtol=1e-6)
