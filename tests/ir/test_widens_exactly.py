"""ir.types.widens_exactly against every bit pattern: a float type widens exactly into another when each of
its values (but NaN, whose payload may change) survives the cast there and back unchanged."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from onnxtrain.ir.types import widens_exactly

SMALL = [np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz,
         ml_dtypes.float8_e5m2, ml_dtypes.float8_e5m2fnuz]
ALL = [*SMALL, np.float32, np.float64]


def _round_trips(src: type, dst: type) -> bool:
    bits = np.arange(2 ** (8 * np.dtype(src).itemsize), dtype=np.uint16 if np.dtype(src).itemsize == 2
                     else np.uint8)
    values = bits.view(src)
    with np.errstate(invalid="ignore", over="ignore"):  # (inf or NaN into a type without them)
        back = values.astype(dst).astype(src)
    keep = ~np.isnan(values.astype(np.float32))
    return bool(np.array_equal(back[keep].view(bits.dtype), bits[keep]))


@pytest.mark.parametrize(("src", "dst"), [(s, d) for s, d in itertools.product(SMALL, ALL) if s is not d],
                         ids=lambda t: np.dtype(t).name)
def test_small_float_types_against_their_bit_patterns(src: type, dst: type) -> None:
    assert widens_exactly(src, dst) == _round_trips(src, dst)


def test_wider_standard_types_and_non_floats() -> None:
    assert widens_exactly(np.float32, np.float64) and not widens_exactly(np.float64, np.float32)
    assert not widens_exactly(np.float32, np.float16) and not widens_exactly(np.float32, ml_dtypes.bfloat16)
    for other in (np.int8, np.int32, np.bool_, np.complex64, np.dtype([("a", np.float32)])):
        assert not widens_exactly(other, np.float64) and not widens_exactly(np.float32, other)
