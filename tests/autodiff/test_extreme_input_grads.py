"""Gradients at extreme inputs against torch float64: float16 MeanVarianceNormalization (std 60), LRN
(X ≈ 1000) and LpNormalization (norm past 65504), computed in float32 (float16 overflowed: dX 0 or 45% off);
Elu/Selu/Celu far on the negative side (from the output, dY·(Y + α) cancelled: dX 0 from X ≈ −17 in
float32, from X ≈ −9 in float16). Each test also checks ordinary inputs in float32 and float16."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.ir.builder import make_model
from onnxtrain.testing import run_engine

torch = pytest.importorskip("torch")
F = torch.nn.functional

Ref = Callable[["torch.Tensor"], "torch.Tensor"]
Cases = list[tuple[np.ndarray, np.ndarray]]


def _grad(op: str, x: np.ndarray, dy: np.ndarray, opset: int = 18, **attrs) -> np.ndarray:
    """dX of one ``op`` node at ``x`` for the upstream gradient ``dy``; the gradient graph checked (full
    check, standard ONNX ops only)."""
    et = helper.np_dtype_to_tensor_dtype(x.dtype)
    graph = helper.make_graph(
        [helper.make_node(op, ["X"], ["Y"], **attrs)],
        op,
        [helper.make_tensor_value_info("X", et, x.shape)],
        [helper.make_tensor_value_info("Y", et, x.shape)],
    )
    gm = build_gradient_model(make_model(graph, opset), "Y", ["X"], seed_loss=False)
    onnx.checker.check_model(_forward_as_identity(gm) if op == "MeanVarianceNormalization" else gm,
                             full_check=True)
    assert {n.domain for n in gm.graph.node} <= {"", "ai.onnx"}
    got = dict(zip([o.name for o in gm.graph.output], run_engine(gm, {"X": x, "Y_grad": dy})))
    assert got["X_grad"].dtype == x.dtype
    return got["X_grad"]


def _forward_as_identity(gm: onnx.ModelProto) -> onnx.ModelProto:
    """``gm`` with its forward node made an Identity of X: ONNX's MVN function body has a float32 epsilon,
    so a float16 MVN node fails the full check itself (the gradient reads X only)."""
    out = onnx.ModelProto()
    out.CopyFrom(gm)
    fwd = next(n for n in out.graph.node if list(n.output) == ["Y"])
    fwd.op_type = "Identity"
    del fwd.attribute[:]
    return out


def _ref(fn: Ref, x: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """torch float64's dX of ``fn`` at ``x`` for ``dy``."""
    t = torch.tensor(x.astype(np.float64), requires_grad=True)
    fn(t).backward(torch.tensor(dy.astype(np.float64)))
    return t.grad.numpy()


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got − want| / max |want|."""
    return float(np.abs(got.astype(np.float64) - want).max() / np.abs(want).max())


_NORM_TOL = {np.float32: 1e-5, np.float16: 4e-3}


def _norm_cases(extreme: np.ndarray, shape: tuple[int, ...], seed: int) -> Cases:
    """(x, dY): the extreme float16 input, then ordinary ones (standard normal) in float32 and float16."""
    rng = np.random.default_rng(seed)
    cases = [(extreme, rng.standard_normal(extreme.shape).astype(np.float16))]
    for dt in (np.float32, np.float16):
        cases.append((rng.standard_normal(shape).astype(dt), rng.standard_normal(shape).astype(dt)))
    return cases


def _check_norm(op: str, fn: Ref, cases: Cases, **attrs) -> None:
    errs = []
    for x, dy in cases:
        err = _rel_err(_grad(op, x, dy, **attrs), _ref(fn, x, dy))
        if not err <= _NORM_TOL[x.dtype.type]:
            errs.append(f"{x.dtype} max|x| {np.abs(x).max():g}: error {err:.2e}")
    assert not errs, f"{op} {attrs}: " + "; ".join(errs)


def _mvn(t: torch.Tensor) -> torch.Tensor:
    d = t - t.mean(dim=(0, 2, 3), keepdim=True)
    return d / (torch.sqrt((d * d).mean(dim=(0, 2, 3), keepdim=True)) + 1e-9)


def test_mvn_grad_float16_large_std() -> None:
    # before: 4.5e-1 at std 60 (s·(s + ε)² overflowed float16); torch float16 1.1e-3
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((2, 3, 4, 4)) * 60).astype(np.float16)
    cases = _norm_cases(x, (2, 3, 4, 4), 1)
    cases.append(((rng.standard_normal((2, 3, 4, 4)) * 300).astype(np.float16), cases[0][1]))
    _check_norm("MeanVarianceNormalization", _mvn, cases, axes=[0, 2, 3])


@pytest.mark.parametrize("size", [3, 5])
def test_lrn_grad_float16_large_inputs(size: int) -> None:
    # before: dX 0 everywhere at X ≈ 1000 (the window sums of X² overflowed float16)
    x = (1000 + np.random.default_rng(0).standard_normal((1, 6, 2, 2))).astype(np.float16)
    attrs = {"size": size, "alpha": 1e-4, "beta": 0.75, "bias": 1.0}
    _check_norm("LRN", lambda t: F.local_response_norm(t, size, alpha=1e-4, beta=0.75, k=1.0),
                _norm_cases(x, (2, 7, 3, 2), 2), **attrs)


@pytest.mark.parametrize("p", [1, 2])
def test_lp_norm_grad_float16_large_norm(p: int) -> None:
    # before: dX 0 everywhere (the float16 norm, 7.2e4 for p=2 and 1.6e5 for p=1, was inf)
    x = np.array([[30000, -25000, 40000, 1000, -3, 20000, 5, -35000]], np.float16)
    dy = np.array([[1000, -2000, 500, 3000, 1000, -1000, 2000, 250]], np.float16)
    cases = [(x, dy), *_norm_cases(x, (3, 4, 5), 3)[1:]]
    _check_norm("LpNormalization", lambda t: t / torch.linalg.vector_norm(t, p, dim=-1, keepdim=True),
                cases, axis=-1, p=p)


# ---------------------------------------------------------------- Elu, Selu, Celu

_FAR = {np.float32: [-5, -9, -12, -17, -20, -40, -80, -200], np.float16: [-5, -7, -9, -9.5]}
_TOL = {np.float32: (4e-6, 1e-44), np.float16: (2e-3, 1.2e-7)}  # rtol, atol (float16's subnormal ulp: 6e-8)
_EXP_LINEAR = [
    ("Elu", {}, F.elu),
    ("Elu", {"alpha": 0.7}, lambda t: F.elu(t, 0.7)),
    ("Selu", {}, F.selu),
    ("Celu", {}, F.celu),
    ("Celu", {"alpha": 0.5}, lambda t: F.celu(t, 0.5)),
    ("Celu", {"alpha": 2.0}, lambda t: F.celu(t, 2.0)),
]


_EXP_CASES = [(*c, dt) for dt in (np.float32, np.float16) for c in _EXP_LINEAR
              if c[0] != "Celu" or dt == np.float32]  # Celu's schema admits float32 only


@pytest.mark.parametrize("op,attrs,fn,dtype", _EXP_CASES,
                         ids=[f"{c[0]}{c[1]}-{c[3].__name__}" for c in _EXP_CASES])
def test_exp_linear_grad_far_negative(op: str, attrs: dict, fn: Ref, dtype: type) -> None:
    # before (float32): 0 from X = −20 where torch gives 2e-9 … 1.8e-35, 2.5e-4 relative off at −9;
    # (float16) 0 at −9, where torch gives 1.2e-4
    ordinary = np.random.default_rng(4).uniform(-4, 4, 40)
    x = np.concatenate([_FAR[dtype], ordinary, [0, -0.0, 1e-3, -1e-3, 3, 50, -np.inf, np.inf]]).astype(dtype)
    dy = np.random.default_rng(5).uniform(0.5, 2, x.shape).astype(dtype)
    got = _grad(op, x, dy, **attrs)
    want = _ref(fn, x, dy)
    rtol, atol = _TOL[dtype]
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol, atol=atol)
    assert np.all(np.isfinite(got))
    pos = x > 0  # γ·dY exactly, as torch
    gamma = np.float32(attrs.get("gamma", 1.0507009873554805 if op == "Selu" else 1.0)).astype(dtype)
    np.testing.assert_array_equal(got[pos], dy[pos] * gamma)


@pytest.mark.parametrize("op", ["Elu", "Selu", "Celu"])
def test_exp_linear_grad_of_a_nan_input_is_the_linear_sides(op: str) -> None:
    # a NaN input takes the linear side, gamma·dY, as torch's elu_backward (onnxruntime-training gives NaN)
    x = np.array([np.nan, -30, -1, 0, 2], np.float32)
    got = _grad(op, x, np.ones_like(x))
    gamma = np.float32(1.0507009873554805 if op == "Selu" else 1.0)
    assert got[0] == gamma and np.all(np.isfinite(got[1:])) and got[1] > 0
