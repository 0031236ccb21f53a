"""Per-thread settings a block of code runs under (a run's width, its donated slots, a profiled node's
splits)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def bound(local: threading.local, name: str, value: Any, default: Any = None) -> Iterator[None]:
    """Set ``local.<name>`` to ``value`` for the block, then back to what it was (``default`` when unset)."""
    before = getattr(local, name, default)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, before)
