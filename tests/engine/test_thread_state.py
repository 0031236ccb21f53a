"""thread_state.bound: a per-thread setting for a block, put back after it (nested, on an error, per thread);
and affinity.placed without a placement to make is the same no-op every time."""

from __future__ import annotations

import threading

import pytest

from onnxtrain.engine import affinity
from onnxtrain.engine.thread_state import bound


def test_bound_sets_and_restores_nested_and_on_errors() -> None:
    local = threading.local()
    with bound(local, "width", 4, 1):
        assert local.width == 4
        with bound(local, "width", 2, 1):
            assert local.width == 2
        assert local.width == 4
        with pytest.raises(RuntimeError), bound(local, "width", 8, 1):
            assert local.width == 8
            raise RuntimeError("boom")
        assert local.width == 4
    assert local.width == 1  # unset before: the default


def test_bound_is_per_thread() -> None:
    local = threading.local()
    seen: list[object] = []
    with bound(local, "slots", "main"):
        t = threading.Thread(target=lambda: seen.append(getattr(local, "slots", None)))
        t.start()
        t.join()
        assert local.slots == "main"
    assert seen == [None]


def test_placed_without_a_placement_is_one_shared_no_op() -> None:
    assert affinity.placed(1) is affinity.placed(1)
    with affinity.placed(1):
        pass
