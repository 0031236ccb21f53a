"""Row-major copies of transposed views by OpenBLAS's out-of-place matrix transpose (``cblas_?omatcopy``).

numpy copies a view whose innermost axis is not the memory's innermost (a Transpose that moves the last
axis: ``perm=(0, 2, 1)``, NCHW → NHWC) one element at a time along a strided axis: 1.2 ms for a (32768, 32)
float32 matrix, 13.7 ms for (4096, 1000). OpenBLAS's omatcopy transposes in cache-sized tiles: 0.37 and 3.8
ms (2 cores, one thread). :func:`contiguous` takes that path for a view that swaps two blocks of axes of a
row-major array (with a common leading block: one call per index of it), float32 or float64, and numpy's copy
otherwise. The values are copied exactly (a product by 1.0, which leaves every finite value, infinity and
signed zero as it is; a signalling NaN comes out quiet).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import numpy as np

from onnxtrain.engine.blas import openblas_symbols

_ROW_MAJOR, _TRANS = 101, 112
# (single, double) names; a "64_" suffix says the integers are 64-bit (as cblas.py's GEMMs)
_NAMES = (("scipy_cblas_somatcopy64_", "scipy_cblas_domatcopy64_"),
          ("cblas_somatcopy64_", "cblas_domatcopy64_"),
          ("scipy_cblas_somatcopy", "scipy_cblas_domatcopy"),
          ("cblas_somatcopy", "cblas_domatcopy"))
# numpy / omatcopy time (float32, about 4 M values in all; rows × columns of each transpose's output): below
# 8 K values a transpose numpy's copy is faster (16 × 256 0.73, 64 × 64 0.83, 256 × 16 0.56), above it
# omatcopy (16 × 1024 1.56, 256 × 64 1.28, 4096 × 4096 4.6), except with fewer than 128 columns (3136 × 64,
# NCHW → NHWC at 56²: 0.83–1.05; 3200 × 64 0.89) unless the rows are a multiple of 256, where numpy's strided
# reads alias in the cache (4096 × 64 3.6, 3072 × 64 2.8, 1024 × 16 1.9–2.0)
MIN_VALUES = 1 << 13
MIN_COLUMNS = 128
ALIASED_ROWS = 256


@functools.cache
def _functions() -> dict[np.dtype, Callable[..., None]] | None:
    """dtype → numpy's OpenBLAS ``cblas_?omatcopy`` with its argument types set; None when not found."""
    for (single, _), (fs, fd) in openblas_symbols(_NAMES):
        n = ctypes.c_int64 if single.endswith("64_") else ctypes.c_int
        p = ctypes.c_void_p
        for f, real in ((fs, ctypes.c_float), (fd, ctypes.c_double)):
            f.argtypes = [ctypes.c_int, ctypes.c_int, n, n, real, p, n, p, n]
            f.restype = None
        return {np.dtype(np.float32): fs, np.dtype(np.float64): fd}
    return None


def _block_swap(a: np.ndarray) -> tuple[int, int, int] | None:
    """(lead, rows, cols) when ``a`` reads a row-major buffer laid (lead, cols, rows) as (lead, rows, cols):
    its axes are a leading block in memory order, then a block whose memory is inner to the last block's.
    None for any other layout (or an empty or contiguous array)."""
    if a.ndim < 2 or a.size == 0 or a.flags.c_contiguous:
        return None
    it = a.itemsize
    dims = [(s, d) for s, d in zip(a.strides, a.shape, strict=True) if d != 1]
    if len(dims) < 2:
        return None
    # memory order: strides descending; the buffer must be dense in it
    order = sorted(range(len(dims)), key=lambda i: -dims[i][0])
    expect = it
    for i in reversed(order):
        s, d = dims[i]
        if s != expect:
            return None
        expect *= d
    # logical axes = lead + X + Y, memory = lead + Y + X (each block in its own order)
    k = 0
    while k < len(dims) and order[k] == k:
        k += 1
    rest = order[k:]
    for split in range(1, len(rest)):
        y, x = rest[:split], rest[split:]
        if y == list(range(k + len(x), len(dims))) and x == list(range(k, k + len(x))):
            lead = int(np.prod([d for _, d in dims[:k]], dtype=np.int64))
            rows = int(np.prod([dims[i][1] for i in x], dtype=np.int64))
            cols = int(np.prod([dims[i][1] for i in y], dtype=np.int64))
            return lead, rows, cols
    return None


def contiguous(a: np.ndarray) -> np.ndarray:
    """A row-major copy of ``a`` (``a`` itself when it is row-major already); see the module docstring."""
    if a.flags.c_contiguous:
        return a
    fns = _functions()
    f = fns.get(a.dtype) if fns is not None else None
    shape = None if f is None else _block_swap(a)
    if shape is None:
        return np.ascontiguousarray(a)
    lead, rows, cols = shape
    if rows * cols < MIN_VALUES or (cols < MIN_COLUMNS and rows % ALIASED_ROWS):
        return np.ascontiguousarray(a)
    out = np.empty(a.shape, a.dtype)
    # the buffer a reads starts at a's lowest address: a's first element (no axis runs backwards)
    src, dst, step = a.ctypes.data, out.ctypes.data, rows * cols * a.itemsize
    for b in range(lead):  # source (cols × rows) row-major → (rows × cols) row-major
        f(_ROW_MAJOR, _TRANS, cols, rows, 1.0, src + b * step, rows, dst + b * step, cols)
    return out
