"""An inference-mode BatchNormalization whose mean and variance are computed from its input (the way torch's
dynamo exporter writes ``nn.BatchNorm2d(track_running_stats=False)``) differentiates through them, so the
graph trains as torch's batch-statistics BatchNorm does; the running statistics of a plain inference
BatchNormalization are still never discovered as trainable weights by the legacy session."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingParameters, TrainingSession
from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine import compile_model

torch = pytest.importorskip("torch")

EPS = 1e-5


def _batch_stats_model(shape: tuple[int, ...], scale: np.ndarray, bias: np.ndarray,
                       r: np.ndarray) -> onnx.ModelProto:
    """loss = Σ BatchNormalization(x, scale, bias, mean(x), var(x)) · r (statistics over all axes but 1)."""
    axes = [0, *range(2, len(shape))]
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["mean"], axes=axes, keepdims=0),
        helper.make_node("ReduceMean", ["x"], ["mean_k"], axes=axes, keepdims=1),
        helper.make_node("Sub", ["x", "mean_k"], ["d"]),
        helper.make_node("Mul", ["d", "d"], ["d2"]),
        helper.make_node("ReduceMean", ["d2"], ["var"], axes=axes, keepdims=0),
        helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y"], epsilon=EPS),
        helper.make_node("Mul", ["y", "r"], ["yr"]),
        helper.make_node("ReduceSum", ["yr"], ["loss"], keepdims=0),
    ]
    inits = [numpy_helper.from_array(a, n) for a, n in ((scale, "scale"), (bias, "bias"), (r, "r"))]
    graph = helper.make_graph(nodes, "bn_batch_stats",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("shape", [(2, 3, 4, 4), (6, 3)], ids=["4d", "2d"])
def test_batch_statistics_fed_to_inference_batchnorm_match_torch(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    c = shape[1]
    x = rng.standard_normal(shape).astype(np.float32)
    r = rng.standard_normal(shape).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, c).astype(np.float32)
    bias = rng.uniform(-1, 1, c).astype(np.float32)
    model = _batch_stats_model(shape, scale, bias, r)
    gmodel = build_gradient_model(model, "loss", ["x", "scale", "bias"])
    onnx.checker.check_model(gmodel, full_check=True)
    loss, gx, gscale, gbias = compile_model(gmodel).run({"x": x})

    xt = torch.from_numpy(x).requires_grad_()
    st, bt = torch.from_numpy(scale).requires_grad_(), torch.from_numpy(bias).requires_grad_()
    y = torch.nn.functional.batch_norm(xt, None, None, st, bt, training=True, eps=EPS)
    tl = (y * torch.from_numpy(r)).sum()
    tl.backward()
    np.testing.assert_allclose(loss, tl.item(), rtol=1e-5)
    # dX is a difference of terms of similar size (the statistics' share cancels most of dY·scale·rstd)
    for ours, theirs, name in ((gx, xt.grad, "x"), (gscale, st.grad, "scale"), (gbias, bt.grad, "bias")):
        theirs = theirs.numpy()
        assert np.linalg.norm(ours - theirs) <= 1e-5 * np.linalg.norm(theirs), name
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5 * np.abs(theirs).max(), err_msg=name)


def test_legacy_session_does_not_train_inference_running_statistics() -> None:
    """Discovery (no weights_to_train) does not train an inference BatchNormalization's mean and var, as
    onnxruntime's legacy session did not; that session ran every BatchNormalization in training mode (its
    BatchNormReplacement), so they are running statistics, which each training run updates by momentum. Its
    scale and bias are trained."""
    rng = np.random.default_rng(1)
    c = 3
    stats = {"scale": np.ones(c, np.float32), "bias": np.zeros(c, np.float32),
             "mean": rng.uniform(-0.5, 0.5, c).astype(np.float32),
             "var": rng.uniform(0.5, 2, c).astype(np.float32)}
    nodes = [helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y"]),
             helper.make_node("ReduceSumSquare", ["y"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, c])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(v, k) for k, v in stats.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    params = TrainingParameters()
    params.loss_output_name = "loss"
    params.training_optimizer_name = "SGDOptimizer"
    session = TrainingSession(model.SerializeToString(), params)
    feeds = {
        "x": rng.standard_normal((4, c)).astype(np.float32), "Learning_Rate": np.array([0.1], np.float32)}
    session.run(["loss"], feeds)
    state = session.get_state()  # the trained weights (and their optimizer state), the running statistics
    x = feeds["x"].astype(np.float64)
    for k, batch in (("mean", x.mean(0)), ("var", x.var(0))):  # ONNX's momentum 0.9, the biased variance
        np.testing.assert_allclose(state[k], 0.9 * stats[k] + 0.1 * batch, rtol=1e-5, atol=1e-7, err_msg=k)
    assert not np.array_equal(state["scale"], stats["scale"])
