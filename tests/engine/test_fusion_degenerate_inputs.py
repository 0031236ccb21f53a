"""Fused steps on degenerate inputs (empty axes, 1-D products) give what the unfused plan gives, where they
used to fail: the weight gradients of a batched MatMul and of a Conv over empty tensors, a float16 MatMul of
two vectors plus a bias. Oracles: the plan without fusion, onnx.reference."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxtrain.engine.plan import Plan


def _model(nodes: list, inputs: list[str], dtype: int = TensorProto.FLOAT) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, dtype, None) for n in inputs],
                          [helper.make_tensor_value_info(nodes[-1].output[0], dtype, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _both(m: onnx.ModelProto, feeds: dict[str, np.ndarray], fused_op: str) -> tuple[np.ndarray, np.ndarray]:
    fused, plain = Plan(m), Plan(m, fuse=False)
    assert fused_op in [st.node.op_type for st in fused.steps]
    got, want = fused.run(feeds)[0], plain.run(feeds)[0]
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    return got, want


@pytest.mark.parametrize("a, b", [((2, 4, 0), (2, 4, 5)), ((2, 4, 3), (2, 4, 0)), ((0, 4, 3), (0, 4, 5))])
def test_matmul_weight_gradient_over_an_empty_axis(a: tuple, b: tuple) -> None:
    nodes = [helper.make_node("Transpose", ["a"], ["t"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["t", "b"], ["p"]),
             helper.make_node("Constant", [], ["ax"], value=numpy_helper.from_array(np.array([0], np.int64))),
             helper.make_node("ReduceSum", ["p", "ax"], ["y"], keepdims=0)]
    got, _ = _both(_model(nodes, ["a", "b"]), {"a": np.ones(a, np.float32), "b": np.ones(b, np.float32)},
                   "FusedMatMulWeightGrad")
    assert got.shape == (a[2], b[2]) and not got.any()


def _conv_weight_grad(attrs: dict) -> onnx.ModelProto:
    """dW = Conv(xᵀ, dyᵀ)ᵀ (batch and channels swapped), the builder's form of a Conv's weight gradient."""
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2, 3]),
             helper.make_node("Transpose", ["dy"], ["dyt"], perm=[1, 0, 2, 3]),
             helper.make_node("Conv", ["xt", "dyt"], ["c"], **attrs),
             helper.make_node("Transpose", ["c"], ["dw"], perm=[1, 0, 2, 3])]
    return _model(nodes, ["x", "dy"])


@pytest.mark.parametrize("x, dy, attrs, dw", [
    ((0, 6, 11, 6), (0, 2, 5, 2), {"dilations": [2, 3]}, (2, 6, 3, 3)),  # an empty batch (strided forward)
    ((0, 3, 10, 10), (0, 2, 14, 10), {"pads": [2, 0, 2, 0]}, (2, 3, 1, 1)),  # a 1×1 kernel
    ((2, 0, 9, 9), (2, 3, 9, 9), {"pads": [1, 1, 1, 1]}, (3, 0, 3, 3)),  # no input channels
    ((2, 8, 9, 9), (2, 0, 5, 5), {"dilations": [2, 2], "pads": [1, 1, 1, 1]}, (0, 8, 3, 3)),  # no outputs
], ids=["batch0", "pointwise-batch0", "cin0", "cout0"])
def test_conv_weight_gradient_over_empty_tensors(x: tuple, dy: tuple, attrs: dict, dw: tuple) -> None:
    feeds = {"x": np.ones(x, np.float32), "dy": np.ones(dy, np.float32)}
    got, _ = _both(_conv_weight_grad(attrs), feeds, "FusedConvWeightGrad")
    assert got.shape == dw and not got.any()


def test_float16_matmul_of_two_vectors_plus_a_bias() -> None:
    h = TensorProto.FLOAT16
    nodes = [helper.make_node("MatMul", ["a", "b"], ["p"]), helper.make_node("Add", ["p", "c"], ["y"])]
    m = _model(nodes, ["a", "b", "c"], h)
    feeds = {"a": np.array([1, 2, 0.5], np.float16), "b": np.array([1, 1, 2], np.float16),
             "c": np.array(1, np.float16)}
    got, _ = _both(m, feeds, "FusedMatMulAdd")
    np.testing.assert_array_equal(got, ReferenceEvaluator(m).run(None, feeds)[0])
    assert got.shape == () and got == 5
