"""``split_batch``: each rank's part of a global batch, for an array or a batch of several arrays."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from onnxtrain.parallel import shard, split_batch


def test_a_batch_of_several_arrays_is_split_array_by_array() -> None:
    """``xb, yb = split_batch((x, y))`` gives each rank its rows of both (before, the tuple itself was split:
    rank 0 got ``(x,)`` and rank 1 ``(y,)``); a dict and a namedtuple keep their kind."""
    x, y = np.arange(12).reshape(6, 2), np.arange(6) * 10
    Batch = collections.namedtuple("Batch", "x y")
    for rank in range(3):
        rows = slice(2 * rank, 2 * rank + 2)
        xb, yb = split_batch((x, y), rank, 3)
        np.testing.assert_array_equal(xb, x[rows])
        np.testing.assert_array_equal(yb, y[rows])
        d = split_batch({"x": x, "y": y}, rank, 3)
        assert list(d) == ["x", "y"]
        np.testing.assert_array_equal(d["y"], y[rows])
        nt = split_batch(Batch(x, y), rank, 3)
        assert isinstance(nt, Batch)
        np.testing.assert_array_equal(nt.x, x[rows])
    # the parts put back together are the batch
    np.testing.assert_array_equal(np.concatenate([split_batch((x, y), r, 2)[0] for r in range(2)]), x)


def test_arrays_of_different_lengths_or_an_uneven_batch_are_refused() -> None:
    x = np.zeros((4, 2))
    with pytest.raises(ValueError, match=r"split_batch: the arrays differ in length: \{0: 4, 1: 3\}"):
        split_batch((x, np.zeros(3)), 0, 2)
    with pytest.raises(ValueError, match="a global batch of 4 does not split evenly over 3 ranks"):
        split_batch((x, np.zeros(4)), 0, 3)
    assert split_batch(x, 0, 1) is not None and split_batch(x, 0, 1).shape == (4, 2)  # one process: whole


def test_shard_splits_a_dataset_of_several_arrays_array_by_array() -> None:
    """``x, y = shard((x, y))`` gives each rank its rows of both, as split_batch does (the tuple itself was
    sharded: rank 0 got ``(x,)``, and a dict raised "unhashable type: 'slice'"); uneven sizes drop the
    remainder or spread it, as for one array."""
    x, y = np.arange(14).reshape(7, 2), np.arange(7) * 10
    for rank in range(2):
        xs, ys = shard((x, y), rank, 2)
        np.testing.assert_array_equal(xs, x[3 * rank:3 * rank + 3])
        np.testing.assert_array_equal(ys, y[3 * rank:3 * rank + 3])
        d = shard({"x": x, "y": y}, rank, 2, drop_remainder=False)
        rows = slice(0, 4) if rank == 0 else slice(4, 7)
        np.testing.assert_array_equal(d["x"], x[rows])
        np.testing.assert_array_equal(d["y"], y[rows])
    assert shard(list(range(5)), 1, 2) == [2, 3]  # a list: samples
    with pytest.raises(ValueError, match="shard: the arrays differ in length"):
        shard((x, y[:3]), 0, 2)
