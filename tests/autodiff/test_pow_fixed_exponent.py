"""Pow's gradient with a fixed exponent (an initializer or Constant): B − 1 is a constant, a square's
gradient is (dY·2)·A with no Pow (RMSNorm's ``x.pow(2)``), a first power's is dY; against torch autograd,
bit for bit where torch rounds the same products, and the run-time path where the exponent is trained."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.ir.builder import make_model
from onnxtrain.testing import run_engine

torch = pytest.importorskip("torch")

EDGES = [0.0, -0.0, 1.0, -1.0, 1e-30, -3.5, 1e30, np.inf, -np.inf, np.nan]


def _bases(dtype, positive: bool = False) -> np.ndarray:
    x = np.random.default_rng(0).standard_normal(300) * 3
    x = np.concatenate([x, EDGES])
    return (np.abs(x) if positive else x).astype(dtype)


def _grad(x: np.ndarray, exponent: np.ndarray, trained: bool = False, as_constant: bool = False,
          y_shape_of_x: bool = True) -> tuple[onnx.ModelProto, dict[str, np.ndarray], np.ndarray]:
    """Gradient graph of loss = Σ Pow(x, e)·r (checked) and its outputs on the engine, and r."""
    et = helper.np_dtype_to_tensor_dtype(x.dtype)
    nodes = [helper.make_node("Pow", ["x", "e"], ["y"]), helper.make_node("Mul", ["y", "r"], ["yr"]),
             helper.make_node("ReduceSum", ["yr"], ["loss"], keepdims=0)]
    inits = []
    if as_constant:
        nodes.insert(0, helper.make_node("Constant", [], ["e"], value=numpy_helper.from_array(exponent)))
    else:
        inits.append(numpy_helper.from_array(exponent, "e"))
    y_shape = np.broadcast_shapes(x.shape, exponent.shape)
    r = np.random.default_rng(1).uniform(0.5, 1.5, y_shape).astype(x.dtype)
    inits.append(numpy_helper.from_array(r, "r"))
    graph = helper.make_graph(nodes, "pow", [helper.make_tensor_value_info("x", et, x.shape)],
                              [helper.make_tensor_value_info("loss", et, [])], inits)
    grads = build_gradient_model(make_model(graph, 18), "loss", ["x", "e"] if trained else ["x"])
    onnx.checker.check_model(grads, full_check=True)
    got = dict(zip([o.name for o in grads.graph.output], run_engine(grads, {"x": x})))
    return grads, got, r


def _torch_grad(x: np.ndarray, exponent: np.ndarray, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    tx = torch.tensor(x, requires_grad=True)
    te = torch.tensor(exponent.astype(x.dtype), requires_grad=True)
    (torch.pow(tx, te) * torch.from_numpy(r)).sum().backward()
    return tx.grad.numpy(), te.grad.numpy()


def _torch_scalar_grad(x: np.ndarray, c: float, r: np.ndarray) -> np.ndarray:
    """torch's gradient of x.pow(c) for a Python-number exponent (its pow_backward: dY·(c·x^(c−1)))."""
    tx = torch.tensor(x, requires_grad=True)
    (tx.pow(c) * torch.from_numpy(r)).sum().backward()
    return tx.grad.numpy()


def _backward_ops(grads: onnx.ModelProto) -> list[str]:
    """The op types of the nodes the builder added after the forward's three."""
    return [n.op_type for n in grads.graph.node[3:]]


def _same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    bits = np.int32 if got.dtype == np.float32 else np.int64
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(bits), want[~nan].view(bits))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("as_constant", [False, True])
def test_square_gradient_is_two_products_with_torchs_bits(dtype, as_constant):
    x = _bases(dtype)
    grads, got, r = _grad(x, np.array(2.0, dtype), as_constant=as_constant)
    assert "Pow" not in _backward_ops(grads) and "Where" not in _backward_ops(grads)
    _same(got["x_grad"], _torch_scalar_grad(x, 2.0, r))


def test_first_power_gradient_is_the_incoming_gradient():
    x = _bases(np.float32)
    grads, got, r = _grad(x, np.array(1.0, np.float32))
    ops = _backward_ops(grads)
    assert ops.count("Mul") == 1 and not {"Pow", "Where"} & set(ops)  # (one Mul: the loss's r)
    _same(got["x_grad"], _torch_scalar_grad(x, 1.0, r))
    np.testing.assert_array_equal(got["x_grad"], r)  # dY·1·x⁰: r, NaN and infinite bases included


def test_integer_typed_exponent_gives_a_float_constant():
    x = _bases(np.float32)
    grads, got, r = _grad(x, np.array([2], np.int64))
    assert "Cast" not in _backward_ops(grads) and "Pow" not in _backward_ops(grads)
    _same(got["x_grad"], _torch_scalar_grad(x, 2.0, r))


@pytest.mark.parametrize("c", [3.0, -1.0, -2.0, 1.5, 0.5, -0.5, 4.0, 64.0])
def test_other_fixed_exponents_against_torch(c):
    """B − 1 a constant; float64 within a few ulp of torch's dY·(c·x^(c−1)) (rounded in another order),
    non-finite exactly where torch's is."""
    x = _bases(np.float64, positive=not float(c).is_integer())
    grads, got, r = _grad(x, np.array(c))
    ops = _backward_ops(grads)
    assert ops.count("Pow") == 1 and "Where" not in ops and "Sub" not in ops
    want = _torch_scalar_grad(x, c, r)
    g = got["x_grad"]
    fin = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(g), fin)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(want))
    np.testing.assert_array_equal(g[~fin & ~np.isnan(want)], want[~fin & ~np.isnan(want)])
    np.testing.assert_allclose(g[fin], want[fin], rtol=1e-14, atol=0)


def test_float16_base_with_a_float32_exponent():
    """The constants take the base's type; values equal torch's float16 gradient up to its rounding of
    2·x (one float16 rounding either way)."""
    x = np.random.default_rng(2).uniform(-4, 4, 64).astype(np.float16)
    grads, got, r = _grad(x, np.array(2.0, np.float32))
    assert "Pow" not in _backward_ops(grads) and "Cast" not in _backward_ops(grads)
    want = _torch_scalar_grad(x, 2.0, r)
    np.testing.assert_array_equal(got["x_grad"], want)


@pytest.mark.parametrize("c", [0.0, 2.25, 65.0])
def test_zero_and_other_exponents_keep_the_run_time_exponent(c):
    """0 (torch's gradient is 0 there; the graph's Where keeps 0·x⁻¹ out), non-half fractions and large
    powers: B − 1 computed in the graph, as before."""
    x = _bases(np.float64, positive=True)[:300] + 0.5
    grads, got, r = _grad(x, np.array(c))
    assert "Where" in _backward_ops(grads)
    np.testing.assert_allclose(got["x_grad"], _torch_scalar_grad(x, c, r), rtol=1e-13)


def test_trained_exponent_is_not_fixed():
    """An exponent being trained is read at run time, and both gradients match torch."""
    x = _bases(np.float64, positive=True)[:300] + 0.5
    grads, got, r = _grad(x, np.array(2.0), trained=True)
    assert "Where" in _backward_ops(grads) and "Pow" in _backward_ops(grads)
    gx, ge = _torch_grad(x, np.array(2.0), r)
    np.testing.assert_allclose(got["x_grad"], gx, rtol=1e-14)
    np.testing.assert_allclose(got["e_grad"], ge, rtol=1e-12)


def test_broadcast_exponent_widening_the_output():
    """A [1, 1] fixed exponent widens Y to [1, n]: the gradient sums back to x's shape."""
    x = _bases(np.float32)[:300]
    grads, got, r = _grad(x, np.full((1, 1), 2.0, np.float32))
    assert r.shape == (1, 300)
    _same(got["x_grad"], _torch_scalar_grad(x[None], 2.0, r)[0])
    x1 = _bases(np.float32)[:300]
    grads, got, r = _grad(x1, np.full((1, 1), 1.0, np.float32))
    np.testing.assert_array_equal(got["x_grad"], r[0])
    assert got["x_grad"].shape == x1.shape
