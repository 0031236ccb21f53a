"""Tests of one thread waiting for a lock another holds, ordered by what the threads do rather than by sleeps.

A test that holds a lock and checks that a call from another thread waits for it used to give that call a
fixed time (0.2-0.5 s) and assert it had not finished: on a loaded host the call may not even have started
by then, and the test then passes without reaching the case it is for. :func:`watched_lock` puts a stand-in
for the lock on its owner that sets ``waiting`` when a thread finds the lock held by another thread and
waits for it; :func:`first_set` waits until that happens or the call ends, whichever comes first."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any


class WatchedLock:
    """Stands in for ``lock`` (a Lock or RLock): the same lock, with ``waiting`` set the first time a thread
    asks for it while another thread holds it."""

    def __init__(self, lock: Any) -> None:
        self.lock = lock
        self.waiting = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self.lock.acquire(blocking=False):  # free, or already this thread's (an RLock)
            return True
        if not blocking:
            return False
        self.waiting.set()
        return self.lock.acquire(True, timeout)

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> WatchedLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


@contextlib.contextmanager
def watched_lock(owner: Any, attr: str) -> Iterator[WatchedLock]:
    """``owner.attr`` (a lock its code takes as ``with self.attr:``) replaced by a :class:`WatchedLock` of it
    inside the block. A thread already holding the lock keeps it: the stand-in is the same lock."""
    lock = getattr(owner, attr)
    watched = WatchedLock(lock)
    object.__setattr__(owner, attr, watched)  # (as onnxtrain.locks sets it: some owners refuse setattr)
    try:
        yield watched
    finally:
        object.__setattr__(owner, attr, lock)


def first_set(*events: threading.Event, timeout: float = 60.0) -> bool:
    """Wait until one of ``events`` is set (True), or ``timeout`` seconds (False)."""
    deadline = time.monotonic() + timeout
    while not any(e.is_set() for e in events):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True
