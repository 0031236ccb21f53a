"""engine/cblas.py: GEMMs that add into their output, by numpy's own OpenBLAS, against numpy."""

from __future__ import annotations

import numpy as np
import pytest

from onnxtrain.engine import cblas

_rng = np.random.default_rng(4)


def _blas_calls(monkeypatch) -> list[int]:
    """Counts the calls that reach BLAS (the function table wrapped)."""
    calls: list[int] = []
    table = cblas._functions()
    if table is None:
        pytest.skip("numpy's BLAS here is not an OpenBLAS with cblas_?gemm")
    wrapped = {dt: (lambda *a, f=f: calls.append(1) or f(*a)) for dt, f in table.items()}
    monkeypatch.setattr(cblas, "_functions", lambda: wrapped)
    return calls


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", ["plain", "a transposed", "b transposed", "views"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_matches_numpy(dtype, layout: str, accumulate: bool, monkeypatch) -> None:
    calls = _blas_calls(monkeypatch)
    big = _rng.standard_normal((60, 70)).astype(dtype)
    a, b = _rng.standard_normal((13, 29)).astype(dtype), _rng.standard_normal((29, 17)).astype(dtype)
    if layout == "a transposed":
        a = np.ascontiguousarray(a.T).T
    elif layout == "b transposed":
        b = np.ascontiguousarray(b.T).T
    elif layout == "views":  # rows of a larger array, as the shifted convolution's operands are
        a, b = big[3:16, 5:34], big[20:49, 40:57]
    start = _rng.standard_normal((13, 17)).astype(dtype)
    out = start.copy()
    cblas.gemm(a, b, out, accumulate=accumulate)
    want = (start if accumulate else 0) + a.astype(np.float64) @ b.astype(np.float64)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol)
    assert calls == [1]


def test_gemm_falls_back_to_numpy_where_blas_cannot_take_it(monkeypatch) -> None:
    calls = _blas_calls(monkeypatch)
    a = _rng.standard_normal((8, 6)).astype(np.float32)
    b = _rng.standard_normal((6, 5)).astype(np.float32)
    cases = [
        (a, b.astype(np.float64), np.zeros((8, 5), np.float64)),  # mixed dtypes
        (a[:, ::2], b[::2], np.zeros((8, 5), np.float32)),  # neither rows nor columns contiguous
        (a, b, np.zeros((5, 8), np.float32).T),  # out's rows not contiguous
        (a.astype(np.int64), b.astype(np.int64), np.zeros((8, 5), np.int64)),  # not float
    ]
    for x, y, out in cases:
        np.testing.assert_allclose(cblas.gemm(x, y, out, accumulate=True), x @ y, rtol=1e-6)
    shared = np.zeros((8, 8), np.float32)  # out overlapping an operand
    shared[:, :6] = a
    cblas.gemm(shared[:, :6], b[:, :2], shared[:, 6:], accumulate=True)
    np.testing.assert_allclose(shared[:, 6:], a @ b[:, :2], rtol=1e-6)
    assert calls == []
