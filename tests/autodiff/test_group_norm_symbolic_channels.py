"""GroupNormalization's gradient with a symbolic channel count: per group (opset 18-20) it needs no count,
per channel (21) it takes the scale's; both were refused ("needs the static channel count"). float64
central differences are the oracle, and the static-shape graph gives the same gradients."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine import compile_model

D = TensorProto.DOUBLE


def _model(shape: list, opset: int, scale: np.ndarray, bias: np.ndarray, u: np.ndarray):
    g = helper.make_graph(
        [helper.make_node("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=2, epsilon=1e-5),
         helper.make_node("Mul", ["y", "u"], ["yu"]),
         helper.make_node("ReduceSum", ["yu"], ["loss"], keepdims=0)],
        "g", [helper.make_tensor_value_info("x", D, shape)], [helper.make_tensor_value_info("loss", D, [])],
        [numpy_helper.from_array(v, k) for k, v in (("s", scale), ("b", bias), ("u", u))])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("opset", [18, 21])
def test_symbolic_channels_match_central_differences(opset: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 3, 3))
    n = 2 if opset < 21 else 4
    scale, bias, u = rng.uniform(0.5, 1.5, n), rng.standard_normal(n), rng.standard_normal((2, 4, 3, 3))
    got = []
    for shape in (["N", "C", "H", "W"], [2, 4, 3, 3]):
        gm = build_gradient_model(_model(shape, opset, scale, bias, u), "loss", ["x", "s", "b"])
        got.append(dict(zip([o.name for o in gm.graph.output], compile_model(gm).run({"x": x}))))
    symbolic, static = got
    for k in ("x_grad", "s_grad", "b_grad"):
        np.testing.assert_allclose(symbolic[k], static[k], rtol=1e-12, atol=1e-12)
    forward = compile_model(_model(["N", "C", "H", "W"], opset, scale, bias, u))
    h, fd = 1e-6, np.zeros_like(x)
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = h
        fd[i] = (forward.run({"x": x + e})[0] - forward.run({"x": x - e})[0]) / (2 * h)
    np.testing.assert_allclose(symbolic["x_grad"], fd, rtol=1e-5, atol=1e-7)
