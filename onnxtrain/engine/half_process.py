"""The second half of a batch split run by a forked child process (``onnxtrain.batch_split = process``).

Two threads of one process share the GIL: every numpy call hands it over, and on a VM that halts an idle
CPU at once each handover waits about 20 µs for the other thread to wake. On the exported transformer
encoder of ``bench/engine_overhead.py`` (2 cores), a half of the batch alone took 15.1 ms and the two halves
on two threads 17.1-18.5 ms; in a child process, which has its own interpreter and GIL, they took 15.8 ms
(medians of interleaved rounds; ``bench/HISTORY.md``).

The child is forked once the plan of its half exists, so it shares the weights' pages with the parent (copy
on write: they are never written) and needs nothing compiled again. Requests and replies go through two
pipes, pickled, with the arrays' bytes sent out of band (no copy into the pickle). The child runs on one
thread with single-threaded BLAS, on a CPU of its own when the engine places its threads
(:mod:`onnxtrain.engine.affinity`); it ignores SIGINT (Ctrl-C stops the parent, which stops it), closes the
parent's other file descriptors, and ends when told to, when its request pipe closes (the parent ended), or
when the session that owns it is collected.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Mapping, Sequence
from contextlib import suppress
from typing import Any

import numpy as np

from onnxtrain.engine import affinity
from onnxtrain.engine.blas import place_helpers_after_fork, single_threaded_blas_for_good
from onnxtrain.engine.plan import Plan

try:
    import fcntl
except ImportError:  # not on Windows, which has no fork() either
    fcntl = None  # type: ignore[assignment]

_PIPE_BYTES = 1 << 20  # pipe capacity asked for (Linux's default limit): a reply this size is one write
_LENGTHS = struct.Struct("<QQ")  # bytes of the pickle, number of out-of-band buffers
STOP_SECONDS = 2.0  # a child that has not ended this long after it was told to is killed


def available() -> str | None:
    """Why a child process cannot run a half here, or None when it can."""
    if not hasattr(os, "fork"):
        return "this platform has no fork()"
    if "mpi4py.MPI" in sys.modules:
        return "an MPI process must not fork"
    return None


class ChildEnded(RuntimeError):
    """The child process ended before it replied (killed, out of memory)."""


class HalfProcess:
    """A forked child that runs ``plan`` on the feeds it is sent, one request at a time."""

    def __init__(self, plan: Plan):
        requests, self._requests = _pipe()
        self._replies, replies = _pipe()
        with warnings.catch_warnings():  # Python 3.12+ warns of fork() beside threads; the child only runs
            warnings.simplefilter("ignore", DeprecationWarning)  # numpy and the plan, on one thread
            pid = os.fork()
        if pid == 0:  # the child: never returns
            try:
                _serve(plan, requests, replies)
            finally:
                os._exit(0)
        os.close(requests)
        os.close(replies)
        place_helpers_after_fork()
        self.pid = pid
        self.peak_bytes = 0  # the child's plan's peak live bytes in its last run
        self._lock = threading.Lock()
        self._stop = weakref.finalize(self, _stop, pid, self._requests, self._replies)
        _live.add(self)

    def submit(self, feeds: Mapping[str, Any], output_names: Sequence[str] | None) -> None:
        """Start a run of the child's plan on ``feeds``; :meth:`result` waits for it."""
        self._lock.acquire()
        try:
            _send(self._requests, (dict(feeds), None if output_names is None else list(output_names)))
        except BaseException as e:  # a request cut short would be read as garbage: this child is done
            self.close()
            self._lock.release()
            if isinstance(e, BrokenPipeError):
                raise self._ended() from None
            raise

    def result(self) -> list[Any]:
        """The outputs of the run :meth:`submit` started; an error of the child's run is raised here."""
        try:
            reply = _recv(self._replies)
        except EOFError:
            self.close()
            raise self._ended() from None
        except BaseException:  # e.g. Ctrl-C while waiting: its reply would be read as the next run's
            self.close()
            raise
        finally:
            self._lock.release()
        tag, value, self.peak_bytes = reply
        if tag == "error":
            raise RuntimeError(f"in the batch split's child process: {value}")
        return value

    def _ended(self) -> ChildEnded:
        return ChildEnded(f"the batch split's child process (pid {self.pid}) ended")

    @property
    def alive(self) -> bool:
        return self._stop.alive

    def close(self) -> None:
        """Stop the child and wait for it to end."""
        self._stop()


_live: weakref.WeakSet[HalfProcess] = weakref.WeakSet()  # this process's children, for :func:`_forget`


def _forget() -> None:
    """In a process forked from this one (the user's own fork, a multiprocessing worker): the children
    belong to the parent. Close the copies of their pipes, without telling them to stop, so that a session
    used here forks a child of its own and the parent's keeps running undisturbed."""
    for child in list(_live):
        child._stop.detach()
        for fd in (child._requests, child._replies):
            with suppress(OSError):
                os.close(fd)
    _live.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)


def _pipe() -> tuple[int, int]:
    r, w = os.pipe()
    with suppress(OSError, AttributeError):  # F_SETPIPE_SZ: Linux only
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    return r, w


def _send(fd: int, message: Any) -> None:
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    sizes = struct.pack(f"<{len(raws)}Q", *(r.nbytes for r in raws))
    for part in (memoryview(_LENGTHS.pack(len(head), len(raws)) + sizes), memoryview(head), *raws):
        while part.nbytes:
            part = part[os.write(fd, part):]


def _read_into(fd: int, view: memoryview) -> None:
    while view.nbytes:
        n = os.readv(fd, [view])
        if n == 0:
            raise EOFError
        view = view[n:]


def _recv(fd: int) -> Any:
    lengths = bytearray(_LENGTHS.size)
    _read_into(fd, memoryview(lengths))
    head_bytes, count = _LENGTHS.unpack(lengths)
    sizes = bytearray(8 * count)
    _read_into(fd, memoryview(sizes))
    head = bytearray(head_bytes)
    _read_into(fd, memoryview(head))
    buffers = []
    for size in struct.unpack(f"<{count}Q", sizes):
        buf = np.empty(size, np.uint8)  # no zero fill; arrays built on it are writeable
        _read_into(fd, memoryview(buf))
        buffers.append(buf)
    return pickle.loads(head, buffers=buffers)


def _stop(pid: int, requests: int, replies: int) -> None:
    """Tell the child to end, close the pipes, and reap it (killed if it has not ended within
    :data:`STOP_SECONDS`: a reply too big for the pipe that nobody reads any more, say)."""
    with suppress(OSError):  # BlockingIOError too: a pipe full of a request cut short takes no more
        os.set_blocking(requests, False)
        _send(requests, None)
    for fd in (requests, replies):
        with suppress(OSError):
            os.close(fd)
    deadline = time.monotonic() + STOP_SECONDS
    with suppress(ChildProcessError, OSError):
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
            time.sleep(0.001)


def _serve(plan: Plan, requests: int, replies: int) -> None:
    """The child's loop: run each request on ``plan`` and reply, until told to stop or the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _close_other_fds({0, 1, 2, requests, replies})
    single_threaded_blas_for_good()  # the parent runs the other half on the other core
    cpu = affinity.helper_cpu(0)
    if cpu is not None:
        with suppress(OSError):
            os.sched_setaffinity(0, {cpu})
    while True:
        try:
            message = _recv(requests)
        except EOFError:
            return
        if message is None:
            return
        feeds, names = message
        try:
            reply: tuple[str, Any, int] = ("ok", plan.run(feeds, names), plan.peak_bytes)
        except Exception as e:  # sent back, raised in the parent
            reply = ("error", f"{type(e).__name__}: {e}", plan.peak_bytes)
        _send(replies, reply)


def _close_other_fds(keep: set[int]) -> None:
    """Close the descriptors the child inherited but does not use (sockets, files, other sessions' pipes)."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        if fd not in keep:
            with suppress(OSError):
                os.close(fd)
