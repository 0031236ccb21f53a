"""Pow with one exponent for every element: squares and cubes as products (onnxruntime's and torch's bits),
float32 powers correctly rounded, C's signs and special values, no numpy warnings."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from onnxtrain.engine import compile_model

FLOATS = {np.float32: TensorProto.FLOAT, np.float64: TensorProto.DOUBLE}


def _model(dtype, exp_shape: list[int], exp_type: int | None = None,
           x_shape: list[int | None] | None = None) -> onnx.ModelProto:
    """One Pow node of x (a vector, or ``x_shape``) by an input exponent e of ``exp_shape``."""
    g = helper.make_graph(
        [helper.make_node("Pow", ["x", "e"], ["y"])], "pow",
        [helper.make_tensor_value_info("x", FLOATS[dtype], [None] if x_shape is None else x_shape),
         helper.make_tensor_value_info("e", exp_type or FLOATS[dtype], exp_shape)],
        [helper.make_tensor_value_info("y", FLOATS[dtype], None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _bases(dtype, n: int = 50_000) -> np.ndarray:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n) * np.exp(rng.uniform(-6, 6, n))  # negative and positive, over 5 decades
    return x.astype(dtype)


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.int32 if a.dtype == np.float32 else np.int64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("e", [2.0, 3.0])
@pytest.mark.parametrize("exp_shape", [[], [1]])
def test_square_and_cube_are_onnxruntimes_bits(dtype, e, exp_shape):
    x = _bases(dtype)
    model = _model(dtype, exp_shape)
    feeds = {"x": x, "e": np.full(exp_shape, e, dtype)}
    got = compile_model(model).run(feeds)[0]
    theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = theirs.run(None, feeds)[0]
    assert got.dtype == dtype and got.shape == x.shape
    np.testing.assert_array_equal(_bits(got), _bits(want))
    # and torch's (its pow by a scalar 2 or 3 multiplies too)
    np.testing.assert_array_equal(_bits(got), _bits(torch.pow(torch.from_numpy(x), e).numpy()))


@pytest.mark.parametrize("e", [4.0, 5.0, 7.0, -2.0, -3.0, -4.0, 1.5, 2.5, 3.5, -0.5, -1.5, -3.5, 0.25,
                               1.0 / 3.0])
def test_float32_powers_are_correctly_rounded(e):
    """Against the float32 rounding of an extended-precision power (numpy's float32 pow is 1 ulp off on
    a large share of the values); within 1 ulp of onnxruntime's (glibc's powf), equal on nearly all.
    Integer and half-integer exponents up to 4 are float64 products, square roots and a reciprocal."""
    x = _bases(np.float32)
    e32 = np.float32(e)
    model = _model(np.float32, [])
    with np.errstate(all="ignore"):
        got = compile_model(model).run({"x": x, "e": np.asarray(e32)})[0]
        exact = np.power(x.astype(np.longdouble), np.longdouble(e32)).astype(np.float32)
    nan = np.isnan(exact)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(_bits(got[~nan]), _bits(exact[~nan]))
    theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "e": np.asarray(e32)})[0]
    finite = np.isfinite(theirs) & np.isfinite(got)
    ulps = np.abs(_bits(got[finite]).astype(np.int64) - _bits(theirs[finite]))
    assert ulps.max() <= 1 and (ulps > 0).mean() < 0.005
    np.testing.assert_array_equal(np.isnan(got), np.isnan(theirs))


SPECIAL = np.array([-np.inf, -1e30, -3.5, -2, -1, -0.5, -1e-30, -0.0, 0.0, 1e-30, 0.5, 1, 2, 3.5, 1e30,
                    np.inf, np.nan])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("e", [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, -1.0, -2.0, -3.0, -4.0, 0.5, -0.5, 1.5, 2.5, 3.5,
                               -1.5, -3.5, 40.0, 41.0, -41.0, 0.3, np.inf, -np.inf, np.nan])
def test_special_values_follow_numpy_float64(dtype, e):
    """Signs of zeros, infinities, NaN and overflow as numpy's float64 power gives them (C's pow; for the
    exponent 0.5 numpy's square root: −0 at −0 and NaN at −inf, as onnx.reference and torch), rounded once;
    no numpy warning escapes the kernel."""
    x = SPECIAL.astype(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = compile_model(_model(dtype, [])).run({"x": x, "e": np.asarray(e, dtype)})[0]
    with np.errstate(all="ignore"):
        want = np.power(x.astype(np.float64), np.float64(dtype(e))).astype(dtype)
        if e == 3.0:
            want = (x * x) * x
    assert got.dtype == dtype
    same = ((got == want) & (np.signbit(got) == np.signbit(want))) | (np.isnan(got) & np.isnan(want))
    assert same.all(), (x[~same], got[~same], want[~same])


def test_integer_and_broadcast_exponents():
    """An int64 exponent of one element, a [1, 1] one that widens the output, and one per element."""
    x = np.array([[-2.0, 3.0, -0.0]], np.float32)
    plan = compile_model(_model(np.float32, [], TensorProto.INT64))
    np.testing.assert_array_equal(plan.run({"x": x[0], "e": np.asarray(3)})[0], [-8.0, 27.0, -0.0])
    four = np.full((1, 1), 4.0, np.float32)
    wide = compile_model(_model(np.float32, [1, 1])).run({"x": x[0], "e": four})[0]
    assert wide.shape == (1, 3)
    np.testing.assert_array_equal(wide, [[16.0, 81.0, 0.0]])
    each = compile_model(_model(np.float32, [3])).run({"x": x[0], "e": np.array([3, 0.5, -1], np.float32)})[0]
    np.testing.assert_array_equal(np.isnan(each), [False, False, False])
    np.testing.assert_array_equal(each, [-8.0, np.sqrt(np.float32(3)), -np.inf])


def test_tanh_gelu_cube_trains_as_torch():
    """GPT-2's GELU (0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))) written with x³ as Pow: the gradient graph's
    values against torch autograd (float64), on negative and positive inputs."""
    from onnxtrain.autodiff import build_gradient_model

    nodes = [helper.make_node("Pow", ["x", "three"], ["x3"]),
             helper.make_node("Mul", ["x3", "c1"], ["t1"]), helper.make_node("Add", ["x", "t1"], ["t2"]),
             helper.make_node("Mul", ["t2", "c2"], ["t3"]), helper.make_node("Tanh", ["t3"], ["t4"]),
             helper.make_node("Add", ["t4", "one"], ["t5"]), helper.make_node("Mul", ["x", "t5"], ["t6"]),
             helper.make_node("Mul", ["t6", "half"], ["y"]),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    consts = [helper.make_tensor(n, TensorProto.DOUBLE, [], [v]) for n, v in
              (("three", 3.0), ("c1", 0.044715), ("c2", (2 / np.pi) ** 0.5), ("one", 1.0), ("half", 0.5))]
    g = helper.make_graph(nodes, "gelu", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [4, 5])],
                          [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])], initializer=consts)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    grad_model = build_gradient_model(model, "loss", ["x"])
    onnx.checker.check_model(grad_model, full_check=True)
    x = np.random.default_rng(1).standard_normal((4, 5)) * 2
    plan = compile_model(grad_model)
    names = [o.name for o in grad_model.graph.output]
    got = dict(zip(names, plan.run({"x": x})))
    t = torch.tensor(x, requires_grad=True)
    loss = torch.nn.functional.gelu(t, approximate="tanh").sum()
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-12)
    dx = got["x_grad"]
    np.testing.assert_allclose(dx, t.grad.numpy(), rtol=1e-10, atol=1e-12)
    # the emitted graph is standard ONNX: onnxruntime runs it to the same values
    theirs = ort.InferenceSession(grad_model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(theirs.run(["x_grad"], {"x": x})[0], dx, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("e", [2.0, 3.0, 0.5, -1.0, 4.0, 5.0, 1.5, -2.5, 1.0, 0.0, 7.0, 0.3, np.nan])
def test_zero_dimensional_base(e):
    """A 0-d base (a scalar loss's power, as a pipeline stage's gradient has it) gives a 0-d array."""
    x = np.asarray(-2.5, np.float32)
    got = compile_model(_model(np.float32, [], x_shape=[])).run({"x": x, "e": np.asarray(e, np.float32)})[0]
    with np.errstate(all="ignore"):
        want = np.power(np.float64(x), np.float64(e)).astype(np.float32) if e != 3.0 else (x * x) * x
    assert isinstance(got, np.ndarray) and got.shape == () and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("e", [0.0, 1.0])
def test_zeroth_and_first_powers_are_one_and_the_base(dtype, e):
    """x⁰ = 1 for every x (NaN included, as C's pow and onnxruntime's), x¹ = x bit for bit; a new array."""
    with np.errstate(over="ignore"):  # (float16: the large bases are inf)
        x = np.concatenate([SPECIAL, _bases(np.float64, 1000)]).astype(dtype)
    model = _model(dtype, []) if dtype != np.float16 else _half_model()
    got = compile_model(model).run({"x": x, "e": np.asarray(e, dtype)})[0]
    want = np.ones_like(x) if e == 0 else x
    assert got.dtype == dtype and got is not x
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "e": np.asarray(e, dtype)})[0]
    np.testing.assert_array_equal(got.view(np.uint8), theirs.view(np.uint8))


def _half_model() -> onnx.ModelProto:
    g = helper.make_graph(
        [helper.make_node("Pow", ["x", "e"], ["y"])], "pow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [None]),
         helper.make_tensor_value_info("e", TensorProto.FLOAT16, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
