"""CPU placement of a run's threads: the calling thread on the first CPU, the helpers on the others.

numpy's OpenBLAS hands part of each GEMM to helper threads and spins on the calling thread until they are
done. Once its idle wait is shortened (:mod:`onnxtrain.engine.blas`) the helpers sleep between GEMMs, and
after an idle spell the scheduler may wake a helper on the CPU where the calling thread is spinning: the
GEMM then waits for a scheduler tick or a migration. Measured on a 2-CPU VM: single training steps of
16-40 ms instead of 2 in the first steps after each 0.15 s pause; in the bench, whose samples follow such
a pause, the legacy MLP at batch 64 went from 0.64× to 0.69× onnxruntime-training with the threads placed
(an A/B run; bench/HISTORY.md, "Threads").

The placement applies only when the process may use exactly the CPUs the run uses (no share of a host
among MPI ranks, no smaller ``ONNXTRAIN_NUM_THREADS``), the calling thread has not been pinned by its
owner, no other run is pinned at the time, and OpenBLAS's helpers are known (their wait was shortened
here). The calling thread gets its own CPU set back when the run ends. ``ONNXTRAIN_PIN_THREADS=0`` turns
the placement off.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress

_lock = threading.Lock()
_helpers: list[int] = []  # native ids of OpenBLAS's helper threads, once placed
_pinned_runs = [0]  # runs placed now (at most one)
_placed_caller: list[int | None] = [None]  # native id of the thread a placed run put on the first CPU


@functools.cache
def _cpus() -> tuple[int, ...]:
    """The CPUs this process may use (empty when placement is off or not possible here)."""
    if os.environ.get("ONNXTRAIN_PIN_THREADS", "").strip() == "0" or not hasattr(os, "sched_setaffinity"):
        return ()
    for key in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        ranks = os.environ.get(key, "")
        if ranks.isdigit() and int(ranks) > 1:
            return ()
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except OSError:
        return ()


def helper_cpu(index: int) -> int | None:
    """The CPU of helper ``index`` (0-based, workers and OpenBLAS's helpers alike), or None."""
    cpus = _cpus()
    return cpus[1 + index % (len(cpus) - 1)] if len(cpus) > 1 else None


def place_worker(index: int) -> int:
    """Put the calling engine worker thread on its CPU, when placement applies here and OpenBLAS's helpers
    have been placed (the runs are placed only then); returns that CPU, or −1 (left where it was)."""
    cpu = helper_cpu(index)
    if cpu is not None and _helpers:
        try:
            os.sched_setaffinity(0, {cpu})
        except OSError:
            return -1
        return cpu
    return -1


def thread_ids() -> set[int]:
    """Native ids of this process's threads (empty where /proc is missing)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def place_blas_helpers(tids: set[int]) -> bool:
    """Put OpenBLAS's helper threads ``tids`` on their CPUs; True when all of them were placed."""
    if len(_cpus()) < 2 or not tids:
        return False
    ordered = sorted(tids)
    try:
        for i, tid in enumerate(ordered):
            os.sched_setaffinity(tid, {helper_cpu(i)})
    except OSError:
        return False
    with _lock:
        _helpers[:] = ordered
    return True


def helpers_placed() -> bool:
    """Whether OpenBLAS's helper threads were given CPUs of their own here."""
    return bool(_helpers)


def forget() -> None:
    """In a forked child: the parent's helper threads do not exist there."""
    _helpers.clear()
    _pinned_runs[0] = 0
    _placed_caller[0] = None


def caller_cpu() -> int:
    """The CPU a placed run holds the calling thread on, or −1 (not placed here: the scheduler's choice)."""
    if _placed_caller[0] is None or _placed_caller[0] != threading.get_native_id():
        return -1
    cpus = _cpus()
    return cpus[0] if cpus else -1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=forget)


_AS_IT_IS = nullcontext()


def placed(width: int) -> AbstractContextManager[None]:
    """Run the block with the calling thread on the first CPU, when a run of ``width`` threads uses all of
    this process's CPUs and the conditions of the module hold; else as it is (no generator to enter: every
    run of a plan asks)."""
    cpus = _cpus()
    if width < 2 or width != len(cpus) or not _helpers:
        return _AS_IT_IS
    return _placed(cpus)


@contextmanager
def _placed(cpus: tuple[int, ...]) -> Iterator[None]:
    """:func:`placed`'s placement on ``cpus``, one run at a time (another run meanwhile stays as it is)."""
    with _lock:
        mine = _pinned_runs[0] == 0
        if mine:
            _pinned_runs[0] = 1
    if not mine:
        yield
        return
    try:
        before = _placed_first(cpus)
        if before is not None:
            _placed_caller[0] = threading.get_native_id()
        try:
            yield
        finally:
            if before is not None:
                _placed_caller[0] = None
                with suppress(OSError):  # a CPU set that can no longer be had: the thread stays placed
                    os.sched_setaffinity(0, before)
    finally:
        with _lock:
            _pinned_runs[0] = 0


def _placed_first(cpus: tuple[int, ...]) -> set[int] | None:
    """Put the calling thread on ``cpus[0]``; its CPU set before, or None when it was left where it is (its
    owner placed it, or the system refused)."""
    try:
        before = os.sched_getaffinity(0)
        if before != set(cpus):  # its owner placed this thread: leave it there
            return None
        os.sched_setaffinity(0, {cpus[0]})
    except OSError:
        return None
    return before
