"""Each rank reads its own shard of the data: contiguous, equal-size splits of a dataset or a batch."""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxtrain.parallel.comm import world


def shard_range(n: int, rank: int | None = None, size: int | None = None,
                drop_remainder: bool = True) -> range:
    """Indices ``[start, stop)`` of rank ``rank``'s contiguous share of ``n`` items.

    With ``drop_remainder`` every rank gets ``n // size`` items (the last ``n % size`` are dropped, so all
    ranks run the same number of steps); otherwise the first ``n % size`` ranks get one more.
    """
    w = world()
    rank = w.rank if rank is None else rank
    size = w.size if size is None else size
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside 0..{size - 1}")
    base, extra = divmod(n, size)
    if drop_remainder:
        return range(rank * base, (rank + 1) * base)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def shard(data: Any, rank: int | None = None, size: int | None = None, drop_remainder: bool = True) -> Any:
    """This rank's contiguous share of ``data`` (an array or a sequence, split along its first axis)."""
    r = shard_range(len(data), rank, size, drop_remainder)
    return data[r.start:r.stop]


def split_batch(batch: np.ndarray, rank: int | None = None, size: int | None = None) -> np.ndarray:
    """This rank's part of one global batch; the batch size must divide by the number of ranks.

    ``D`` ranks stepping on ``split_batch(b)`` compute the same averaged gradient as one process on ``b``.
    """
    w = world()
    size = w.size if size is None else size
    if len(batch) % size:
        raise ValueError(f"a global batch of {len(batch)} does not split evenly over {size} ranks")
    return shard(batch, rank, size)
