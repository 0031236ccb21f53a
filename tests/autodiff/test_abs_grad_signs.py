"""Abs's gradient is torch's dY·sgn(x) (sgn 0 at 0 and NaN) to the bit: at x = ±0 or NaN it is dY·0, so a
finite dY gives a zero of dY's sign and an infinite or NaN one gives NaN (as ``sqrt(|x|)`` at 0 does in
torch), while a masked-out NaN (dY = 0) still sends 0 back."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.testing import run_engine

torch = pytest.importorskip("torch")

X = [math.nan, 0.0, -0.0, 2.0, -3.0]
DY = [1.0, -1.0, math.inf, -math.inf, math.nan, 0.0, -0.0]


def _model(et: int) -> onnx.ModelProto:
    """loss = Σ |x|·w: the gradient reaching Abs is w exactly."""
    nodes = [helper.make_node("Abs", ["x"], ["a"]), helper.make_node("Mul", ["a", "w"], ["aw"]),
             helper.make_node("ReduceSum", ["aw"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "abs", [helper.make_tensor_value_info("x", et, ["n"]),
                                         helper.make_tensor_value_info("w", et, ["n"])],
                          [helper.make_tensor_value_info("loss", et, [])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _grid(dtype: type) -> tuple[np.ndarray, np.ndarray]:
    x, w = zip(*[(a, b) for a in X for b in DY])
    return np.array(x, dtype), np.array(w, dtype)


def _torch(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    tx = torch.tensor(x, requires_grad=True)
    (g,) = torch.autograd.grad(tx.abs(), tx, torch.tensor(w))
    return g.numpy()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_abs_gradient_is_torchs_bit_for_bit(dtype: type) -> None:
    gm = build_gradient_model(_model(helper.np_dtype_to_tensor_dtype(np.dtype(dtype))), "loss", ["x"])
    onnx.checker.check_model(gm, full_check=True)
    x, w = _grid(dtype)
    with np.errstate(invalid="ignore"):
        got = dict(zip([o.name for o in gm.graph.output], run_engine(gm, {"x": x, "w": w})))["x_grad"]
    want = _torch(x, w)
    assert got.dtype == want.dtype
    bad = [(float(a), float(b), float(c), float(d)) for a, b, c, d in zip(x, w, got, want)
           if not (c == d and np.signbit(c) == np.signbit(d) or (np.isnan(c) and np.isnan(d)))]
    assert not bad, f"(x, dY, onnxtrain, torch): {bad}"


def test_sqrt_of_abs_at_zero_is_nan_as_in_torch() -> None:
    """d sqrt(|x|)/dx at 0 is inf·0: NaN in torch; onnxtrain gave 0."""
    nodes = [helper.make_node("Abs", ["x"], ["a"]), helper.make_node("Sqrt", ["a"], ["s"]),
             helper.make_node("ReduceSum", ["s"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [3])],
                          [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    gm = build_gradient_model(model, "loss", ["x"])
    x = np.array([0.0, 1.0, -4.0])
    with np.errstate(divide="ignore", invalid="ignore"):
        got = dict(zip([o.name for o in gm.graph.output], run_engine(gm, {"x": x})))["x_grad"]
    tx = torch.tensor(x, requires_grad=True)
    tx.abs().sqrt().sum().backward()
    np.testing.assert_array_equal(got, tx.grad.numpy())
