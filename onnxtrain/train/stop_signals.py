"""How a training run stops on a signal: the first SIGINT or SIGTERM sets a flag the loop checks between
steps; a second raises at once (KeyboardInterrupt, or :class:`Terminated` for SIGTERM), except a SIGTERM
that repeats the first within :data:`SIGTERM_REPEAT_S` (one request delivered twice)."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # the signals that stop a run between steps
# A SIGTERM this soon after the first is the same stop request delivered twice, not a second one: a
# cgroup-wide kill (systemd's KillMode=control-group, Slurm's signal to a job step's processes) signals each
# rank directly and mpiexec, which forwards it to the ranks again (milliseconds apart)
SIGTERM_REPEAT_S = 1.0


class Terminated(KeyboardInterrupt):
    """A second stop signal (SIGTERM) while a run stops: as a second Ctrl-C's KeyboardInterrupt, with the
    signal's number (the CLI exits 128 + it)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


class StopSignals:
    """Turns the first SIGINT or SIGTERM into a flag (checked between steps; ``signum`` says which); the
    second raises KeyboardInterrupt (SIGINT) or :class:`Terminated` (SIGTERM), but a SIGTERM repeating a
    first SIGTERM within :data:`SIGTERM_REPEAT_S` (one request delivered twice) is passed over."""

    def __init__(self) -> None:
        self.hit = False
        self.signum = 0
        self._at = 0.0
        self._prev: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self.hit:
            if signum == self.signum == signal.SIGTERM and now - self._at < SIGTERM_REPEAT_S:
                return
            raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)
        self.hit = True
        self.signum = signum
        self._at = now

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._prev[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        until = self._at + SIGTERM_REPEAT_S
        for s, prev in self._prev.items():
            prev = prev if prev is not None else signal.SIG_DFL
            if s == self.signum == signal.SIGTERM and time.monotonic() < until:
                prev = _PassOverRepeats(prev, until)  # (the run stopped on it: a repeat may still come)
            signal.signal(s, prev)
        self._prev.clear()


class _PassOverRepeats:
    """SIGTERM's handler once a run has stopped on one: a repeat of it before ``until`` (monotonic time) is
    passed over, as during the run; a later SIGTERM puts back ``prev`` (the handler before the run) and
    gets its action."""

    def __init__(self, prev: Any, until: float) -> None:
        self.prev = prev
        self.until = until

    def __call__(self, signum: int, frame: Any) -> None:
        if time.monotonic() < self.until:
            return
        signal.signal(signum, self.prev)
        if callable(self.prev):
            self.prev(signum, frame)
        elif self.prev == signal.SIG_DFL:
            os.kill(os.getpid(), signum)  # (delivered again, now to the default action)
