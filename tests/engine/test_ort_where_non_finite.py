"""The onnxruntime backend's fast forms of ``Where`` (a mask multiply, an added fill) give the Where's values
when the masked branch is not finite, in whole sessions: a guarded log in a forward, the ReLU gradient under
an infinite upstream gradient, LAMB's guard against a 0/0 direction. Before, they gave NaN there (0·inf,
0·NaN), where the numpy engine, plain onnxruntime on the unrewritten graph, torch and the spec give 0."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import onnxtrain

pytest.importorskip("onnxruntime")
F = TensorProto.FLOAT


def _options(backend: str) -> onnxtrain.SessionOptions:
    so = onnxtrain.SessionOptions()
    if backend == "onnxruntime":
        so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    return so


def test_a_guarded_log_is_finite_on_both_backends() -> None:
    """loss = ReduceSum(Where(x·w > 0, Log(x·w), 0)): the masked Log's NaN is dropped, log 2 + log 3."""
    nodes = [helper.make_node("Mul", ["x", "w"], ["xw"]),
             helper.make_node("Greater", ["xw", "zero"], ["pos"]),
             helper.make_node("Log", ["xw"], ["log"]),
             helper.make_node("Where", ["pos", "log", "zero"], ["safe"]),
             helper.make_node("ReduceSum", ["safe"], ["y"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [3])],
                          [helper.make_tensor_value_info("y", F, [])],
                          [numpy_helper.from_array(np.array([1.0, -1.0, 1.5], np.float32), "w"),
                           numpy_helper.from_array(np.array(0.0, np.float32), "zero")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    x = np.array([2.0, 4.0, 2.0], np.float32)
    for backend in ("numpy", "onnxruntime"):
        got = onnxtrain.InferenceSession(model, _options(backend)).run(None, {"x": x})[0]
        np.testing.assert_allclose(got, np.log(2.0) + np.log(3.0), rtol=1e-6, err_msg=backend)


def test_relu_gradient_under_an_infinite_upstream_gradient_matches_torch() -> None:
    """The gradient of sum(sqrt(relu(x·W))) with respect to W: sqrt's gradient is inf where relu is 0, the
    ReLU gradient masks it to 0 (torch's autograd, float64, the oracle)."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Sqrt", ["r"], ["s"]),
             helper.make_node("ReduceSum", ["s"], ["loss"], keepdims=0)]
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 6)).astype(np.float32)
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [5, 4])],
                          [helper.make_tensor_value_info("loss", F, [])], [numpy_helper.from_array(w, "W")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((5, 4)).astype(np.float32)
    wt = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    torch.sqrt(torch.relu(torch.tensor(x, dtype=torch.float64) @ wt)).sum().backward()
    want = wt.grad.numpy()
    assert np.isfinite(want).all() and (x @ w <= 0).any()  # masked infinite gradients exist
    for backend in ("numpy", "onnxruntime"):
        p = onnxtrain.TrainingParameters()
        p.loss_output_name = "loss"
        p.set_gradients_as_graph_outputs = True
        p.training_optimizer_name = "SGDOptimizer"
        p.enable_grad_norm_clip = False
        sess = onnxtrain.TrainingSession(model.SerializeToString(), p, _options(backend))
        ro = onnxtrain.RunOptions()
        ro.only_execute_path_to_fetches = True
        got = sess.run(["W_grad"], {"x": x, "Learning_Rate": np.array([0.1], np.float32)}, ro)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=backend)


def test_lamb_zeroes_a_zero_over_zero_direction_on_both_backends() -> None:
    """LAMB with epsilon 0 and a weight row whose gradient is 0: the direction m1/sqrt(m2) is 0/0 there, which
    LAMB's guard sets to 0 (onnxruntime's _LambComputeDirectionRule); the trust ratio is then ‖w‖/‖d‖ over
    the rest. Oracle: the update in float64 numpy."""
    rng = np.random.RandomState(0)
    w0, b0 = rng.randn(3, 2).astype(np.float32), rng.randn(2).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "B"], ["y"]),
             helper.make_node("Sub", ["y", "t"], ["d"]), helper.make_node("Mul", ["d", "d"], ["d2"]),
             helper.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["N", 3]),
                                       helper.make_tensor_value_info("t", F, ["N", 2])],
                          [helper.make_tensor_value_info("loss", F, [])],
                          [numpy_helper.from_array(w0, "W"), numpy_helper.from_array(b0, "B")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    data = np.random.RandomState(100)
    x, t = data.randn(4, 3).astype(np.float32), data.randn(4, 2).astype(np.float32)
    x[:, 1] = 0  # W's row 1: zero gradient, zero moments
    w64, xx, tt = w0.astype(np.float64), x.astype(np.float64), t.astype(np.float64)
    grad = xx.T @ (2 * (xx @ w64 + b0 - tt) / tt.size)
    m1, m2 = 0.1 * grad, 0.001 * grad * grad
    with np.errstate(all="ignore"):
        d = m1 / np.sqrt(m2)
    d[~np.isfinite(d)] = 0
    want = w64 - 0.1 * np.linalg.norm(w64) / np.linalg.norm(d) * d
    for backend in ("numpy", "onnxruntime"):
        p = onnxtrain.TrainingParameters()
        p.loss_output_name = "loss"
        p.training_optimizer_name = "LambOptimizer"
        p.enable_grad_norm_clip = False
        p.optimizer_attributes_map = {"W": {"epsilon": 0.0}, "B": {"epsilon": 0.0}}
        sess = onnxtrain.TrainingSession(model.SerializeToString(), p, _options(backend))
        sess.run(["loss"], {"x": x, "t": t, "Learning_Rate": np.array([0.1], np.float32)})
        np.testing.assert_allclose(sess.get_state()["W"], want, rtol=1e-5, atol=1e-6, err_msg=backend)


def test_every_rewritten_graph_checks() -> None:
    """The fast forms with their fallback If are valid ONNX (full check)."""
    from onnxtrain.engine.ort_rewrites import rewrite_for_onnxruntime

    cmp = helper.make_node("Greater", ["x", "z"], ["m"])
    where = helper.make_node("Where", ["m", "x", "z"], ["y"], name="relu")
    g = helper.make_graph([cmp, where], "g", [helper.make_tensor_value_info("x", F, [2])],
                          [helper.make_tensor_value_info("y", F, [2])],
                          [numpy_helper.from_array(np.array(0.0, np.float32), "z")])
    new = rewrite_for_onnxruntime(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    assert "If" in [n.op_type for n in new.graph.node]
    onnx.checker.check_model(new, full_check=True)
