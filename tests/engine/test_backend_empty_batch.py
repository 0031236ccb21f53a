"""A training step on an empty batch, on both backends, for a model with a training-mode BatchNormalization.

Its batch statistics are 0/0; torch's BatchNorm leaves the running statistics as they were, and so does the
numpy engine's session. The onnxruntime backend runs a legacy step as two graphs (onnxtrain/session_halves.py)
and stored the NaN running statistics of the empty batch, so every later step normalized with NaN.
Oracle: torch's BatchNorm1d in training mode and autograd, SGD.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingSession
from tests.session.helpers import backend_options, params

torch = pytest.importorskip("torch")

LR = 0.1


def _model(w: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> bytes:
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("BatchNormalization", ["h", "scale", "bias", "mean", "var"], ["b"],
                              epsilon=1e-5, momentum=0.9),
             helper.make_node("Mul", ["b", "b"], ["sq"]),
             helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0)]
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(scale, "scale"),
             numpy_helper.from_array(bias, "bias"), numpy_helper.from_array(np.zeros(3, np.float32), "mean"),
             numpy_helper.from_array(np.ones(3, np.float32), "var")]
    g = helper.make_graph(nodes, "bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 15)], ir_version=8).SerializeToString()


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_an_empty_batch_leaves_the_running_statistics_as_torch(backend: str) -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((4, 3)) * 0.5).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, 3).astype(np.float32)
    bias = (rng.standard_normal(3) * 0.1).astype(np.float32)
    sess = TrainingSession(_model(w, scale, bias), params("SGDOptimizer"), backend_options(backend))
    lin = torch.nn.Linear(4, 3, bias=False)
    bn = torch.nn.BatchNorm1d(3, eps=1e-5, momentum=0.1)  # ONNX's momentum 0.9 keeps 0.9 of the old
    with torch.no_grad():
        lin.weight.copy_(torch.tensor(w.T))
        bn.weight.copy_(torch.tensor(scale))
        bn.bias.copy_(torch.tensor(bias))
    bn.train()
    opt = torch.optim.SGD([lin.weight, bn.weight, bn.bias], lr=LR)
    for n in (0, 5, 0, 6):
        x = rng.standard_normal((n, 4)).astype(np.float32)
        loss = sess.run(["loss"], {"x": x, "Learning_Rate": np.array([LR], np.float32)})[0]
        opt.zero_grad()
        ref = bn(lin(torch.tensor(x))).pow(2).sum()
        ref.backward()
        opt.step()
        assert float(loss) == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
        state = sess.get_state()
        # (ONNX's running variance is the biased one; torch keeps the unbiased: compared on the means only,
        # and the variance kept as it was across an empty batch)
        np.testing.assert_allclose(state["mean"], bn.running_mean.numpy(), rtol=1e-5, atol=1e-6)
        assert np.isfinite(state["var"]).all()
        np.testing.assert_allclose(state["W"], lin.weight.detach().numpy().T, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state["scale"], bn.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    before = sess.get_state()["var"].copy()
    sess.run(["loss"], {"x": np.zeros((0, 4), np.float32), "Learning_Rate": np.array([LR], np.float32)})
    np.testing.assert_array_equal(sess.get_state()["var"], before)


def _loss_model(kind: str, w: np.ndarray) -> bytes:
    nodes = [helper.make_node("MatMul", ["x", "W"], ["s"])]
    ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])]
    if kind == "mse":
        nodes += [helper.make_node("Sub", ["s", "t"], ["d"]), helper.make_node("Mul", ["d", "d"], ["d2"]),
                  helper.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0)]
        ins.append(helper.make_tensor_value_info("t", TensorProto.FLOAT, ["N", 3]))
    else:
        nodes.append(helper.make_node(kind, ["s", "t"], ["loss"], reduction="mean"))
        ins.append(helper.make_tensor_value_info("t", TensorProto.INT64, ["N"]))
    g = helper.make_graph(nodes, "loss", ins, [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          [numpy_helper.from_array(w, "W")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


@pytest.mark.parametrize("kind", ["mse", "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_a_mean_loss_over_an_empty_batch_leaves_the_weights_as_torch(backend: str, kind: str) -> None:
    """The mean of no rows: NaN on the numpy engine, as torch's losses give; on the backend what plain
    onnxruntime gives for the model (its ReduceMean of nothing is 0; README: matching the numpy engine would
    take a count on every step). Either way no weight moves (the gradient is over no rows)."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((4, 3)) * 0.5).astype(np.float32)
    sess = TrainingSession(_loss_model(kind, w), params("SGDOptimizer"), backend_options(backend))
    x = torch.zeros((0, 4))
    if kind == "mse":
        t = np.zeros((0, 3), np.float32)
        ref = torch.nn.functional.mse_loss(x @ torch.tensor(w), torch.tensor(t))
    else:
        t = np.zeros((0,), np.int64)
        fn = torch.nn.functional.cross_entropy if kind.startswith("Softmax") else torch.nn.functional.nll_loss
        ref = fn(x @ torch.tensor(w), torch.tensor(t))
    loss = sess.run(["loss"], {"x": x.numpy(), "t": t, "Learning_Rate": np.array([LR], np.float32)})[0]
    assert np.isnan(ref.item())
    if backend == "numpy":
        assert np.isnan(loss)
    elif kind != "SoftmaxCrossEntropyLoss":  # (plain onnxruntime's function body fails on no rows)
        ort = pytest.importorskip("onnxruntime")
        plain = ort.InferenceSession(_loss_model(kind, w), providers=["CPUExecutionProvider"])
        assert loss == plain.run(None, {"x": x.numpy(), "t": t})[0]
    np.testing.assert_array_equal(sess.get_state()["W"], w)
