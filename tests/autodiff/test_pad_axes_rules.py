"""Gradient rules that pad some axes only, run by onnxruntime 1.32 with its default optimizations.

onnxruntime's transpose optimizer, moving a Transpose from a Pad's input to its output (which it does when a
Transpose follows, as in the gradient of a value transposed before and after an op), permutes the pads as if
they named every axis and ignores the ``axes`` input. With fewer axes than the rank the Gather it inserts on
the pads reads past their end ("indices element out of data bounds"); with every axis named out of order the
values come out silently wrong. Smallest trigger: ``Transpose(perm=[1, 0]) -> Pad(pads, axes=[0]) ->
Transpose(perm=[1, 0])``, at ORT_ENABLE_BASIC and above. The Slice and CumProd rules therefore pad every
axis (CumProd's Loop form keeps the axes: the optimizer moves no Transpose into a Loop); Pad's own rule
mirrors the model's Pad, which meets the same failure in the forward pass. They are checked here between
Transposes against torch autograd, in onnxruntime's InferenceSession, through onnxtrain's onnxruntime
backend and on its numpy engine.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.autodiff import build_gradient_model

D, I64 = TensorProto.DOUBLE, TensorProto.INT64
vi = helper.make_tensor_value_info


def _run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    so = ort.SessionOptions()  # ORT_ENABLE_ALL, the default
    so.log_severity_level = 4
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def _run_backend(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    return _run_onnxtrain(model, feeds, so)


def _run_numpy(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return _run_onnxtrain(model, feeds, onnxtrain.SessionOptions())


def _run_onnxtrain(model: onnx.ModelProto, feeds: dict[str, np.ndarray],
                   so: onnxtrain.SessionOptions) -> dict[str, np.ndarray]:
    sess = onnxtrain.InferenceSession(model.SerializeToString(), so)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def _check(model: onnx.ModelProto, feeds: dict[str, np.ndarray], loss: torch.Tensor,
           xt: torch.Tensor) -> None:
    (want,) = torch.autograd.grad(loss, xt)
    grad = build_gradient_model(model, "loss", ["x"])
    if all(i.type.tensor_type.HasField("shape") for i in model.graph.input):  # the checker wants them
        onnx.checker.check_model(grad, full_check=True)
    for run in (_run_ort, _run_backend, _run_numpy):
        got = run(grad, feeds)
        np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-12)
        np.testing.assert_allclose(got["x_grad"], want.numpy(), rtol=1e-12, atol=1e-13)


def _torch_cumprod(t: torch.Tensor, axis: int, exclusive: int, reverse: int) -> torch.Tensor:
    if reverse:
        t = t.flip(axis)
    y = torch.cumprod(t, axis)
    if exclusive:
        y = torch.cat([torch.ones_like(y.narrow(axis, 0, 1)), y.narrow(axis, 0, t.shape[axis] - 1)], axis)
    return y.flip(axis) if reverse else y


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("dynamic", [False, True])
def test_cumprod_grad_between_transposes(exclusive: int, reverse: int, dynamic: bool) -> None:
    # the unrolled doubling steps pad one axis of a transposed value (an exclusive CumProd failed); with
    # symbolic dims a Loop runs the steps, which the transpose optimizer leaves alone
    shape, perm, axis = (3, 4, 5), [1, 0, 2], 1
    dims = ["a", "b", "c"] if dynamic else list(shape)
    back = np.argsort(perm).tolist()
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=perm),
        helper.make_node("CumProd", ["t", "axis"], ["c"], exclusive=exclusive, reverse=reverse),
        helper.make_node("Transpose", ["c"], ["y"], perm=back),
        helper.make_node("Mul", ["y", "u"], ["yu"]),
        helper.make_node("ReduceSum", ["yu"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(nodes, "cumprod_t", [vi("x", D, dims), vi("u", D, dims)], [vi("loss", D, [])],
                              [numpy_helper.from_array(np.array(axis, np.int64), "axis")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 26)], ir_version=10)
    rng = np.random.default_rng(1)
    x, u = rng.uniform(-2, 2, shape), rng.standard_normal(shape)
    x[1, 2, 3] = 0.0  # a zero along the axis: the rule's products, not a division
    xt = torch.tensor(x, requires_grad=True)
    y = _torch_cumprod(xt.permute(*perm), axis, exclusive, reverse).permute(*back)
    _check(model, {"x": x, "u": u}, (y * torch.tensor(u)).sum(), xt)


@pytest.mark.parametrize("opset", [18, 21])
@pytest.mark.parametrize("declared", [True, False])
def test_slice_grad_with_fed_starts(opset: int, declared: bool) -> None:
    # a Slice whose starts are fed: its gradient was Pad(dY, pads, axes); 33f0a24 padded every axis when
    # the rank is known, 1301f90 also when x is declared without a shape
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2, 3]),
        helper.make_node("Slice", ["t", "starts", "ends", "axes"], ["s"]),
        helper.make_node("Transpose", ["s"], ["y"], perm=[1, 0, 2, 3]),
        helper.make_node("Mul", ["y", "u"], ["yu"]),
        helper.make_node("ReduceSum", ["yu"], ["loss"], keepdims=0),
    ]
    shapes = ([4, 3, 3, 2], [4, 3, 2, 2]) if declared else (None, None)
    graph = helper.make_graph(
        nodes, "slice_pad_axes", [vi("x", D, shapes[0]), vi("starts", I64, [1]), vi("u", D, shapes[1])],
        [vi("loss", D, [])],
        [helper.make_tensor("ends", I64, [1], [3]), helper.make_tensor("axes", I64, [1], [-2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    rng = np.random.default_rng(2)
    x, u = rng.standard_normal((4, 3, 3, 2)), rng.standard_normal((4, 3, 2, 2))
    xt = torch.tensor(x, requires_grad=True)
    y = xt.permute(1, 0, 2, 3)[:, :, 1:3].permute(1, 0, 2, 3)
    _check(model, {"x": x, "u": u, "starts": np.array([-2], np.int64)}, (y * torch.tensor(u)).sum(), xt)


@pytest.mark.parametrize("inverse", [0, 1])
def test_dft_grad_padding_back_between_transposes(inverse: int) -> None:
    # a dft_length shorter than the axis: the gradient pads one axis back (its input is a DFT's output,
    # which the transpose optimizer does not cross, so this one ran before too)
    shape, perm, axis, length = (3, 4, 6, 2), [2, 1, 0, 3], 0, 4
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=perm),
        helper.make_node("DFT", ["t", "n", "ax"], ["f"], inverse=inverse),
        helper.make_node("Transpose", ["f"], ["y"], perm=perm),
        helper.make_node("Mul", ["y", "u"], ["yu"]),
        helper.make_node("ReduceSum", ["yu"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "dft_t", [vi("x", D, shape), vi("u", D, None)], [vi("loss", D, [])],
        [helper.make_tensor("n", I64, [], [length]), helper.make_tensor("ax", I64, [], [axis])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape)
    xt = torch.tensor(x, requires_grad=True)
    t = xt.permute(*perm)
    z = torch.complex(t[..., 0], t[..., 1]).narrow(axis, 0, length)
    f = torch.fft.ifft(z, dim=axis) if inverse else torch.fft.fft(z, dim=axis)
    y = torch.stack([f.real, f.imag], -1).permute(*perm)
    u = rng.standard_normal(tuple(y.shape))
    _check(model, {"x": x, "u": u}, (y * torch.tensor(u)).sum(), xt)
