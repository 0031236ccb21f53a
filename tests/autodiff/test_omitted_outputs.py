"""A rule that reads a forward output the model left unnamed (an LSTM's Y_h when only its final cell state
Y_c reaches the loss, as torch's dynamo exporter writes ``lstm(x)[1][1]``): the builder names the output
and places what it computes from it (its Shape) after the node, so the gradient graph stays sorted."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.testing import run_engine

SEQ, BATCH, IN, HID = 4, 2, 3, 5


def _lstm_model(outputs: list[str], loss_of: str) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((1, 4 * HID, IN)) * 0.5
    r = rng.standard_normal((1, 4 * HID, HID)) * 0.5
    b = rng.standard_normal((1, 8 * HID)) * 0.1
    nodes = [helper.make_node("LSTM", ["x", "W", "R", "B"], outputs, hidden_size=HID, name="lstm"),
             helper.make_node("Mul", [loss_of, loss_of], ["sq"]),
             helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0)]
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", T.DOUBLE, [SEQ, BATCH, IN])],
        [helper.make_tensor_value_info("loss", T.DOUBLE, [])],
        [numpy_helper.from_array(a, n) for a, n in ((w, "W"), (r, "R"), (b, "B"))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m, full_check=True)
    return m


def _loss(m: onnx.ModelProto, x: np.ndarray, name: str | None = None,
          value: np.ndarray | None = None) -> float:
    if name is not None:
        m2 = onnx.ModelProto()
        m2.CopyFrom(m)
        for init in m2.graph.initializer:
            if init.name == name:
                init.CopyFrom(numpy_helper.from_array(value, name))
        m = m2
    return float(run_engine(m, {"x": x})[0])


@pytest.mark.parametrize("outputs, loss_of", [
    (["", "", "c"], "c"),  # only the final cell state: Y and Y_h unnamed
    (["", "h", ""], "h"),  # only the final hidden state
    (["y", "", "c"], "c"),
])
def test_gradient_through_an_lstm_with_unnamed_outputs(outputs: list[str], loss_of: str) -> None:
    m = _lstm_model(outputs, loss_of)
    g = build_gradient_model(m, "loss", ["x", "R"])
    onnx.checker.check_model(g, full_check=True)
    x = np.random.default_rng(1).standard_normal((SEQ, BATCH, IN))
    got = dict(zip([o.name for o in g.graph.output], run_engine(g, {"x": x})))
    eps = 1e-6
    for k in [(0, 0, 0), (3, 1, 2), (1, 1, 1)]:  # central differences in float64
        d = np.zeros_like(x)
        d[k] = eps
        want = (_loss(m, x + d) - _loss(m, x - d)) / (2 * eps)
        np.testing.assert_allclose(got["x_grad"][k], want, rtol=1e-6, atol=1e-9)
    r = numpy_helper.to_array(next(i for i in m.graph.initializer if i.name == "R"))
    for k in [(0, 0, 0), (0, 7, 3), (0, 19, 4)]:
        d = np.zeros_like(r)
        d[k] = eps
        want = (_loss(m, x, "R", r + d) - _loss(m, x, "R", r - d)) / (2 * eps)
        np.testing.assert_allclose(got["R_grad"][k], want, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("outputs, used", [(["", "b"], 1), (["a", ""], 0), (["", "b", ""], 1)])
def test_gradient_through_a_split_with_unnamed_outputs(outputs: list[str], used: int) -> None:
    """The pieces the model leaves unnamed get zeros of their shape in the gradient (the Shape of an
    unnamed output was read from an empty name: check_model and the engine refused the graph)."""
    sizes = [1, 3] if len(outputs) == 2 else [1, 2, 1]
    nodes = [helper.make_node("Split", ["x", "sizes"], outputs, axis=1),
             helper.make_node("Mul", [outputs[used], outputs[used]], ["sq"]),
             helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.DOUBLE, [3, 4])],
                          [helper.make_tensor_value_info("loss", T.DOUBLE, [])],
                          [numpy_helper.from_array(np.array(sizes, np.int64), "sizes")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m, full_check=True)
    grad = build_gradient_model(m, "loss", ["x"])
    onnx.checker.check_model(grad, full_check=True)
    x = np.random.default_rng(2).standard_normal((3, 4))
    got = dict(zip([o.name for o in grad.graph.output], run_engine(grad, {"x": x})))["x_grad"]
    start = sum(sizes[:used])
    want = np.zeros_like(x)
    want[:, start:start + sizes[used]] = 2 * x[:, start:start + sizes[used]]  # d(sum y²)/dy = 2y
    np.testing.assert_array_equal(got, want)
