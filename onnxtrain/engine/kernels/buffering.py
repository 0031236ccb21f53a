"""numpy's ufunc buffer kept out of operands broadcast along rows of a few hundred to a few thousand values.

numpy 2 runs a ufunc whose operand is broadcast along a run of ``r`` values (an (N, 1) column against (N, C)
scores, a (D,) vector against (N, D) rows) through its buffer whenever the buffer (8,192 values) holds two
runs or more: it copies the runs into the buffer to call the inner loop on longer pieces, and the copies cost
more than the calls they save. With the buffer cut to at most one run, numpy walks the runs in place. One
float32 subtract of an (N, 1) column over 1 M values (AMD EPYC, numpy 2.4): r = 384 229 → 176 µs, 512 229 →
156, 1,000 232 → 134, 3,000 221 → 114; below about 320 values the buffer wins (96: 254 → 451). Same ufunc
loops on the same values: the same bits.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

MIN_RUN = 384  # shorter runs go faster through the buffer
MAX_RUN = 4096  # longer runs: the default buffer holds fewer than two, so numpy already walks them in place
MIN_VALUES = 1 << 17  # smaller results: the two buffer-size calls (about 3.5 µs) cost more than they save


def broadcast_run(shapes: tuple[tuple[int, ...], ...], result: tuple[int, ...]) -> int:
    """The values of the innermost run along which no operand of ``shapes`` changes between being
    broadcast and not (the length of numpy's inner loop over C-contiguous operands), or 0 when no operand
    is broadcast along the last axis's run (then there is nothing to keep out of the buffer)."""
    nd = len(result)
    padded = [(1,) * (nd - len(s)) + tuple(s) for s in shapes]
    if all(p == tuple(result) for p in padded):
        return 0
    run, axis = 1, nd - 1
    pattern = None
    while axis >= 0:
        if result[axis] == 1:
            axis -= 1
            continue
        here = tuple(p[axis] == 1 for p in padded)
        if pattern is None:
            pattern = here
        elif here != pattern:
            break
        run *= result[axis]
        axis -= 1
    return run if axis >= 0 else 0


def run_size(run: int, values: int) -> int:
    """The buffer size for ufuncs walking runs of ``run`` values (``values`` in all): one run rounded down to
    a multiple of 16 (numpy's rule) when the runs are long enough to walk in place and the result large
    enough to pay for the switch, else 0 (numpy's size left as it is)."""
    return run - run % 16 if MIN_RUN <= run <= MAX_RUN and values >= MIN_VALUES else 0


def broadcast_size(shapes: tuple[tuple[int, ...], ...], result: tuple[int, ...], values: int) -> int:
    """The buffer size (values) to run a ufunc of operands ``shapes`` and result ``result`` (``values``
    values) with, or 0 to leave numpy's as it is."""
    if values < MIN_VALUES:
        return 0
    return run_size(broadcast_run(shapes, result), values)


def call_with_buffer(size: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with numpy's ufunc buffer cut to ``size`` values (0: as it is), given back
    after; the error handling stays as the caller set it."""
    if not size:
        return fn(*args, **kwargs)
    with np.errstate():  # (which restores the buffer size)
        np.setbufsize(size)
        return fn(*args, **kwargs)


class UnbufferedUfunc:
    """A ufunc called with numpy's buffer cut to ``size`` values (a cluster's op; :func:`broadcast_size`)."""

    __slots__ = ("ufunc", "size")

    def __init__(self, ufunc: Any, size: int) -> None:
        self.ufunc = ufunc
        self.size = size

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return call_with_buffer(self.size, self.ufunc, *args, **kwargs)


def binary_size(a: Any, b: Any) -> int:
    """:func:`broadcast_size` for a ufunc of the two operands ``a`` and ``b``."""
    if (type(a) is not np.ndarray or type(b) is not np.ndarray or a.shape == b.shape
            or max(a.size, b.size) < MIN_VALUES):
        return 0
    shape = np.broadcast_shapes(a.shape, b.shape)
    return broadcast_size((a.shape, b.shape), shape, math.prod(shape))
