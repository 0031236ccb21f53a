"""Gradients on grids of edge values against torch autograd, float32 and float64: inputs at ±0, ±inf, NaN,
subnormals, huge values, kinks and ties, each under every kind of incoming gradient (dY = ±0, a number,
±inf, NaN), one node per graph with dY fed as ``Y_grad``.

Where a gradient is a selection (a flat side, an input not taken) torch selects 0 whatever dY is, so an
infinite or NaN dY there sends 0, not 0·dY = NaN; where it is a product torch multiplies (dY = inf at a zero
factor gives NaN). ``test_edge_values_vs_torch.py`` checks these ops at kinks with a finite positive dY; here
the NaN, inf and signed-zero pattern must be torch's exactly and the numbers equal to a few ulp.

Left out, where torch itself has no single answer: a NaN input of Elu, Selu, Celu, HardSwish and Shrink
(torch's vectorized kernels give NaN, its scalar loop, which short tensors take, the linear side's dY:
test_edge_values_vs_torch's five-element NaN test sees the latter),
ReduceProd with a zero anywhere in the tensor (torch then switches to exclusive products for every slice).
The documented differences are tested as such at the end."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.ir.builder import make_model
from onnxtrain.testing import run_engine

torch = pytest.importorskip("torch")
F = torch.nn.functional
NAN, INF = math.nan, math.inf

DTYPES = [np.float32, np.float64]
DYS = [1.0, -2.5, 0.0, -0.0, INF, -INF, NAN]
XS = [NAN, -INF, -1e30, -100.0, -3.0, -1.0, -0.5, -1e-40, -0.0, 0.0, 1e-40, 1e-30, 0.5, 1.0, 3.0, 100.0,
      1e30, INF]


def _grads(op: str, inputs: dict[str, np.ndarray], dy: np.ndarray, opset: int = 18,
           consts: tuple[str, ...] = (), **attrs) -> dict[str, np.ndarray]:
    """Y and the gradient of every input not in ``consts`` of one ``op`` node for the fed ``dy``; the
    gradient graph checked."""
    given = {n: v for n, v in inputs.items() if n not in consts}
    et = helper.np_dtype_to_tensor_dtype(dy.dtype)
    graph = helper.make_graph(
        [helper.make_node(op, list(inputs), ["Y"], **attrs)], op,
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for n, v in given.items()],
        [helper.make_tensor_value_info("Y", et, dy.shape)],
        [numpy_helper.from_array(inputs[n], n) for n in consts])
    gm = build_gradient_model(make_model(graph, opset), "Y", list(given), seed_loss=False)
    onnx.checker.check_model(gm, full_check=True)
    with np.errstate(all="ignore"):
        return dict(zip([o.name for o in gm.graph.output], run_engine(gm, {**given, "Y_grad": dy})))


def _torch(fn: Callable, inputs: dict[str, np.ndarray], wrt: list[str], dy: np.ndarray) -> dict:
    ts = {n: torch.tensor(v, requires_grad=n in wrt) for n, v in inputs.items()}
    y = fn(*ts.values())
    gs = torch.autograd.grad(y, [ts[n] for n in wrt], torch.tensor(dy))
    return {"Y": y.detach().numpy(), **{f"{n}_grad": g.numpy() for n, g in zip(wrt, gs)}}


def _same(got: np.ndarray, want: np.ndarray, rtol: float, where: Callable[[int], str]) -> None:
    """NaN, ±inf and a zero's sign where both are 0 exactly as ``want``; other numbers to ``rtol``, and
    below the smallest normal number (subnormals, where the two round differently) to that number."""
    assert got.dtype == want.dtype
    got, want = got.reshape(-1), want.reshape(-1)
    tiny = np.finfo(want.dtype).tiny
    with np.errstate(all="ignore"):
        zeros = (got == 0) & (want == 0)
        ok = np.where(np.isnan(want), np.isnan(got),
                      np.where(np.isinf(want), got == want,
                               np.where(zeros, np.signbit(got) == np.signbit(want),
                                        np.abs(got - want) <= rtol * np.abs(want) + tiny)))
    bad = [f"{where(i)}: onnxtrain {got[i]!r}, torch {want[i]!r}" for i in np.flatnonzero(~ok)]
    assert not bad, f"{len(bad)} differ:\n" + "\n".join(bad[:20])


def _grid(dt: type, *axes: list[float]) -> list[np.ndarray]:
    """Every combination of the values of ``axes`` (the last one dY), as flat arrays of type ``dt``."""
    mesh = np.meshgrid(*[np.array(a, np.float64) for a in axes], indexing="ij")
    return [m.reshape(-1).astype(dt) for m in mesh]


# ---- fixed here: each failed before ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_hard_swish_flat_side_sends_0_for_any_incoming_gradient(dtype: type) -> None:
    # X ≤ -3 gives 0 as torch's hardswish_backward selects it; dY·0 was NaN for dY = ±inf or NaN (and -0 for
    # a negative dY)
    x, dy = _grid(dtype, [v for v in XS if not math.isnan(v)] + [-3.0000002, 2.9999998], DYS)
    got = _grads("HardSwish", {"x": x}, dy)
    want = _torch(F.hardswish, {"x": x}, ["x"], dy)
    # float64: ONNX's slope 1/6 is a float32 attribute (the documented float32 attributes)
    _same(got["x_grad"], want["x_grad"], 1e-6 if dtype == np.float32 else 2e-7,
          lambda i: f"x {x[i]}, dY {dy[i]}")


MAXMIN = [NAN, -INF, -1e30, -2.0, -0.0, 0.0, 1e-40, 0.5, 2.0, 1e30, INF]


@pytest.mark.parametrize("op", ["Max", "Min"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_max_min_of_two_inputs_as_torch_maximum_minimum(op: str, dtype: type) -> None:
    # the input not taken gets +0 whatever dY is (it got 0·dY: NaN for an infinite or NaN dY, -0 for a
    # negative one); at a NaN Y both inputs get dY, as torch's (they got 0); ties (±0 too) split evenly
    a, b, dy = _grid(dtype, MAXMIN, MAXMIN, DYS)
    got = _grads(op, {"a": a, "b": b}, dy)
    want = _torch(torch.maximum if op == "Max" else torch.minimum, {"a": a, "b": b}, ["a", "b"], dy)
    for n in ("a_grad", "b_grad"):
        _same(got[n], want[n], 0.0, lambda i, n=n: f"{n} at a {a[i]}, b {b[i]}, dY {dy[i]}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_max_with_a_constant_bound_at_edge_values_as_clamp(dtype: type) -> None:
    # one varying input: Max(x, c) is torch.clamp(x, min=c), whose NaN x gets 0; x below the bound gets +0
    # whatever dY is
    x, dy = _grid(dtype, MAXMIN, DYS)
    got = _grads("Max", {"x": x, "c": np.array(0.5, dtype)}, dy, consts=("c",))
    want = _torch(lambda t, c: t.clamp(min=0.5), {"x": x, "c": np.array(0.5, dtype)}, ["x"], dy)
    _same(got["x_grad"], want["x_grad"], 0.0, lambda i: f"x {x[i]}, dY {dy[i]}")


POW_BASES = [NAN, -INF, -2.0, -1.0, -0.5, -1e-40, -0.0, 0.0, 1e-40, 0.5, 1.0, 2.0, 1e30, INF]
POW_EXPONENTS = [NAN, -INF, -2.0, -1.0, -0.5, -1e-40, -0.0, 0.0, 1e-40, 0.5, 1.0, 2.0, 3.0, 1e30, INF]


@pytest.mark.parametrize("dtype", DTYPES)
def test_pow_gradients_on_a_grid_as_torch(dtype: type) -> None:
    # dA: 0 selected at B == 0 (dY·0 was NaN for an infinite or NaN dY), then dY·(B·A^(B−1)) in torch's order
    # (dY·B first gave inf where B·A^(B−1) underflows to 0 and torch has NaN); dB: torch's mask A == 0 ≤ B
    # inside the product (dY = inf there gives NaN; a NaN B is no B ≥ 0). The exponent's gradient at a
    # negative base is 0 where torch's is NaN (documented, below), so those bases are left out of dB
    a, b, dy = _grid(dtype, POW_BASES, POW_EXPONENTS, DYS)
    got = _grads("Pow", {"a": a, "b": b}, dy)
    want = _torch(torch.pow, {"a": a, "b": b}, ["a", "b"], dy)
    rtol = 4 * np.finfo(dtype).eps
    _same(got["Y"], want["Y"], rtol, lambda i: f"Y at a {a[i]}, b {b[i]}")
    _same(got["a_grad"], want["a_grad"], rtol, lambda i: f"dA at a {a[i]}, b {b[i]}, dY {dy[i]}")
    keep = ~(a < 0)
    _same(got["b_grad"][keep], want["b_grad"][keep], rtol,
          lambda i: f"dB at a {a[keep][i]}, b {b[keep][i]}, dY {dy[keep][i]}")


@pytest.mark.parametrize("c", [0.5, 2.0, 3.0, -1.0, -0.5, 1.5, -2.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pow_with_a_fixed_exponent_as_torchs_scalar_pow(c: float, dtype: type) -> None:
    # x.pow(c) with a Python number, as torch's exporters write it (Pow with a constant): at c = 0.5 the
    # forward is the square root (−0 at −0, NaN at −inf) and torch's gradient 0.5·rsqrt(x) is −inf at −0
    # and NaN at −inf; 0.5·A^−0.5 gave +inf and 0 there
    x, dy = _grid(dtype, POW_BASES, DYS)
    got = _grads("Pow", {"x": x, "c": np.array(c, dtype)}, dy, consts=("c",))
    want = _torch(lambda t, _c: t.pow(c), {"x": x, "c": np.array(c, dtype)}, ["x"], dy)
    if c != -0.5:  # (the engine's x^−0.5 is numpy's and onnx.reference's, +inf at −0 and 0 at −inf, where
        # torch's scalar pow takes rsqrt: −inf and NaN; its gradient −0.5·x^−1.5 agrees)
        _same(got["Y"], want["Y"], 4 * np.finfo(dtype).eps, lambda i: f"Y at x {x[i]}")
    _same(got["x_grad"], want["x_grad"], 4 * np.finfo(dtype).eps, lambda i: f"x {x[i]}, dY {dy[i]}")


# ---- found equal: kept so ---------------------------------------------------------------------------------

UNARY: dict[str, tuple[str, dict, Callable, bool, float]] = {
    # name → (op, attributes, torch's function, NaN inputs compared, float64 rtol)
    "Relu": ("Relu", {}, F.relu, False, 1e-15),  # (NaN: documented, below)
    "LeakyRelu": ("LeakyRelu", {"alpha": 0.25}, lambda t: F.leaky_relu(t, 0.25), True, 1e-15),
    "Elu": ("Elu", {"alpha": 0.75}, lambda t: F.elu(t, 0.75), False, 1e-12),
    "Selu": ("Selu", {}, F.selu, False, 2e-7),  # ONNX's float32 constants
    "Celu": ("Celu", {"alpha": 1.5}, lambda t: F.celu(t, 1.5), False, None),  # (float32 only in ONNX)
    "HardSigmoid": ("HardSigmoid", {"alpha": 0.25, "beta": 0.5}, None, True, 1e-15),
    "Shrink_soft": ("Shrink", {"lambd": 0.5, "bias": 0.5}, lambda t: F.softshrink(t, 0.5), False, 1e-15),
    "Shrink_hard": ("Shrink", {"lambd": 0.5}, lambda t: F.hardshrink(t, 0.5), False, 1e-15),
    "Softplus": ("Softplus", {}, F.softplus, True, 1e-12),
    "Erf": ("Erf", {}, torch.erf, True, 1e-12),
    "Atan": ("Atan", {}, torch.atan, True, 1e-12),
    "Tanh": ("Tanh", {}, torch.tanh, True, 1e-12),
    "Sigmoid": ("Sigmoid", {}, torch.sigmoid, True, 1e-12),
    "Exp": ("Exp", {}, torch.exp, True, 1e-12),
    "Log": ("Log", {}, torch.log, True, 1e-12),
    "Sqrt": ("Sqrt", {}, torch.sqrt, True, 1e-12),
    "Reciprocal": ("Reciprocal", {}, torch.reciprocal, True, 1e-12),
    "Asin": ("Asin", {}, torch.asin, True, 1e-12),
    "Acos": ("Acos", {}, torch.acos, True, 1e-12),
    "Atanh": ("Atanh", {}, torch.atanh, True, 1e-12),
    "Acosh": ("Acosh", {}, torch.acosh, True, 1e-12),
    "Sinh": ("Sinh", {}, torch.sinh, True, 1e-12),
    "Cosh": ("Cosh", {}, torch.cosh, True, 1e-12),
    "Mish": ("Mish", {}, F.mish, True, 1e-12),
}
# kinks and overflow points besides XS
EXTRA = [-3.0000002, 2.9999998, 20.0, 88.0, 89.0, 709.0, 710.0, -89.0, -104.0, -710.0, -746.0, 1.0000001,
         0.9999999]
# points left out per op: Sigmoid (Softplus's dY·σ(x)) underflows to 0 on the engine where torch's is
# subnormal, which only an infinite dY tells apart (inf vs NaN); torch's sinh and cosh overflow before the
# float type does (float32 from |x| ≈ 88.7, where sinh(89) = 2.2e38; float64 at 710), so dY·sinh is inf,
# and NaN for dY = 0, where the engine's is finite
SKIP = {"Softplus": {-89.0, -100.0, -104.0, -710.0, -746.0}, "Sinh": {-89.0, 89.0, -710.0, 710.0},
        "Cosh": {-89.0, 89.0, -710.0, 710.0}}
# float32 rtol besides 2e-6: Tanh's 1 − Y² near |x| = 3 cancels (Y rounded to float32 on both sides)
RTOL32 = {"Tanh": 3e-5}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(UNARY))
def test_unary_gradients_on_a_grid_as_torch(name: str, dtype: type) -> None:
    op, attrs, fn, with_nan, rtol64 = UNARY[name]
    if rtol64 is None and dtype == np.float64:
        pytest.skip(f"{op} has no float64 in ONNX")
    if fn is None:  # HardSigmoid with torch's clamp composition: slope 1/4 has no torch function
        def fn(t: torch.Tensor) -> torch.Tensor:
            return (t * 0.25 + 0.5).clamp(0, 1)
    xs = [v for v in XS + EXTRA + [-v for v in EXTRA]
          if (with_nan or not math.isnan(v)) and v not in SKIP.get(name, ())]
    x, dy = _grid(dtype, xs, DYS)
    got = _grads(op, {"x": x}, dy, **attrs)
    want = _torch(fn, {"x": x}, ["x"], dy)
    rtol = RTOL32.get(name, 2e-6) if dtype == np.float32 else rtol64
    _same(got["x_grad"], want["x_grad"], rtol, lambda i: f"x {x[i]!r}, dY {dy[i]}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_thresholded_relu_at_alpha_and_prelu_at_0(dtype: type) -> None:
    x, dy = _grid(dtype, [v for v in XS if not math.isnan(v)] + [1.0000001, 0.9999999], DYS)
    got = _grads("ThresholdedRelu", {"x": x}, dy, alpha=1.0)
    want = _torch(lambda t: F.threshold(t, 1.0, 0.0), {"x": x}, ["x"], dy)
    _same(got["x_grad"], want["x_grad"], 0.0, lambda i: f"x {x[i]!r}, dY {dy[i]}")
    # PRelu with one slope, NaN and inf slopes too, against F.prelu (its slope's gradient summed)
    x2 = x.reshape(1, -1)
    for s in (0.25, 0.0, NAN, INF):
        slope = np.array([s], dtype)
        got = _grads("PRelu", {"x": x2, "s": slope}, dy.reshape(1, -1))
        want = _torch(F.prelu, {"x": x2, "s": slope}, ["x", "s"], dy.reshape(1, -1))
        _same(got["x_grad"], want["x_grad"], 0.0, lambda i, s=s: f"slope {s}, x {x[i]!r}, dY {dy[i]}")
        _same(got["s_grad"], want["s_grad"], 1e-6, lambda i, s=s: f"slope {s}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_where_and_clip_with_tensor_bounds_at_nan_and_infinities(dtype: type) -> None:
    vals = [NAN, -INF, -1.0, -0.0, 0.0, 2.0, INF]
    x, y, dy = _grid(dtype, vals, vals, DYS)
    for c in (True, False):
        cond = np.full(x.shape, c)
        got = _grads("Where", {"c": cond, "x": x, "y": y}, dy)
        want = _torch(torch.where, {"c": cond, "x": x, "y": y}, ["x", "y"], dy)
        for n in ("x_grad", "y_grad"):
            _same(got[n], want[n], 0.0, lambda i, n=n, c=c: f"{n} at c {c}, x {x[i]}, y {y[i]}, dY {dy[i]}")
    x, lo, hi, dy = _grid(dtype, vals, [NAN, -INF, -1.0, 0.0], [NAN, -0.0, 1.0, INF], DYS)
    got = _grads("Clip", {"x": x, "lo": lo, "hi": hi}, dy)
    want = _torch(torch.clamp, {"x": x, "lo": lo, "hi": hi}, ["x", "lo", "hi"], dy)
    for n in ("x_grad", "lo_grad", "hi_grad"):
        _same(got[n], want[n], 0.0, lambda i, n=n: f"{n} at x {x[i]}, lo {lo[i]}, hi {hi[i]}, dY {dy[i]}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_div_by_zero_and_infinities(dtype: type) -> None:
    vals = [NAN, -INF, -2.0, -0.0, 0.0, 0.5, 3.0, INF]
    a, b, dy = _grid(dtype, vals, vals, DYS)
    got = _grads("Div", {"a": a, "b": b}, dy)
    want = _torch(torch.div, {"a": a, "b": b}, ["a", "b"], dy)
    _same(got["a_grad"], want["a_grad"], 0.0, lambda i: f"dA at a {a[i]}, b {b[i]}, dY {dy[i]}")
    _same(got["b_grad"], want["b_grad"], 4 * np.finfo(dtype).eps,
          lambda i: f"dB at a {a[i]}, b {b[i]}, dY {dy[i]}")


ROWS = [[NAN, 1, 2], [-INF, -INF, -INF], [INF, INF, 1], [0.0, -0.0, -1], [-0.0, -0.0, -0.0], [1, 1, 1],
        [2, 1, NAN], [-INF, 0, 1], [1e30, -1e30, 0], [1e-40, 1e-40, 0]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reductions_and_softmax_rows_under_every_incoming_gradient(dtype: type) -> None:
    rows = np.array(ROWS, dtype)
    axes = np.array([1], np.int64)
    cases = [("ReduceMax", {}, lambda t: torch.amax(t, 1, keepdim=True)),
             ("ReduceMin", {}, lambda t: torch.amin(t, 1, keepdim=True)),
             ("ReduceLogSumExp", {}, lambda t: torch.logsumexp(t, 1, keepdim=True)),
             ("ReduceSumSquare", {}, lambda t: (t * t).sum(1, keepdim=True)),
             ("ReduceMean", {}, lambda t: t.mean(1, keepdim=True))]
    for dyv in DYS:
        dy = np.full((len(ROWS), 1), dyv, dtype)
        for op, attrs, fn in cases:
            got = _grads(op, {"x": rows, "axes": axes}, dy, consts=("axes",), **attrs)
            want = _torch(lambda t, ax, f=fn: f(t), {"x": rows, "axes": axes}, ["x"], dy)
            _same(got["x_grad"], want["x_grad"], 4 * np.finfo(dtype).eps,
                  lambda i, op=op, dyv=dyv: f"{op} row {rows[i // 3]}, dY {dyv}")
        dy = np.array([[dyv, 1.0, -1.0]] * len(ROWS), dtype)
        for op, fn in (("Softmax", lambda t: torch.softmax(t, -1)),
                       ("LogSoftmax", lambda t: torch.log_softmax(t, -1))):
            got = _grads(op, {"x": rows}, dy, axis=-1)
            want = _torch(fn, {"x": rows}, ["x"], dy)
            _same(got["x_grad"], want["x_grad"], 8 * np.finfo(dtype).eps,
                  lambda i, op=op, dyv=dyv: f"{op} row {rows[i // 3]}, dY {dyv}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_prod_without_zeros_at_nan_infinities_and_overflow(dtype: type) -> None:
    # no zero anywhere in the tensor: torch's dY·Y/X, as the rule's (a zero elsewhere makes torch take
    # exclusive products for every slice: left out)
    rows = np.array([[NAN, 1, 2], [-INF, -INF, -INF], [INF, INF, 1], [1e30, 1e30, 1], [2, 1, NAN],
                     [-INF, 2, 1], [1e-40, 3, 1], [-0.5, 4, -2]], dtype)
    axes = np.array([1], np.int64)
    for dyv in DYS:
        dy = np.full((len(rows), 1), dyv, dtype)
        got = _grads("ReduceProd", {"x": rows, "axes": axes}, dy, consts=("axes",))
        want = _torch(lambda t, ax: t.prod(1, keepdim=True), {"x": rows, "axes": axes}, ["x"], dy)
        _same(got["x_grad"], want["x_grad"], 4 * np.finfo(dtype).eps,
              lambda i, dyv=dyv: f"row {rows[i // 3]}, dY {dyv}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_max_pool_and_argmax_gather_ties_nan_and_signed_zeros(dtype: type) -> None:
    plane = np.array([[[[1, 3, 3, -INF], [3, 2, 0, -INF], [3, 3, -0.0, 0.0], [NAN, 1, -0.0, -0.0]]]], dtype)
    for dyv in DYS:
        dy = np.full((1, 1, 3, 3), dyv, dtype)
        dy[0, 0, 1, 1] = 2.0
        got = _grads("MaxPool", {"x": plane}, dy, kernel_shape=[2, 2])
        want = _torch(lambda t: F.max_pool2d(t, 2, 1), {"x": plane}, ["x"], dy)
        _same(got["x_grad"], want["x_grad"], 0.0,
              lambda i, dyv=dyv: f"MaxPool x {plane.reshape(-1)[i]}, dY {dyv}")
    # GatherElements(x, ArgMax(x)): the first maximum (NaN counts as the largest) takes dY
    xs = np.array([[1, 3, 3], [NAN, 1, 2], [-INF, -INF, -INF], [0.0, -0.0, -1], [2, NAN, NAN], [INF, 1, INF]],
                  dtype)
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(
        [helper.make_node("ArgMax", ["x"], ["i"], axis=1, keepdims=1),
         helper.make_node("GatherElements", ["x", "i"], ["Y"], axis=1)], "g",
        [helper.make_tensor_value_info("x", et, [6, 3])], [helper.make_tensor_value_info("Y", et, [6, 1])])
    gm = build_gradient_model(make_model(graph, 18), "Y", ["x"], seed_loss=False)
    onnx.checker.check_model(gm, full_check=True)
    for dyv in DYS:
        dy = np.full((6, 1), dyv, dtype)
        with np.errstate(all="ignore"):
            got = dict(zip([o.name for o in gm.graph.output], run_engine(gm, {"x": xs, "Y_grad": dy})))
        want = _torch(lambda t: torch.gather(t, 1, t.argmax(1, keepdim=True)), {"x": xs}, ["x"], dy)
        _same(got["x_grad"], want["x_grad"], 0.0, lambda i, dyv=dyv: f"gather row {i // 3}, dY {dyv}")


# ---- documented differences -------------------------------------------------------------------------------


def test_documented_differences_at_edge_values() -> None:
    x = np.array([NAN, -INF, INF, -1.0], np.float64)
    one = np.ones(4)
    # Relu at NaN: 0 (onnxruntime-training's ReluGrad selects on X > 0 too); torch passes dY on
    np.testing.assert_array_equal(_grads("Relu", {"x": x}, one)["x_grad"], [0, 0, 1, 0])
    # Softsign: the derivative 1/(1 + |x|)², 0 at ±inf and dY·that for an infinite dY; torch's F.softsign is
    # the composition x / (1 + |x|), whose backward gives inf/inf = NaN at ±inf and inf − inf with dY = inf
    got = _grads("Softsign", {"x": x[1:]}, np.array([1.0, 1.0, INF]))["x_grad"]
    np.testing.assert_array_equal(got, [0.0, 0.0, INF / 4])
    # Div's divisor gradient is −dY·(A/B)/B: torch's −dY·A/B² overflows B² (float32 B = 1e30: NaN)
    got = _grads("Div", {"a": np.array([2.0], np.float32), "b": np.array([1e30], np.float32)},
                 np.array([INF], np.float32))["b_grad"]
    assert got[0] == -INF
