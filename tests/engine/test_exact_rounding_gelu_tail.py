"""Gelu's float64 route below x = -3 (exact_kernels.gelu64, erf form): its erfc, computed by numpy over
whole arrays of many tail values, gives the float32 values that libm's double-precision erfc (Python's
``math.erfc``, one value at a time, as the route did before and still does for a few values) gives, on
millions of tail inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from onnxtrain.engine.exact_kernels import erfc_tail, gelu64

_libm_erfc = np.frompyfunc(math.erfc, 1, 1)


def _libm_gelu32(x: np.ndarray) -> np.ndarray:
    """x/2 · erfc(-x/√2) by libm's erfc in float64, rounded to float32 once."""
    x64 = x.astype(np.float64)
    s = _libm_erfc(x64 * -math.sqrt(0.5)).astype(np.float64)
    with np.errstate(invalid="ignore"):  # -inf: 0 · -inf, NaN as the kernel's
        s *= x64
    s *= 0.5
    return s.astype(np.float32)


def test_gelu_tail_rounds_to_libms_float32_values():
    start = np.float32(-3.0).view(np.int32)
    x = np.concatenate([
        (start + np.arange(1, 1_500_001, dtype=np.int32)).view(np.float32),  # every float32 below -3 to -3.5
        np.random.default_rng(3).uniform(-20, -3.5, 1_500_000).astype(np.float32),
        np.float32([-np.inf, -1e30, -30.0, -14.5, -13.0])])
    got = gelu64([x.astype(np.float64)], {"approximate": "none"})[0].astype(np.float32)
    want = _libm_gelu32(x)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    np.testing.assert_array_equal(got, want)
    # a few tail values at a time (libm's erfc, value by value): the same float32 values
    few = np.concatenate([gelu64([part.astype(np.float64)], {"approximate": "none"})[0]
                          for part in np.split(x[-3005:-5], 100)]).astype(np.float32)
    np.testing.assert_array_equal(few, got[-3005:-5])


def test_erfc_tail_is_within_a_few_float64_ulps_of_the_exact_erfc():
    mpmath = pytest.importorskip("mpmath")
    low = 3 / math.sqrt(2)  # x = -3
    z = np.concatenate([np.random.default_rng(4).uniform(low, 11, 2000), [low, 26.0]])
    mpmath.mp.prec = 120
    exact = np.array([float(mpmath.erfc(mpmath.mpf(float(v)))) for v in z])
    ulps = np.abs(erfc_tail(z) - exact) / np.spacing(exact)
    assert ulps.max() <= 4
    assert erfc_tail(np.array([np.inf, 40.0])).tolist() == [0.0, 0.0]
