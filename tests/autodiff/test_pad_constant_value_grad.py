"""Pad's constant value gets the gradient of the cells it fills (it got a silent zero), also where negative
pads crop X and where the pads are known only at run time; float64 central differences the oracle."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine import compile_model

D = TensorProto.DOUBLE


@pytest.mark.parametrize("pads_known", [True, False])
@pytest.mark.parametrize("pads", [[2, -1, -1, 1], [1, 0, 0, 2], [-1, 0, 0, -2]])
def test_constant_value_gradient_matches_central_differences(pads_known: bool, pads: list[int]) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4))
    out_shape = (3 + pads[0] + pads[2], 4 + pads[1] + pads[3])
    u = rng.standard_normal(out_shape)
    inputs = [helper.make_tensor_value_info("x", D, [3, 4]), helper.make_tensor_value_info("cv", D, [])]
    inits = [numpy_helper.from_array(u, "u")]
    p = np.array(pads, np.int64)
    feeds = {"x": x, "cv": np.array(0.7)}
    if pads_known:
        inits.append(numpy_helper.from_array(p, "p"))
    else:
        inputs.append(helper.make_tensor_value_info("p", TensorProto.INT64, [4]))
        feeds["p"] = p
    g = helper.make_graph([helper.make_node("Pad", ["x", "p", "cv"], ["y"]),
                           helper.make_node("Mul", ["y", "u"], ["m"]),
                           helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0)], "g", inputs,
                          [helper.make_tensor_value_info("loss", D, [])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    gm = build_gradient_model(model, "loss", ["x", "cv"])
    got = dict(zip([o.name for o in gm.graph.output], compile_model(gm).run(feeds)))
    forward = compile_model(model)
    h = 1e-6
    loss = lambda c: forward.run({**feeds, "cv": np.array(c)})[0]  # noqa: E731
    want = (loss(0.7 + h) - loss(0.7 - h)) / (2 * h)
    np.testing.assert_allclose(got["cv_grad"], want, rtol=1e-7, atol=1e-9)
    assert got["cv_grad"].shape == ()


def test_constant_value_gradient_of_a_large_float32_input_keeps_its_digits() -> None:
    """Summing the padded cells alone: sum(dY) − sum(dX) over a 10⁶-value tensor lost about 200 float32
    epsilons (1.2e-5 relative); float64 the oracle."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1000, 1000)).astype(np.float32)
    u = (rng.standard_normal((1002, 1002)) + 3).astype(np.float32)  # dL/dY, mostly positive
    F = TensorProto.FLOAT
    g = helper.make_graph([helper.make_node("Pad", ["x", "p", "cv"], ["y"]),
                           helper.make_node("Mul", ["y", "u"], ["m"]),
                           helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0)], "g",
                          [helper.make_tensor_value_info("x", F, [1000, 1000]),
                           helper.make_tensor_value_info("cv", F, [])],
                          [helper.make_tensor_value_info("loss", F, [])],
                          [numpy_helper.from_array(u, "u"),
                           numpy_helper.from_array(np.ones(4, np.int64), "p")])
    gm = build_gradient_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), "loss",
                              ["x", "cv"])
    got = dict(zip([o.name for o in gm.graph.output],
                   compile_model(gm).run({"x": x, "cv": np.array(0.5, np.float32)})))["cv_grad"]
    inner = np.zeros(u.shape, bool)
    inner[1:-1, 1:-1] = True
    want = u.astype(np.float64)[~inner].sum()
    assert abs(float(got) - want) / want < 1e-6
