"""Per-thread settings a block of code runs under (a run's width, its donated slots, a profiled node's
splits)."""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from typing import Any


class _Bound:
    """The context manager :func:`bound` returns (a class: entering and leaving it cost a fifth of a
    generator-based one's, and every run of a plan enters one)."""

    __slots__ = ("local", "name", "value", "default", "before")

    def __init__(self, local: threading.local, name: str, value: Any, default: Any) -> None:
        self.local, self.name, self.value, self.default = local, name, value, default

    def __enter__(self) -> None:
        self.before = getattr(self.local, self.name, self.default)
        setattr(self.local, self.name, self.value)

    def __exit__(self, *exc: object) -> None:
        setattr(self.local, self.name, self.before)


def bound(local: threading.local, name: str, value: Any, default: Any = None) -> AbstractContextManager[None]:
    """Set ``local.<name>`` to ``value`` for the block, then back to what it was (``default`` when unset)."""
    return _Bound(local, name, value, default)
