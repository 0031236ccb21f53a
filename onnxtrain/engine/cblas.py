"""GEMMs that add into their output: numpy's own OpenBLAS called with beta = 1.

numpy computes a sum of products (a convolution as one product per kernel offset) as a product written to
scratch and a second pass adding it to the output; BLAS adds each product as it writes it (C = A·B + C).
ResNet's 3×3 convolutions at batch 32, their nine products alone (ms, medians): 16 channels at 32² 3.96 →
1.27, 32 at 16² 1.75 → 1.21, 64 at 8² 1.61 → 1.35, the same values. The library numpy loaded and its
``cblas_?gemm`` are found once (``scipy_cblas_sgemm64_`` in numpy's wheels: OpenBLAS with 64-bit integers,
which its configuration string says); with another BLAS, :func:`gemm` runs numpy's product and add.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import numpy as np

from onnxtrain.engine.blas import openblas_symbols

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
# (single, double, configuration) symbol names, and whether the names alone say the integers are 64-bit
_NAMES = (
    ("scipy_cblas_sgemm64_", "scipy_cblas_dgemm64_", "scipy_openblas_get_config64_"),
    ("cblas_sgemm64_", "cblas_dgemm64_", "openblas_get_config64_"),
    ("scipy_cblas_sgemm", "scipy_cblas_dgemm", "scipy_openblas_get_config"),
    ("cblas_sgemm", "cblas_dgemm", "openblas_get_config"),
)


@functools.cache
def _functions() -> dict[np.dtype, Callable[..., None]] | None:
    """dtype → numpy's OpenBLAS ``cblas_?gemm`` with its argument types set; None when not found."""
    for (single, _, _), (fs, fd, fc) in openblas_symbols(_NAMES):
        fc.restype = ctypes.c_char_p
        wide = b"USE64BITINT" in (fc() or b"")
        if single.endswith("64_") != wide:  # a build whose names and integers disagree: leave it
            continue
        n = ctypes.c_int64 if wide else ctypes.c_int
        p = ctypes.c_void_p
        for f, real in ((fs, ctypes.c_float), (fd, ctypes.c_double)):
            f.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, n, n, n, real, p, n, p, n, real, p, n]
            f.restype = None
        return {np.dtype(np.float32): fs, np.dtype(np.float64): fd}
    return None


def _layout(m: np.ndarray) -> tuple[int, int] | None:
    """(transpose flag, leading dimension) of a 2-D array for a row-major BLAS call, or None when neither
    its rows nor its columns are contiguous."""
    it = m.itemsize
    r, c = m.strides
    if c == it and r % it == 0 and r // it >= max(m.shape[1], 1):
        return _NO_TRANS, r // it
    if r == it and c % it == 0 and c // it >= max(m.shape[0], 1):
        return _TRANS, c // it
    return None


def gemm(a: np.ndarray, b: np.ndarray, out: np.ndarray, accumulate: bool = False) -> np.ndarray:
    """``out = a @ b``, or ``out += a @ b`` with ``accumulate``, for 2-D float32/64 arrays of one dtype
    (``a`` and ``b`` may be transposed views; ``out``'s rows contiguous); by BLAS where it can, else by
    numpy. Returns ``out``."""
    fns = _functions()
    f = fns.get(out.dtype) if fns is not None else None
    la, lb, lc = _layout(a), _layout(b), _layout(out)
    ok = (f is not None and a.dtype == b.dtype == out.dtype and a.ndim == b.ndim == out.ndim == 2
          and la is not None and lb is not None and lc is not None and lc[0] == _NO_TRANS
          and a.shape[1] == b.shape[0] and out.shape == (a.shape[0], b.shape[1]) and min(a.shape + b.shape)
          and out.flags.writeable and not np.may_share_memory(out, a) and not np.may_share_memory(out, b))
    if not ok:
        if accumulate:
            out += a @ b
        else:
            np.matmul(a, b, out=out)
        return out
    m, k = a.shape
    n = b.shape[1]
    f(_ROW_MAJOR, la[0], lb[0], m, n, k, 1.0, a.ctypes.data, la[1], b.ctypes.data, lb[1],
      1.0 if accumulate else 0.0, out.ctypes.data, lc[1])
    return out
