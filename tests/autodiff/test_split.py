"""``split_gradient_model``: the forward graph then the backward graph give the one gradient graph's values;
a Dropout draws once, in the forward, and the backward reads its mask; values of unknown rank are made again
in the backward instead of being saved."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain.autodiff.builder import build_gradient_model
from onnxtrain.autodiff.split import split_gradient_model
from onnxtrain.engine.plan import Plan
from tests.session.helpers import mlp_model


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    onnx.checker.check_model(model, full_check=True)
    plan = Plan(model)
    names = [o.name for o in model.graph.output]
    return dict(zip(names, plan.run({n: feeds[n] for n in plan.all_input_names}, names)))


def test_forward_then_backward_equal_the_whole_gradient_graph() -> None:
    m = mlp_model()
    weights = [t.name for t in m.graph.initializer]
    grad = build_gradient_model(m, "loss", [*weights, "x"])
    fwd, bwd, saved = split_gradient_model(grad, m)
    assert saved and all(s in {o.name for o in fwd.graph.output} for s in saved)
    assert not {n.op_type for n in bwd.graph.node} & {"SoftmaxCrossEntropyLoss"}  # the forward runs once
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((6, 8)).astype(np.float32), "y": rng.integers(0, 4, 6)}
    whole = run(grad, feeds)
    first = run(fwd, feeds)
    second = run(bwd, {**feeds, **first})
    assert first["loss"] == whole["loss"]
    for w in [*weights, "x"]:
        assert np.array_equal(second[f"{w}_grad"], whole[f"{w}_grad"]), w


def test_dropout_draws_in_the_forward_and_the_backward_reads_its_mask() -> None:
    w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    nodes = [
        helper.make_node("Dropout", ["x", "ratio", "train"], ["d", "mask"], seed=3),
        helper.make_node("MatMul", ["d", "W"], ["z"]),
        helper.make_node("Tanh", ["z"], ["t"]),
        helper.make_node("ReduceSum", ["t"], ["loss"], keepdims=0),
    ]
    g = helper.make_graph(
        nodes,
        "drop",
        [helper.make_tensor_value_info("x", T.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("loss", T.FLOAT, [])],
        [
            numpy_helper.from_array(w, "W"),
            numpy_helper.from_array(np.float32(0.5), "ratio"),
            numpy_helper.from_array(np.array(True), "train"),
        ],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    grad = build_gradient_model(m, "loss", ["W"], outputs=["loss", "d"])
    fwd, bwd, saved = split_gradient_model(grad, grad)  # every node of a combined graph: no backward...
    assert bwd.graph.output == []  # ...so split by the model differentiated, as a stage does
    fwd, bwd, saved = split_gradient_model(grad, m)
    x = np.random.default_rng(1).standard_normal((5, 3)).astype(np.float32)
    first = run(fwd, {"x": x})
    kept = first["d"]
    assert 0 < np.count_nonzero(kept) < kept.size  # something dropped, something kept
    second = run(bwd, {"x": x, "W": w, **first})
    # d(sum tanh(d·W))/dW = dᵀ·(1 - tanh²): with the very d the forward drew
    expected = kept.T @ (1 - np.tanh(kept @ w) ** 2)
    np.testing.assert_allclose(second["W_grad"], expected, rtol=1e-6, atol=1e-6)


def test_values_of_unknown_rank_are_made_again_in_the_backward() -> None:
    # a Reshape to a shape fed at run time: shape inference cannot tell the result's rank
    w = np.array([0.7], np.float32)
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["x2"]),
        helper.make_node("Tanh", ["x2"], ["t"]),
        helper.make_node("Mul", ["t", "W"], ["z"]),
        helper.make_node("Mul", ["z", "z"], ["z2"]),
        helper.make_node("ReduceSum", ["z2"], ["loss"], keepdims=0),
    ]
    g = helper.make_graph(
        nodes,
        "reshaped",
        [
            helper.make_tensor_value_info("x", T.FLOAT, ["N", 2]),
            helper.make_tensor_value_info("shape", T.INT64, [None]),
        ],
        [helper.make_tensor_value_info("loss", T.FLOAT, [])],
        [numpy_helper.from_array(w, "W")],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    grad = build_gradient_model(m, "loss", ["W"])
    fwd, bwd, saved = split_gradient_model(grad, m)
    assert "t" not in saved and {"Reshape", "Tanh"} <= {n.op_type for n in bwd.graph.node}
    x = np.random.default_rng(2).standard_normal((3, 2)).astype(np.float32)
    feeds = {"x": x, "W": w, "shape": np.array([3, 2], np.int64)}
    whole = run(grad, feeds)
    second = run(bwd, {**feeds, **run(fwd, feeds)})
    assert np.array_equal(second["W_grad"], whole["W_grad"])
    t = np.tanh(x)
    np.testing.assert_allclose(second["W_grad"], [2 * w[0] * (t * t).sum()], rtol=1e-6)
