"""Ctrl-C while a session is being built: the build pauses Python's cyclic garbage collector
(``onnxtrain.ir.builder.gc_paused``) and must give it back however it ends. A SIGINT that landed as the
pause was being recorded or undone left the collector off for the rest of the process (every reference
cycle made afterwards leaked: found by a loop of builds under random SIGINTs, about once in 5,000)."""

from __future__ import annotations

import gc
import signal
import weakref

import numpy as np
import pytest

from onnxtrain import InferenceSession, TrainingSession
from onnxtrain.ir import builder
from tests.session.helpers import batches, mlp_model, params


class _SigintAt:
    """Stands for the builder's lock and sends this process SIGINT at its ``at``-th use: an ``__enter__``
    (before the lock is taken) or an ``__exit__`` (after it is let go), counted together from 0."""

    def __init__(self, lock, at: int) -> None:
        self.lock, self.at, self.calls = lock, at, 0

    def _tick(self) -> None:
        self.calls += 1
        if self.calls - 1 == self.at:
            signal.raise_signal(signal.SIGINT)  # Python's handler raises KeyboardInterrupt right after

    def __enter__(self):
        self._tick()
        return self.lock.__enter__()

    def __exit__(self, *exc):
        self.lock.__exit__(*exc)
        self._tick()


def _build(kind: str):
    model = mlp_model().SerializeToString()
    if kind == "inference":
        return InferenceSession(model)
    return TrainingSession(model, params("AdamOptimizer"))


def _lock_uses(kind: str, monkeypatch) -> int:
    counter = _SigintAt(builder._GC_LOCK, -1)
    monkeypatch.setattr(builder, "_GC_LOCK", counter)
    _build(kind)
    monkeypatch.setattr(builder, "_GC_LOCK", counter.lock)
    return counter.calls


@pytest.fixture
def default_sigint():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("kind", ["inference", "training"])
@pytest.mark.parametrize("collector_on", [True, False])
def test_a_build_cut_by_ctrl_c_gives_the_collector_back(kind, collector_on, monkeypatch, default_sigint):
    was = gc.isenabled()
    uses = _lock_uses(kind, monkeypatch)
    assert uses >= 2
    try:
        for at in range(uses):
            (gc.enable if collector_on else gc.disable)()
            real = builder._GC_LOCK
            monkeypatch.setattr(builder, "_GC_LOCK", _SigintAt(real, at))
            try:
                with pytest.raises(KeyboardInterrupt):
                    _build(kind)
            finally:
                monkeypatch.setattr(builder, "_GC_LOCK", real)
            assert gc.isenabled() == collector_on, f"SIGINT at use {at} of {uses}"
            assert builder._gc_builds == {}, f"SIGINT at use {at} of {uses}"
    finally:
        (gc.enable if was else gc.disable)()


def test_after_an_interrupted_build_cycles_are_collected_and_sessions_train(monkeypatch, default_sigint):
    """The state after the worst cut (Ctrl-C as the build's pause was recorded): the collector runs on its
    own again, and a session built next trains to the values of one built without the interruption."""
    was = gc.isenabled()
    gc.enable()
    try:
        real = builder._GC_LOCK
        monkeypatch.setattr(builder, "_GC_LOCK", _SigintAt(real, 1))  # right after the first record
        with pytest.raises(KeyboardInterrupt):
            _build("training")
        monkeypatch.setattr(builder, "_GC_LOCK", real)

        class Node:
            pass

        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle: only the collector frees it
        gone = weakref.ref(a)
        del a, b
        for _ in range(200):  # allocations of containers trigger the collector when it is on
            _ = [[] for _ in range(1000)]
            if gone() is None:
                break
        assert gone() is None

        x, y = batches(1, 16)[0]
        feeds = {"x": x, "y": y, "Learning_Rate": np.array([0.1], np.float32)}
        after, calm = _build("training"), _build("training")
        for _ in range(3):
            got, want = after.run(["loss"], feeds), calm.run(["loss"], feeds)
            np.testing.assert_array_equal(got[0], want[0])
    finally:
        (gc.enable if was else gc.disable)()
