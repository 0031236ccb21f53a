"""Ctrl-C (and the notices a job gets before it is stopped, such as a SIGTERM handler that saves before a
preemption) held back while a training step changes the state: the step completes
(weights, moments, counters all updated) and the handler runs after it, as onnxruntime's C++ run returns
before Python sees the signal. A step interrupted part way left weights updated and their moments not."""

from __future__ import annotations

import _signal  # signal's C module: its signal() without the enum conversions (0.4 against 5 µs a pair)
import os
import signal
import threading
from types import TracebackType
from typing import Any

_SIGINT = int(signal.SIGINT)
# the other signals whose Python handlers are held back: the notices a job gets before it is stopped (a
# scheduler's preemption, a hang-up), whose handlers may raise to save and leave. Looked up each block (5
# handler reads, about 0.7 µs). Timeouts (SIGALRM, SIGVTALRM, SIGXCPU: pytest-timeout's, say) still stop a
# step at once, as they must to end a hung one; a profiler's SIGPROF and SIGCHLD's reaping run as they come
_OTHERS = tuple(int(getattr(signal, n)) for n in ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT")
                if hasattr(signal, n))
_getsignal = _signal.getsignal


class sigint_deferred:  # noqa: N801 - used as a function: ``with sigint_deferred():``
    """Within the block, SIGINT (and the signals of :data:`_OTHERS` that have a Python handler) is recorded
    instead of handled; on exit the handler that was in place runs once per signal caught, in order. A
    second signal of one kind within the block gives the handlers all caught so far at once (Ctrl-C twice
    stops a long step). Only in the main thread (where Python runs signal handlers), and only when
    ``active``. About 2 µs a block (two handler swaps and five handler reads: 0.7 µs of it)."""

    __slots__ = ("_active", "_caught", "_previous", "_thread", "_others")

    def __init__(self, active: bool = True) -> None:
        self._active = active and threading.current_thread() is threading.main_thread()
        self._caught: list[tuple[int, Any]] = []
        self._previous: Any = None
        self._others: dict[int, Any] = {}  # signal → its Python handler, swapped for the block

    def _record(self, signum: int, frame: Any) -> None:
        if any(s == signum for s, _ in self._caught):  # a second one within the block: handled at once
            self._caught.append((signum, frame))  # (a hung step ends)
            self._release()
            return
        self._caught.append((signum, frame))

    def _restore(self) -> None:
        """Put the handlers in place before the block back."""
        self._active = False
        previous = signal.SIG_DFL if self._previous is None else self._previous  # (None: set outside Python)
        _signal.signal(_SIGINT, previous)
        others, self._others = self._others, {}
        for signum, handler in others.items():
            _signal.signal(signum, handler)

    def _release(self) -> None:
        """Put the handlers back and give them the signals caught so far (they may raise)."""
        handlers = {**self._others, _SIGINT: self._previous}
        self._restore()
        caught, self._caught = self._caught, []
        for signum, frame in caught:  # each, in order (a handler may count them: the CLI's second Ctrl-C)
            handler = handlers.get(signum)
            if callable(handler):
                handler(signum, frame)
            elif signum == _SIGINT and handler in (None, signal.SIG_DFL):
                signal.raise_signal(signal.SIGINT)

    def __enter__(self) -> None:
        if self._active:
            try:
                self._previous = _signal.signal(_SIGINT, self._record)
            except (ValueError, OSError):  # (no signals here, e.g. an embedded interpreter)
                self._active = False
                return
            self._thread = threading.get_ident()
            _ENTERED.append(self)
            if any(map(callable, map(_getsignal, _OTHERS))):  # (usually none: only SIGINT's is Python's)
                for signum in _OTHERS:
                    handler = _getsignal(signum)
                    if callable(handler):
                        self._others[signum] = handler
                        _signal.signal(signum, self._record)

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self in _ENTERED:
            _ENTERED.remove(self)
        if self._active:
            self._release()


_ENTERED: list[sigint_deferred] = []  # blocks entered and not left, innermost last


def _restore_in_child() -> None:
    """A child forked by another thread while the main thread was in a block: that block never ends there,
    so its handlers go back now (Ctrl-C stops the child as it would have without onnxtrain)."""
    me = threading.get_ident()
    for block in reversed(_ENTERED):
        if block._active and block._thread != me:  # (the forking thread's own blocks end as usual)
            block._caught = []
            block._restore()
    _ENTERED[:] = [b for b in _ENTERED if b._thread == me]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_restore_in_child)
