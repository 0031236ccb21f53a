"""Pooling windows that lie wholly in the padding (dilations that step over every real element): AveragePool
(count_include_pad=0) gives 0/0 there and its gradient built with a division by zero; MaxPool's Indices
pointed at an element of no window and its gradient sent dY there. Oracles: onnx.reference's forward and
float64 central differences of the sum of the finite outputs."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.reference
import pytest
from onnx import TensorProto, helper

import onnxtrain
from onnxtrain.autodiff import build_gradient_model

D = TensorProto.DOUBLE


def _pool(op: str, shape: list[int], attrs: dict, indices: bool = False):
    outs = ["Y", "I"] if indices else ["Y"]
    nodes = [helper.make_node(op, ["X"], outs, **attrs),
             helper.make_node("IsInf", ["Y"], ["inf"]), helper.make_node("IsNaN", ["Y"], ["nan"]),
             helper.make_node("Or", ["inf", "nan"], ["bad"]),
             helper.make_node("Where", ["bad", "zero", "Y"], ["finite"]),
             helper.make_node("ReduceSum", ["finite"], ["loss"], keepdims=0)]
    out_vi = [helper.make_tensor_value_info("loss", D, []), helper.make_tensor_value_info("Y", D, None)]
    if indices:
        out_vi.append(helper.make_tensor_value_info("I", TensorProto.INT64, None))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", D, shape)], out_vi,
                          [helper.make_tensor("zero", D, [], [0.0])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])


def _fd(model, x: np.ndarray) -> np.ndarray:
    sess = onnxtrain.InferenceSession(model.SerializeToString())
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        hi, lo = x.copy(), x.copy()
        hi[i] += 1e-6
        lo[i] -= 1e-6
        grad[i] = (sess.run(["loss"], {"X": hi})[0] - sess.run(["loss"], {"X": lo})[0]) / 2e-6
    return grad


@pytest.mark.parametrize("attrs, want_y", [
    ({"kernel_shape": [2], "dilations": [2], "pads": [1, 1]}, [np.nan]),
    ({"kernel_shape": [2], "dilations": [2], "pads": [2, 1]}, [5.0, np.nan]),
])
def test_average_pool_window_in_the_padding(attrs: dict, want_y: list[float]) -> None:
    m = _pool("AveragePool", [1, 1, 1], attrs)
    x = np.array([[[5.0]]])
    y = onnxtrain.InferenceSession(m.SerializeToString()).run(["Y"], {"X": x})[0]
    ref = onnx.reference.ReferenceEvaluator(m).run(["Y"], {"X": x})[0]
    np.testing.assert_array_equal(y.ravel(), np.array(want_y))
    np.testing.assert_array_equal(y, ref)
    gm = build_gradient_model(m, "loss", ["X"])
    onnx.checker.check_model(gm, full_check=True)
    got = dict(zip([o.name for o in gm.graph.output],
                   onnxtrain.InferenceSession(gm.SerializeToString()).run(None, {"X": x})))
    np.testing.assert_allclose(got["X_grad"], _fd(m, x), atol=1e-8)


def test_max_pool_window_in_the_padding_has_index_minus_one_and_no_gradient() -> None:
    attrs = {"kernel_shape": [1, 2], "dilations": [1, 2], "pads": [0, 1, 0, 1]}
    m = _pool("MaxPool", [1, 1, 2, 1], attrs, indices=True)
    x = np.array([1.0, 2.0]).reshape(1, 1, 2, 1)
    y, idx = onnxtrain.InferenceSession(m.SerializeToString()).run(["Y", "I"], {"X": x})
    assert np.isneginf(y).all() and (idx == -1).all()
    # dY = 1 at the windows (the Ys are -inf): the loss reads none of them; dX must still be 0
    m1 = _pool("MaxPool", [1, 1, 2, 1], attrs, indices=True)
    m1.graph.node[-1].CopyFrom(helper.make_node("ReduceSum", ["Y"], ["loss"], keepdims=0))
    gm = build_gradient_model(m1, "loss", ["X"])
    onnx.checker.check_model(gm, full_check=True)
    got = dict(zip([o.name for o in gm.graph.output],
                   onnxtrain.InferenceSession(gm.SerializeToString()).run(None, {"X": x})))
    np.testing.assert_array_equal(got["X_grad"], np.zeros_like(x))
    np.testing.assert_array_equal(_fd(m, x), np.zeros_like(x))
