"""Clip's gradient with constant bounds (ReLU6 as torch exports it) and with bounds fed at run time,
against torch autograd in float64: the boundaries themselves pass the gradient, as in torch.clamp, NaN
inputs get none, and min > max passes none."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.testing import run_engine

torch = pytest.importorskip("torch")


def _grad(lo: float, hi: float, x: np.ndarray, u: np.ndarray, constant: bool) -> np.ndarray:
    bounds = [numpy_helper.from_array(np.array(v, np.float64), n) for v, n in ((lo, "lo"), (hi, "hi"))]
    nodes = [helper.make_node("Clip", ["x", "lo", "hi"], ["y"]), helper.make_node("Mul", ["y", "u"], ["yu"]),
             helper.make_node("ReduceSum", ["yu"], ["loss"], keepdims=0)]
    inputs = [helper.make_tensor_value_info(n, onnx.TensorProto.DOUBLE, list(x.shape)) for n in ("x", "u")]
    feeds = {"x": x, "u": u}
    if not constant:
        inputs += [helper.make_tensor_value_info(n, onnx.TensorProto.DOUBLE, []) for n in ("lo", "hi")]
        feeds.update(lo=np.array(lo), hi=np.array(hi))
    graph = helper.make_graph(nodes, "clip", inputs, [helper.make_tensor_value_info("loss", 11, [])],
                              initializer=bounds if constant else [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    gm = build_gradient_model(model, "loss", ["x"])
    onnx.checker.check_model(gm, full_check=True)
    outs = dict(zip([o.name for o in gm.graph.output], run_engine(gm, feeds), strict=True))
    return outs["x_grad"]


@pytest.mark.parametrize("lo, hi", [(0.0, 6.0), (-1.0, 1.0), (2.0, 2.0), (1.0, -1.0)])
@pytest.mark.parametrize("constant", [True, False])
def test_clip_gradient_matches_torch_at_and_between_the_bounds(lo, hi, constant) -> None:
    rng = np.random.default_rng(0)
    x = rng.uniform(-8, 8, (5, 12))
    x[0, :6] = [lo, hi, -0.0, 0.0, np.nan, np.inf]  # the bounds exactly, signed zeros, NaN, inf
    u = rng.standard_normal(x.shape)
    got = _grad(lo, hi, x, u, constant)
    xt = torch.tensor(x, requires_grad=True)
    (torch.clamp(xt, lo, hi) * torch.tensor(u)).sum().backward()
    np.testing.assert_array_equal(got, xt.grad.numpy())
