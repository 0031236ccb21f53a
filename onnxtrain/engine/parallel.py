"""Intra-op parallelism: worker threads that a kernel splits its work over.

numpy releases the GIL inside ufunc loops, ``take`` and BLAS calls, so threads working on disjoint slices
of the same arrays run at the same time. A plan sets the width of its runs (``SessionOptions``'s
``intra_op_num_threads``, by default the CPUs this process may use); a kernel asks :func:`width` how many
parts are worth making and hands them to :func:`parallel_for`. Work is split only along independent
elements or rows, with each element computed by the same operations in the same order as in a serial
run, so results do not depend on the width.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np

from onnxtrain.engine import affinity
from onnxtrain.engine.blas import can_pin_blas_threads, shorten_blas_spin, single_threaded_blas
from onnxtrain.engine.thread_state import bound

_local = threading.local()
MIN_ROWS_WORK = 1 << 18  # elements per part of a row-wise kernel: below, splitting costs more than it saves


def default_width() -> int:
    """``ONNXTRAIN_NUM_THREADS`` when set, else the CPUs this process may run on, shared out among the
    ranks of an MPI job on this host (``MPI_LOCALNRANKS`` of MPICH, ``OMPI_COMM_WORLD_LOCAL_SIZE`` of
    Open MPI)."""
    env = os.environ.get("ONNXTRAIN_NUM_THREADS", "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"ONNXTRAIN_NUM_THREADS must be a positive integer, got {env!r}") from None
        if n < 1:
            raise ValueError(f"ONNXTRAIN_NUM_THREADS must be a positive integer, got {env!r}")
        return n
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // local_ranks())


def local_ranks() -> int:
    """How many ranks of an MPI job run on this host (1 outside one)."""
    for key in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        ranks = os.environ.get(key, "")
        if ranks.isdigit() and int(ranks) > 0:
            return int(ranks)
    return 1


def width() -> int:
    """How many threads the kernel running on this thread may use (1 outside a plan's run)."""
    return getattr(_local, "width", 1)


def running_with(n: int) -> AbstractContextManager[None]:
    """Kernels called on this thread inside the block may use ``n`` threads."""
    return bound(_local, "width", n, 1)


class _Job:
    """``fn(0) … fn(n - 1)``, claimed one index at a time by whichever thread is free."""

    __slots__ = ("fn", "n", "next", "done", "lock", "finished", "error")

    def __init__(self, fn: Callable[[int], None], n: int):
        self.fn, self.n = fn, n
        self.next = self.done = 0
        self.lock = threading.Lock()
        self.finished = threading.Event()
        self.error: BaseException | None = None

    def work(self) -> None:
        while True:
            with self.lock:
                i = self.next
                if i >= self.n:
                    return
                self.next = i + 1
            try:
                self.fn(i)
            except BaseException as e:  # re-raised on the calling thread
                if self.error is None:
                    self.error = e
            with self.lock:
                self.done += 1
                if self.done == self.n:
                    self.finished.set()


class _Workers:
    """Daemon threads that run the jobs put in their queue; grown on demand, shared by all plans."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self.count = 0
        self.ids: list[int] = []  # native thread ids, in start order
        self.cores: dict[int, int] = {}  # worker index → the CPU it was placed on (−1: not placed)
        self.lock = threading.Lock()

    def ensure(self, n: int) -> None:
        with self.lock:
            while self.count < n:
                name = f"onnxtrain-worker-{self.count}"
                t = threading.Thread(target=self._loop, args=(self.count,), name=name, daemon=True)
                t.start()  # (returns once the thread runs: its native id is known)
                self.ids.append(t.native_id or 0)
                self.count += 1

    def _loop(self, index: int) -> None:
        _local.width = 1  # a part never splits again
        self.cores[index] = affinity.place_worker(index)
        while True:
            self.jobs.get().work()


_workers = _Workers()


def _forget_workers() -> None:
    """In a forked child: the parent's worker threads do not exist there."""
    global _workers
    _workers = _Workers()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_workers)


def worker_threads() -> dict[int, int]:
    """The engine's worker threads started so far: native thread id → the CPU it was placed on (−1: the
    scheduler's choice)."""
    w = _workers
    return {t: w.cores.get(i, -1) for i, t in enumerate(list(w.ids))}


def recording_splits(parts: list[int]) -> AbstractContextManager[None]:
    """Inside the block, each :func:`parallel_for` on this thread appends its count of parts to ``parts``
    (a profiled node's ``splits``)."""
    return bound(_local, "splits", parts)


def parallel_for(n: int, fn: Callable[[int], None]) -> None:
    """Call ``fn(i)`` for i in range(n), over up to :func:`width` threads (this one included), each under
    this thread's numpy error state; the first exception any call raised is raised here once all calls
    have ended."""
    threads = min(width(), n)
    splits = getattr(_local, "splits", None)
    if splits is not None:
        splits.append(n if threads > 1 else 1)
    if threads <= 1:
        for i in range(n):
            fn(i)
        return
    shorten_blas_spin()  # once per process, when a kernel first splits: else OpenBLAS's idle threads
    # hold the cores (a process whose kernels never split, a small CNN say, keeps OpenBLAS's long wait)
    errors = np.geterr()  # numpy's error state is per thread

    def call(i: int) -> None:
        with np.errstate(**errors):
            fn(i)

    job = _Job(call, n)
    _workers.ensure(threads - 1)
    for _ in range(threads - 1):
        _workers.jobs.put(job)
    with running_with(1):  # a part never splits again
        job.work()
    job.finished.wait()
    if job.error is not None:
        raise job.error


def row_ranges(rows: int, work: int, align: int = 1) -> list[tuple[int, int]]:
    """The ranges :func:`for_rows` gives its threads: one per thread when ``work`` (elements, or any measure
    proportional to the time) makes parts of :data:`MIN_ROWS_WORK` or more, else ``[(0, rows)]``. Ranges
    start at multiples of ``align``."""
    parts = min(width(), rows, work // MIN_ROWS_WORK)
    return [(0, rows)] if parts <= 1 else split(rows, parts, align)


def for_rows(rows: int, work: int, fn: Callable[[int, int], None], align: int = 1) -> None:
    """Call ``fn(lo, hi)`` on ranges of ``rows`` independent rows covering them all (:func:`row_ranges`),
    each on a thread of the run's, the first here."""
    ranges = row_ranges(rows, work, align)
    if len(ranges) == 1:
        fn(*ranges[0])
        return
    parallel_for(len(ranges), lambda i: fn(*ranges[i]))


def for_ranges_with_own_blas(n: int, fn: Callable[[int, int], None]) -> None:
    """Call ``fn(lo, hi)`` on one range of ``[0, n)`` per thread of the run, each thread's BLAS calls made at
    one OpenBLAS thread on that thread (for work of many GEMMs each too small for OpenBLAS to split); on
    this thread alone as ``fn(0, n)`` when the run has one thread or OpenBLAS cannot be pinned
    (:func:`~onnxtrain.engine.blas.can_pin_blas_threads`)."""
    ranges = split(n, width()) if width() > 1 and n > 1 else [(0, n)]
    if len(ranges) > 1 and can_pin_blas_threads():
        with single_threaded_blas():
            parallel_for(len(ranges), lambda i: fn(*ranges[i]))
    else:
        fn(0, n)


def split(n: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """``[0, n)`` as up to ``parts`` contiguous ranges of nearly equal length whose starts are multiples of
    ``align``."""
    if n <= 0:
        return []
    step = -(-n // max(parts, 1))
    step = -(-step // align) * align
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]
