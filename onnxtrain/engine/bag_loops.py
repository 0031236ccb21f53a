"""All bags of a bag-pooling Loop (:mod:`onnxtrain.ir.bag_loops`, torch's exported ``nn.EmbeddingBag``) at
once: one gather of the table rows the bags hold, then their reduction row by row for all bags together
(bag sizes are small: as many numpy calls as the largest bag has rows), instead of one body run per bag.
On the exported ``EmbeddingBag(1000, 32, mode="mean")`` over 256 bags of 8 ids: 19 µs per bag → 0.5 µs
(``bench/engine_overhead.py`` (c)).

The results are the loop's, bit for bit: each bag's rows are combined in order, first row first, as the
loop's ReduceSum/ReduceMean/ReduceMax combine them, and a mean divides by the count as ReduceMean does.
The loop runs as written whenever this would not give what it gives: it stops early, the bags do not
follow one another (bag i ending where bag i + 1 starts, as ``EmbeddingBag``'s offsets make them), the
table is not float32/float64, or a bag is large enough for ReduceSum to sum it another way (BLAS).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from onnxtrain.engine.kernels.reduce import BLAS_SUM_MIN
from onnxtrain.ir.bag_loops import BagLoop

MAX_ROWS = 256  # a bag larger than this: the loop runs as written (one numpy call per row position here)
# a bag of one-value rows (an embedding of dimension 1): the loop's ReduceSum/ReduceMean adds along a
# contiguous axis, which numpy sums in eight partial sums from this many values on, not one row after
# another as the pooling adds; such bags run the loop, for its bits
PAIRWISE_MIN = 8


def _bounds(v: np.ndarray, m: int, n: int) -> np.ndarray:
    """The first ``m`` bounds as Slice reads them on an axis of ``n``: negatives count from the end, then
    clamped to [0, n]."""
    b = v[:m].astype(np.int64)
    b = np.where(b < 0, b + n, b)
    return np.clip(b, 0, n)


class BagPooling:
    """The scan output of a bag-pooling Loop, computed without running its body."""

    def __init__(self, bag: BagLoop):
        self.bag = bag
        self.ufunc = np.maximum if bag.reduce == "max" else np.add
        self.last_bytes = 0  # bytes of the gathered rows in the last call (for the plan's peak)

    def __call__(self, trip: Any, cond: Any, captured: Mapping[str, Any]) -> np.ndarray | None:
        """The pooled bags, or None when the loop must run as written."""
        bag = self.bag
        flags = [cond] + ([captured[bag.cond_source]] if bag.cond_source is not None else [])
        for f in flags:
            if f is not None and (np.size(f) != 1 or not bool(np.asarray(f).reshape(-1)[0])):
                return None
        for name, want in bag.checks.items():  # a Slice's axes or steps held outside the body
            v = captured[name]
            if not isinstance(v, np.ndarray) or v.dtype.kind not in "iu" or v.reshape(-1).tolist() != want:
                return None
        s, e, ids, table = (captured[k] for k in (bag.starts, bag.ends, bag.ids, bag.table))
        if not all(isinstance(v, np.ndarray) for v in (trip, s, e, ids, table)) or np.size(trip) != 1:
            return None
        m = int(trip.reshape(-1)[0])
        if (m < 1 or ids.ndim != 1 or s.ndim != 1 or e.ndim != 1 or m > min(s.size, e.size)
                or s.dtype.kind not in "iu" or e.dtype.kind not in "iu" or ids.dtype.kind not in "iu"
                or table.ndim < 1 or table.dtype not in (np.float32, np.float64)):
            return None
        n = ids.size
        s, e = _bounds(s, m, n), _bounds(e, m, n)
        counts = e - s
        if np.any(counts < 0) or np.any(e[:-1] != s[1:]):
            return None
        longest = int(counts.max())
        row = table.shape[1:]
        if longest > MAX_ROWS or bag.reduce == "sum" and longest * int(np.prod(row)) >= BLAS_SUM_MIN:
            return None
        if bag.reduce != "max" and int(np.prod(row)) == 1 and longest >= PAIRWISE_MIN:
            return None  # (see PAIRWISE_MIN)
        rows = np.take(table, ids[s[0]:e[-1]], axis=0)  # out-of-range ids fail as the loop's Gather does
        self.last_bytes = rows.nbytes
        at = s - s[0]
        full = counts > 0
        out = np.zeros((m, *row), table.dtype)
        if bag.reduce == "max":
            out[~full] = -np.inf  # ReduceMax of an empty set
        out[full] = rows[at[full]]
        for j in range(1, longest):  # each bag's next row, in order, into all bags that have one
            more = counts > j
            if more.all():
                self.ufunc(out, rows[at + j], out=out)
            else:
                out[more] = self.ufunc(out[more], rows[at[more] + j])
        if bag.reduce == "mean":
            with np.errstate(invalid="ignore", divide="ignore"):  # an empty bag: 0 / 0, NaN as in the loop
                out /= counts.astype(table.dtype).reshape(-1, *(1,) * len(row))
        return out
