"""numpy's OpenBLAS and the engine's threads.

After each call, OpenBLAS's idle threads busy-wait for about 2**28 cycles (0.1 s) before they sleep, so in
a training step, where a GEMM comes every few milliseconds, they hold the other cores all the time, and the
engine's own threads (:mod:`onnxtrain.engine.parallel`) get half a core each. The first time a kernel splits
its work over threads, the wait is shortened, once per process, to :data:`SPIN_LOG2`: long enough to cover
the gap between back-to-back GEMMs (a layer's two gradient products), short enough to free the core for the
next elementwise kernel. OpenBLAS reads the wait from ``OPENBLAS_THREAD_TIMEOUT`` when it starts its
threads; they are stopped here and restarted at once with the new value, and the threads that start are
given CPUs of their own (:mod:`onnxtrain.engine.affinity`). A process that sets ``OPENBLAS_THREAD_TIMEOUT``
itself keeps its own value.

Measured on 2 cores (medians of 5 runs of each training step): the transformer encoder 38.7 → 36.0 ms with
threads and a wait of 2**18 cycles (2**14: 36.5 ms). Waking OpenBLAS's sleeping thread costs each GEMM
after a gap, which is why a workload with many GEMMs and no kernel big enough to split (LeNet: 4.85 →
5.1-5.4 ms when shortened) keeps the long wait.

:func:`single_threaded_blas` sets OpenBLAS's thread count to one for a while, for callers that make BLAS
calls on two threads of their own at once (:mod:`onnxtrain.engine.batch_split`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from onnxtrain.engine import affinity

SPIN_LOG2 = 18  # 2**18 cycles: about 0.1 ms at 2.6 GHz
_ENV = ("OPENBLAS_THREAD_TIMEOUT", "GOTO_THREAD_TIMEOUT")
_lock = threading.Lock()
_done: list[bool] = []


def _loaded_openblas() -> list[str]:
    """Paths of the OpenBLAS libraries mapped into this process (Linux only; else none)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line and ".so" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.isabs(p))


def openblas_symbols(candidates: Sequence[Sequence[str]]) -> Iterator[tuple[Sequence[str], tuple[Any, ...]]]:
    """For each OpenBLAS library mapped into this process, in order, and each tuple of symbol names in
    ``candidates`` it exports all of: (the names, their functions as ctypes objects, argument types unset)."""
    for path in _loaded_openblas():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for names in candidates:
            found = tuple(getattr(lib, n, None) for n in names)
            if all(f is not None for f in found):
                yield names, found


# modules whose threads never call numpy: tqdm's monitor thread, alive while a progress bar is
_QUIET_THREAD_MODULES = ("tqdm.",)


def _others_running() -> bool:
    """True when a Python thread other than this one, the engine's workers and MPI watchdog (named in
    :data:`_OWN_THREADS`) and those of :data:`_QUIET_THREAD_MODULES` is alive: it might be inside a BLAS
    call, which stopping OpenBLAS's threads would leave waiting forever (and changing their number, running
    on a count it did not start with). ``run_async``'s threads run whole sessions: they count (exempted by
    their ``onnxtrain-`` name, they deadlocked a process whose main thread ran meanwhile)."""
    me = threading.current_thread()
    return any(t is not me and not t.name.startswith(_OWN_THREADS)
               and not type(t).__module__.startswith(_QUIET_THREAD_MODULES) for t in threading.enumerate())


_OWN_THREADS = ("onnxtrain-worker-", "onnxtrain-mpi-watchdog")


def shorten_blas_spin() -> bool:
    """Make numpy's OpenBLAS threads sleep after :data:`SPIN_LOG2` cycles idle instead of about 0.1 s.
    Done once per process; returns whether the value now applies (False: not OpenBLAS with a pthreads
    server, or the process chose its own ``OPENBLAS_THREAD_TIMEOUT``). While other Python threads are
    alive it does nothing and is tried again on the next call. The variable, once set, is inherited by
    child processes."""
    with _lock:
        if _done:
            return _done[0]
        if _others_running():
            return False
        applied = False
        if not any(k in os.environ for k in _ENV):
            for path in _loaded_openblas():
                try:
                    lib = ctypes.CDLL(path)
                    read_env, shutdown = lib.openblas_read_env, lib.blas_thread_shutdown_
                except (OSError, AttributeError):
                    continue
                os.environ["OPENBLAS_THREAD_TIMEOUT"] = str(SPIN_LOG2)
                read_env()  # OpenBLAS keeps its environment in variables read at load time
                before = affinity.thread_ids()
                shutdown()
                _restart_threads()  # they start again reading the new wait
                # the threads that just started are OpenBLAS's helpers: each gets a CPU of its own
                affinity.place_blas_helpers(affinity.thread_ids() - before)
                applied = True
        _done.append(applied)
        return applied


def place_helpers_after_fork() -> None:
    """After this process forked: start OpenBLAS's helper threads again and place them, when the engine had
    placed them. OpenBLAS stops its threads before a fork (its own fork handler), and the ones its next call
    would start could run on any CPU, the run's calling thread's included."""
    if not affinity.helpers_placed():
        return
    before = affinity.thread_ids()
    _restart_threads()
    affinity.place_blas_helpers(affinity.thread_ids() - before)


def _restart_threads() -> None:
    """One GEMM large enough for OpenBLAS to split it over its threads, which starts them."""
    a = np.ones((128, 128), np.float32)
    np.matmul(a, a)


@functools.cache
def _thread_count_functions() -> tuple[Any, Any] | None:
    """OpenBLAS's (set, get) thread-count functions, under the names numpy's bundled build exports, or None
    when numpy's BLAS is not an OpenBLAS with them."""
    for path in _loaded_openblas():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in (("scipy_openblas", "64_"), ("openblas", ""), ("scipy_openblas", "")):
            setter = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
            getter = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
            if setter is not None and getter is not None:
                setter.argtypes, setter.restype, getter.restype = [ctypes.c_int], None, ctypes.c_int
                return setter, getter
    return None


def can_pin_blas_threads() -> bool:
    """True when :func:`single_threaded_blas` can make numpy's BLAS run on the calling thread alone (an
    OpenBLAS whose thread count can be set, and no Python thread outside the engine's that might be inside
    a BLAS call)."""
    return _thread_count_functions() is not None and not _others_running()


def share_blas_threads_among_ranks() -> int | None:
    """Several MPI ranks on this host: give OpenBLAS each rank's share of the CPUs (the engine's own
    :func:`~onnxtrain.engine.parallel.default_width`), unless ``OPENBLAS_NUM_THREADS`` (or
    ``OMP_NUM_THREADS``) says otherwise. OpenBLAS otherwise starts a thread per CPU in every rank, and their
    busy-waiting starves the other ranks: ``mpiexec -n 2`` on 2 CPUs, a data-parallel step of the MLP
    784-512-512-10 at batch 256 took 100 ms against 10 ms with one thread each (one process: 8.3 ms), the
    transformer's 326 against 55 ms (one process: 76). Returns the count set, or None."""
    from onnxtrain.engine.parallel import default_width, local_ranks

    if local_ranks() < 2 or any(os.environ.get(k, "").strip() for k in ("OPENBLAS_NUM_THREADS",
                                                                         "OMP_NUM_THREADS")):
        return None
    functions = _thread_count_functions()
    if functions is None:
        return None
    n = default_width()
    functions[0](n)
    return n


def single_threaded_blas_for_good() -> bool:
    """Set OpenBLAS's thread count to one for the rest of the process (a batch split's child process);
    False when numpy's BLAS is not an OpenBLAS whose count can be set."""
    functions = _thread_count_functions()
    if functions is not None:
        functions[0](1)
    return functions is not None


@contextmanager
def single_threaded_blas() -> Iterator[None]:
    """Inside the block, each BLAS call runs on the thread that makes it (OpenBLAS's thread count set to 1,
    restored after): for callers that run two BLAS calls at once on threads of their own. Requires
    :func:`can_pin_blas_threads`."""
    functions = _thread_count_functions()
    if functions is None:
        raise RuntimeError("numpy's BLAS thread count cannot be set here (not OpenBLAS)")
    setter, getter = functions
    before = getter()
    setter(1)
    try:
        yield
    finally:
        setter(before)
