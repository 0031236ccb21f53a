"""ReduceL1's gradient is torch's dY·sgn(x) (``x.abs().sum(dim)``, ``torch.linalg.vector_norm(x, 1, dim)``)
to the bit, with sgn 0 at ±0 and NaN: a NaN input whose sum is masked out downstream (dY = 0) sends 0
back, not NaN (ONNX's Sign of NaN is NaN, which the rule multiplied by dY), and an infinite dY at x = 0
gives NaN."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.testing import run_engine

torch = pytest.importorskip("torch")

X = np.array([[math.nan, 1.0, -2.0], [0.0, -0.0, 3.0], [-1.0, 2.0, 0.0], [math.nan, 0.0, 1.0],
              [0.0, 4.0, -4.0], [5.0, -0.0, 0.0]])
W = np.array([0.0, -1.0, math.inf, 1.0, math.nan, -0.0])  # dY of each row's sum


def _model(et: int, keepdims: int) -> onnx.ModelProto:
    """loss = Σ ReduceL1(x, axis 1)·w: the gradient reaching ReduceL1 is w exactly."""
    shape = [6, 1] if keepdims else [6]
    nodes = [helper.make_node("ReduceL1", ["x"], ["r"], axes=[1], keepdims=keepdims),
             helper.make_node("Mul", ["r", "w"], ["rw"]),
             helper.make_node("ReduceSum", ["rw"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "l1", [helper.make_tensor_value_info("x", et, [6, 3]),
                                        helper.make_tensor_value_info("w", et, shape)],
                          [helper.make_tensor_value_info("loss", et, [])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_reduce_l1_gradient_is_torchs_bit_for_bit(dtype: type, keepdims: int) -> None:
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    gm = build_gradient_model(_model(et, keepdims), "loss", ["x"])
    onnx.checker.check_model(gm, full_check=True)
    x = X.astype(dtype)
    w = W.astype(dtype).reshape(-1, 1) if keepdims else W.astype(dtype)
    with np.errstate(invalid="ignore"):
        got = dict(zip([o.name for o in gm.graph.output], run_engine(gm, {"x": x, "w": w})))["x_grad"]
    tx = torch.tensor(x, requires_grad=True)
    (want,) = torch.autograd.grad(tx.abs().sum(1, keepdim=bool(keepdims)), tx, torch.tensor(w))
    want = want.numpy()
    same = (got == want) & (np.signbit(got) == np.signbit(want)) | np.isnan(got) & np.isnan(want)
    assert same.all(), f"x {x[~same]}, onnxtrain {got[~same]}, torch {want[~same]}"
