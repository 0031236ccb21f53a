"""Locks that a forked child gets anew: a session's or checkpoint state's lock held by a parent's thread at
the fork stays held in the child, where that thread does not exist (the child's first run waited forever)."""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

_held: dict[int, tuple[weakref.ref, str]] = {}  # id(owner) -> (owner, attribute holding its lock)


def fork_safe_rlock(owner: Any, attr: str) -> threading.RLock:
    """A new RLock set as ``owner.attr``, replaced by a fresh one in a forked child."""
    lock = threading.RLock()
    object.__setattr__(owner, attr, lock)
    key = id(owner)
    _held[key] = (weakref.ref(owner, lambda _ref, key=key: _held.pop(key, None)), attr)
    return lock


def _renew_in_child() -> None:
    for ref, attr in list(_held.values()):
        owner = ref()
        if owner is not None:
            object.__setattr__(owner, attr, threading.RLock())


os.register_at_fork(after_in_child=_renew_in_child)
