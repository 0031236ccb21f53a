"""Each rank reads its own shard of the data: contiguous, equal-size splits of a dataset or a batch."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from onnxtrain.parallel.comm import world


def shard_range(n: int, rank: int | None = None, size: int | None = None,
                drop_remainder: bool = True) -> range:
    """Indices ``[start, stop)`` of rank ``rank``'s contiguous share of ``n`` items.

    With ``drop_remainder`` every rank gets ``n // size`` items (the last ``n % size`` are dropped, so all
    ranks run the same number of steps); otherwise the first ``n % size`` ranks get one more (for an
    evaluation weighted by part: a training step weighs every rank's gradient 1/size whatever its part's
    size).
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


def _each(data: Any, part: Callable[[Any], Any], what: str) -> Any:
    """``part`` of each array of a tuple or dict of arrays of one length (kept a tuple, namedtuple or dict),
    or of ``data`` itself."""
    if not isinstance(data, (tuple, Mapping)):
        return part(data)
    items = list(data.items()) if isinstance(data, Mapping) else list(enumerate(data))
    lengths = {k: len(v) for k, v in items}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{what}: the arrays differ in length: {lengths}")
    parts = [(k, part(v)) for k, v in items]
    if isinstance(data, Mapping):
        return dict(parts)
    values = [v for _, v in parts]
    return type(data)(*values) if hasattr(data, "_fields") else type(data)(values)  # a namedtuple


def shard(data: Any, rank: int | None = None, size: int | None = None, drop_remainder: bool = True) -> Any:
    """This rank's contiguous share of ``data``: an array or a list, split along its first axis, or a tuple or
    dict of arrays of one length (``x, y = shard((x, y))``), each split the same way, as :func:`split_batch`
    takes them."""

    def part(a: Any) -> Any:
        r = shard_range(len(a), rank, size, drop_remainder)
        return a[r.start:r.stop]

    return _each(data, part, "shard")


def split_batch(batch: Any, rank: int | None = None, size: int | None = None) -> Any:
    """This rank's part of one global batch (an array, or a tuple or dict of arrays of one length, each
    split the same way: ``xb, yb = split_batch((x, y))``; a list is a sequence of samples, split as one);
    the batch size must divide by the number of ranks.

    ``D`` ranks stepping on ``split_batch(b)`` compute the same averaged gradient as one process on ``b``.
    """
    w = world()
    size = w.size if size is None else size

    def part(a: Any) -> Any:
        if len(a) % size:
            raise ValueError(f"a global batch of {len(a)} does not split evenly over {size} ranks")
        return shard(a, rank, size)

    return _each(batch, part, "split_batch")
