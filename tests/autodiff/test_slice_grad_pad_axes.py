"""The gradient of a Slice whose bounds are known at run time only, run by onnxruntime with its optimizations.

onnxruntime 1.32's transpose optimizer, pushing a Transpose through a Pad that has an ``axes`` input,
permutes the pads as if they covered every axis: a Slice gradient written as ``Pad(dY, pads, axes)`` between
two Transposes failed to run there ("indices element out of data bounds" in a Gather it inserted). The
gradient now pads every axis (an unknown rank too: tests/autodiff/test_pad_axes_rules.py).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from onnxtrain.autodiff import build_gradient_model

D, I64 = TensorProto.DOUBLE, TensorProto.INT64


def _model(opset: int) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2, 3]),
        helper.make_node("Slice", ["t", "starts", "ends", "axes"], ["s"]),
        helper.make_node("Transpose", ["s"], ["y"], perm=[1, 0, 2, 3]),
        helper.make_node("Mul", ["y", "u"], ["yu"]),
        helper.make_node("ReduceSum", ["yu"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "slice_pad_axes",
        [helper.make_tensor_value_info("x", D, [4, 3, 3, 2]),
         helper.make_tensor_value_info("starts", I64, [1]),
         helper.make_tensor_value_info("u", D, [4, 3, 2, 2])],
        [helper.make_tensor_value_info("loss", D, [])],
        [helper.make_tensor("ends", I64, [1], [3]), helper.make_tensor("axes", I64, [1], [2])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_slice_grad_with_fed_starts_runs_in_optimized_onnxruntime() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 3, 2))
    starts = np.array([-2], np.int64)
    u = rng.standard_normal((4, 3, 2, 2))
    xt = torch.tensor(x, requires_grad=True)
    loss = (xt.permute(1, 0, 2, 3)[:, :, 1:3].permute(1, 0, 2, 3) * torch.tensor(u)).sum()
    (want,) = torch.autograd.grad(loss, xt)
    for opset in (18, 21):
        grad = build_gradient_model(_model(opset), "loss", ["x"])
        onnx.checker.check_model(grad, full_check=True)
        so = ort.SessionOptions()
        so.log_severity_level = 4
        sess = ort.InferenceSession(grad.SerializeToString(), so, providers=["CPUExecutionProvider"])
        outs = sess.run(None, {"x": x, "starts": starts, "u": u})
        got = dict(zip([o.name for o in sess.get_outputs()], outs))
        np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-12)
        np.testing.assert_allclose(got["x_grad"], want.numpy(), rtol=1e-12, atol=1e-12)
