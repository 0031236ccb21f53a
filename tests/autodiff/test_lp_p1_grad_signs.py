"""LpPool, GlobalLpPool and LpNormalization with p = 1 against torch autograd at ±0, ±inf, NaN and dY = ±0,
±inf, NaN (float32 and float64).

The pools are torch's composition of ONNX's math, the window sums of |x| (``avg_pool2d`` of ``x.abs()`` with
divisor 1, and ``x.abs().sum``; torch's own ``lp_pool2d`` with p = 1 does not take |x|): their gradient is
dY·sgn(x) summed over the windows, with torch's sgn 0 at ±0 and NaN, so a NaN input whose windows are masked
out downstream (dY = 0) gets 0, bit for bit. ONNX's Sign, which the rule used, is NaN there.

LpNormalization (``x / n``, n = Σ|x| taken as 1 where it is 0) is compared with the NaN, inf and finite
pattern exact and the values to a few ulp: its two terms are summed in another order than torch sums them,
so only the sign of a zero result may differ. A NaN in a slice makes the whole slice's norm NaN, so Sign's NaN
did not show there; the rule takes the same sgn as Abs, ReduceL1 and the pools."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.ir.builder import make_model
from onnxtrain.testing import run_engine

torch = pytest.importorskip("torch")
F = torch.nn.functional
NAN, INF = math.nan, math.inf

DTYPES = [np.float32, np.float64]


def _grad(op: str, x: np.ndarray, dy: np.ndarray, **attrs) -> tuple[np.ndarray, np.ndarray]:
    """(Y, dX) of one ``op`` node at ``x`` for the incoming gradient ``dy``; the gradient graph checked."""
    et = helper.np_dtype_to_tensor_dtype(x.dtype)
    graph = helper.make_graph([helper.make_node(op, ["X"], ["Y"], **attrs)], op,
                              [helper.make_tensor_value_info("X", et, x.shape)],
                              [helper.make_tensor_value_info("Y", et, dy.shape)])
    gm = build_gradient_model(make_model(graph, 18), "Y", ["X"], seed_loss=False)
    onnx.checker.check_model(gm, full_check=True)
    with np.errstate(all="ignore"):
        got = dict(zip([o.name for o in gm.graph.output], run_engine(gm, {"X": x, "Y_grad": dy})))
    assert got["X_grad"].dtype == x.dtype
    return got["Y"], got["X_grad"]


def _torch(fn, x: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t = torch.tensor(x, requires_grad=True)
    y = fn(t)
    (g,) = torch.autograd.grad(y, t, torch.tensor(dy))
    return y.detach().numpy(), g.numpy()


def _bitwise(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Where ``got`` and ``want`` are the same number, zeros' signs included (NaN equals NaN)."""
    return (got == want) & (np.signbit(got) == np.signbit(want)) | np.isnan(got) & np.isnan(want)


# one 4×4 plane, 2×2 windows: a NaN masked out (dY 0) and one not (dY inf), ±0 under every dY kind
PLANE = [[NAN, 1.0, -2.0, 0.0], [0.0, -0.0, 3.0, 1.0], [0.0, -0.0, NAN, -1.0], [-0.0, 2.0, INF, -INF]]
PLANE_DY = [[0.0, 1.0], [-0.0, INF]]
# the same plane padded by 1: 3×3 windows, stride 2 (windows overlap; pads count as zeros in the sum)
PADDED_DY = [[-0.0, 0.0], [1.0, -INF]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_lp_pool_p1_is_torchs_window_sum_of_abs_bit_for_bit(dtype: type) -> None:
    x = np.array([[PLANE, np.negative(PLANE)]], dtype)  # a second channel: the signs flipped
    for dy, attrs, torch_args in [
        (np.array([[PLANE_DY, PLANE_DY[::-1]]], dtype),
         {"kernel_shape": [2, 2], "strides": [2, 2]}, (2, 2, 0)),
        (np.array([[PADDED_DY, PLANE_DY]], dtype),
         {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, (3, 2, 1)),
    ]:
        y, got = _grad("LpPool", x, dy, p=1, **attrs)
        ty, want = _torch(lambda t, a=torch_args: F.avg_pool2d(t.abs(), *a, divisor_override=1), x, dy)
        assert _bitwise(y, ty).all(), (y, ty)
        same = _bitwise(got, want)
        assert same.all(), f"{attrs}: x {x[~same]}, onnxtrain {got[~same]}, torch {want[~same]}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_global_lp_pool_p1_is_torchs_sum_of_abs_bit_for_bit(dtype: type) -> None:
    planes = np.array(PLANE)
    # one plane per dY kind: 0 and -0 (the NaN masked out), 1, -inf, NaN
    finite = np.where(np.isnan(planes), 5.0, planes)
    x = np.stack([planes, planes, finite, -planes, planes])[None].astype(dtype)
    x[0, 2, 3, 2:] = [0.0, -0.0]  # finite plane with ±0 under dY = 1
    dy = np.array([0.0, -0.0, 1.0, -INF, NAN], dtype).reshape(1, 5, 1, 1)
    y, got = _grad("GlobalLpPool", x, dy, p=1)
    ty, want = _torch(lambda t: t.abs().sum((2, 3), keepdim=True), x, dy)
    assert _bitwise(y, ty).all(), (y, ty)
    same = _bitwise(got, want)
    assert same.all(), f"x {x[~same]}, onnxtrain {got[~same]}, torch {want[~same]}"


def _lp_norm_1(t: torch.Tensor) -> torch.Tensor:
    n = t.abs().sum(1, keepdim=True)
    return t / torch.where(n == 0, torch.ones_like(n), n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lp_normalization_p1_at_edge_values_as_torch(dtype: type) -> None:
    x = np.array([[NAN, 1, -2], [0, -0.0, 3], [0, 0, 0], [-0.0, -0.0, 0], [INF, 1, 2], [1, 2, 3], [1, 2, 3],
                  [0, 1, 0], [-0.0, -4, 0], [1e-30, -1e30, 0]], dtype)
    dy = np.array([[0, 0, 0], [1, -1, 2], [1, 2, 3], [-0.0, 0, 1], [0, 0, 0], [0, -0.0, 0], [INF, 1, 1],
                   [1, NAN, 1], [INF, 1, -1], [1, 1, 1]], dtype)
    y, got = _grad("LpNormalization", x, dy, p=1, axis=1)
    ty, want = _torch(_lp_norm_1, x, dy)
    assert _bitwise(y, ty).all(), (y, ty)
    for kind in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(kind(got), kind(want), err_msg=kind.__name__)
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=4 * np.finfo(dtype).eps, atol=0)
