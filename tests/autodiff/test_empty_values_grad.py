"""Gradients through values with a dimension of 0 (an outside fuzz of the builder): the rules reshaped to
shapes holding a real 0 without ``allowzero``, so the 0 copied the gradient's size and the emitted graph
failed in onnxtrain's engine and in onnxruntime (Tile's static and run-time paths, the run-time unbroadcast,
the iota trick of Slice/Pad/Tile of unknown rank). The oracle is torch autograd; the graphs pass
``onnx.checker`` and run on both engines."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.testing import run_engine

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
N = helper.make_node


def _model(nodes: list[onnx.NodeProto], dims: list, consts: dict[str, np.ndarray]) -> onnx.ModelProto:
    """x (float64, ``dims``: ints or symbols) → nodes → y; loss = ReduceSum(y)."""
    g = helper.make_graph(
        [*nodes, N("ReduceSum", ["y"], ["loss"], keepdims=0)], "g",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, dims)],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        [numpy_helper.from_array(v, k) for k, v in consts.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def _grads(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    grad = build_gradient_model(model, "loss", ["x"])
    onnx.checker.check_model(grad, full_check=True)
    ours = run_engine(grad, {"x": x})[[o.name for o in grad.graph.output].index("x_grad")]
    so = ort.SessionOptions()
    so.log_severity_level = 4
    theirs = ort.InferenceSession(grad.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
        ["x_grad"], {"x": x})[0]
    return [ours, theirs]


def _torch_grad(fn, x: np.ndarray) -> np.ndarray:
    t = torch.tensor(x, requires_grad=True)
    fn(t).sum().backward()
    return t.grad.numpy()


REPEATS = np.array([2, 2], np.int64)


@pytest.mark.parametrize("dims", [[0, 1], ["a", "b"]], ids=["static", "symbolic"])
def test_tile_of_an_empty_value(dims: list) -> None:
    x = np.zeros((0, 1))
    want = _torch_grad(lambda t: t.repeat(2, 2), x)
    for got in _grads(_model([N("Tile", ["x", "r"], ["y"])], dims, {"r": REPEATS}), x):
        assert got.shape == want.shape == (0, 1)


def test_run_time_unbroadcast_of_an_empty_sum() -> None:
    """x (a, b) = (3, 0) plus a constant of shape (2, 1, 1): y is (2, 3, 0) and x's gradient is (3, 0)."""
    x = np.zeros((3, 0))
    k = np.ones((2, 1, 1))
    want = _torch_grad(lambda t: t + torch.tensor(k), x)
    for got in _grads(_model([N("Add", ["x", "k"], ["y"])], ["a", "b"], {"k": k}), x):
        np.testing.assert_array_equal(got, want)


def test_slice_cut_to_empty_with_symbolic_dims() -> None:
    """A Slice that keeps nothing of a symbolic x, then a broadcast with an empty constant: zeros."""
    x = np.ones((3, 3, 1))
    consts = {"s": np.array([1, 100, 1], np.int64), "e": np.array([-1, 0, -1], np.int64),
              "ax": np.array([-2, -1, -3], np.int64), "st": np.array([2, -1, 2], np.int64),
              "k": np.ones((2, 1, 1, 0))}
    nodes = [N("Slice", ["x", "s", "e", "ax", "st"], ["z"]), N("Add", ["z", "k"], ["y"])]
    for got in _grads(_model(nodes, ["a", "b", "c"], consts), x):
        np.testing.assert_array_equal(got, np.zeros_like(x))


def test_slice_of_a_symbolic_value_to_empty() -> None:
    x = np.ones((3, 2))
    consts = {"s": np.array([1], np.int64), "e": np.array([1], np.int64), "ax": np.array([1], np.int64)}
    want = _torch_grad(lambda t: t[:, 1:1], x)
    for got in _grads(_model([N("Slice", ["x", "s", "e", "ax"], ["y"])], ["a", "b"], consts), x):
        np.testing.assert_array_equal(got, want)


def test_slice_of_an_empty_symbolic_value() -> None:
    """The run-time Slice gradient's iota (``Range`` reshaped to x's shape) with x itself empty."""
    x = np.ones((1, 1, 0))
    consts = {"s": np.array([0], np.int64), "e": np.array([1], np.int64), "ax": np.array([0], np.int64)}
    want = _torch_grad(lambda t: t[0:1], x)
    for got in _grads(_model([N("Slice", ["x", "s", "e", "ax"], ["y"])], ["a", "b", "c"], consts), x):
        assert got.shape == want.shape == (1, 1, 0)


@pytest.mark.parametrize("dims", [[0, 8, 2, 3], ["n", 8, 2, 3], [2, 0, 2, 3]])
def test_depth_to_space_crd_of_an_empty_value(dims: list) -> None:
    """DepthToSpace in CRD mode (torch's ``pixel_shuffle``): its gradient reshaped to ``[0, 0, 0, b², -1]``,
    which ONNX refuses when a dim is 0 (a product of 0 with -1: the full check failed, as for OpInfo's
    pixel_shuffle samples of an empty batch); the shape now comes from X's. (torch's own backward of an
    empty pixel_shuffle fails: the gradient of an empty x is an empty array of its shape.)"""
    model = _model([N("DepthToSpace", ["x"], ["y"], blocksize=2, mode="CRD")], dims, {})
    x = np.zeros([d if isinstance(d, int) else 0 for d in dims])
    for got in _grads(model, x):
        assert got.shape == x.shape
