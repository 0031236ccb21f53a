"""Ctrl-C held back while a training step changes the state: the step completes (weights, moments, counters
all updated) and KeyboardInterrupt is raised after it, as onnxruntime's C++ run returns before Python sees
the signal. A step interrupted part way left weights updated and their moments not."""

from __future__ import annotations

import _signal  # signal's C module: its signal() without the enum conversions (0.4 against 5 µs a pair)
import os
import signal
import threading
from types import TracebackType
from typing import Any

_SIGINT = int(signal.SIGINT)


class sigint_deferred:  # noqa: N801 - used as a function: ``with sigint_deferred():``
    """Within the block, SIGINT is recorded instead of handled; on exit the handler that was in place runs
    once per signal caught. A second SIGINT within the block gives the handler both at once (Ctrl-C twice
    stops a long step). Only in the main thread (where Python runs signal handlers), and only when
    ``active``. About 1 µs a block (two handler swaps)."""

    __slots__ = ("_active", "_caught", "_previous", "_thread")

    def __init__(self, active: bool = True) -> None:
        self._active = active and threading.current_thread() is threading.main_thread()
        self._caught: list[tuple[int, Any]] = []
        self._previous: Any = None

    def _record(self, signum: int, frame: Any) -> None:
        self._caught.append((signum, frame))
        if len(self._caught) > 1:  # a second Ctrl-C within the block: handled at once (a hung step ends)
            self._release()

    def _release(self) -> None:
        """Put the handler back and give it the signals caught so far (it may raise)."""
        self._active = False
        previous = signal.SIG_DFL if self._previous is None else self._previous  # (None: set outside Python)
        _signal.signal(_SIGINT, previous)
        caught, self._caught = self._caught, []
        for signum, frame in caught:  # each, in order (a handler may count them: the CLI's second Ctrl-C)
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)

    def __enter__(self) -> None:
        if self._active:
            try:
                self._previous = _signal.signal(_SIGINT, self._record)
            except (ValueError, OSError):  # (no signals here, e.g. an embedded interpreter)
                self._active = False
            else:
                self._thread = threading.get_ident()
                _ENTERED.append(self)

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self in _ENTERED:
            _ENTERED.remove(self)
        if self._active:
            self._release()


_ENTERED: list[sigint_deferred] = []  # blocks entered and not left, innermost last


def _restore_in_child() -> None:
    """A child forked by another thread while the main thread was in a block: that block never ends there,
    so its handler goes back now (Ctrl-C stops the child as it would have without onnxtrain)."""
    me = threading.get_ident()
    for block in reversed(_ENTERED):
        if block._active and block._thread != me:  # (the forking thread's own blocks end as usual)
            block._active = False
            block._caught = []
            _signal.signal(_SIGINT, signal.SIG_DFL if block._previous is None else block._previous)
    _ENTERED[:] = [b for b in _ENTERED if b._thread == me]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_restore_in_child)
