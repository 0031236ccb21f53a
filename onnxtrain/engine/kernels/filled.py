"""Constant arrays standing in for scalar operands.

numpy's ``maximum`` and ``minimum`` (and so ``clip``) take a slow loop when one operand is a scalar: on
float32, ``np.maximum(x, 0)`` ran 5x slower than ``np.maximum(x, zeros)`` with an array of zeros (10.9 against
2.1 µs for 32 K values). ReLU therefore takes its maximum against an array of zeros, a view of one cached
read-only buffer per (value, dtype) grown to the largest size asked for (zeros are an untouched anonymous
mapping, which takes no resident memory). The ufunc is the same, so the results are the same bits. Erf's
clip to [-4, 4] measured slower as two such passes than as one ``np.clip``, and keeps ``np.clip``.
"""

from __future__ import annotations

import math
import mmap
import threading
from typing import Any

import numpy as np

_buffers: dict[tuple[np.dtype, bytes], np.ndarray] = {}
_lock = threading.Lock()


def filled(value: Any, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A read-only C-contiguous array of ``shape`` and ``dtype`` whose elements are all ``value``."""
    n = math.prod(shape)
    dtype = np.dtype(dtype)
    key = (dtype, np.asarray(value, dtype).tobytes())  # by bits: 0.0 and -0.0 (equal, same hash) differ
    buf = _buffers.get(key)
    if buf is None or buf.size < n:
        with _lock:
            buf = _buffers.get(key)
            if buf is None or buf.size < n:
                size = max(n, 1024)
                plain_zero = value == 0 and not np.signbit(value)  # -0.0 needs its sign bit written
                buf = _zeros(size, dtype) if plain_zero else np.full(size, value, dtype)
                buf.flags.writeable = False
                _buffers[key] = buf
    return buf[:n].reshape(shape)


def _zeros(n: int, dtype: np.dtype) -> np.ndarray:
    """``n`` zeros in an anonymous mapping that is never written: every page reads as the kernel's one
    shared zero page, so the buffer costs no resident memory however large it grows."""
    return np.frombuffer(mmap.mmap(-1, n * dtype.itemsize, flags=mmap.MAP_PRIVATE), dtype, count=n)


def relu_into(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """max(x, 0) with a ufunc's signature (into ``out`` when given)."""
    return np.maximum(x, filled(0, x.dtype, x.shape), out=out)
