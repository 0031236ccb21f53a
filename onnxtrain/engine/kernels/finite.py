"""The finiteness test of the fast paths whose zero products (a padding, a band, a weight of 0) spread an
inf or NaN of their operands to outputs that do not depend on it (inf · 0 = NaN): such a path's result is
checked, and a non-finite one is recomputed by a path that forms only the products the op defines."""

from __future__ import annotations

import numpy as np

_BLAS_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def all_finite(y: np.ndarray) -> bool:
    """True when every value of ``y`` is finite. In float32 and float64 one dot product (a few % of the paths
    that call it), False too where a sum of squares of finite values overflows (from about 1e19 / √size in
    float32), which only costs the caller its slower path to the same values; other dtypes (float16's
    squares overflow from 256) test each value."""
    if y.dtype not in _BLAS_DTYPES or not (y.flags.c_contiguous or y.flags.f_contiguous):
        return bool(np.isfinite(y).all())  # (without the copy a reshape would make of a strided y)
    v = (y if y.flags.c_contiguous else y.T).reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(np.dot(v, v)))
