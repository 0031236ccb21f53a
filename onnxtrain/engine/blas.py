"""numpy's OpenBLAS and the engine's threads.

After each call, OpenBLAS's idle threads busy-wait for about 2**28 cycles (0.1 s) before they sleep, so in
a training step, where a GEMM comes every few milliseconds, they hold the other cores all the time, and the
engine's own threads (:mod:`onnxtrain.engine.parallel`) get half a core each. The first time a kernel splits
its work over threads, the wait is shortened, once per process, to :data:`SPIN_LOG2`: long enough to cover
the gap between back-to-back GEMMs (a layer's two gradient products), short enough to free the core for the
next elementwise kernel. OpenBLAS reads the wait from ``OPENBLAS_THREAD_TIMEOUT`` when it starts its
threads; they are stopped here and restart with the new value on the next call. A process that sets
``OPENBLAS_THREAD_TIMEOUT`` itself keeps its own value.

Measured on 2 cores (medians of 5 runs of each training step): the transformer encoder 38.7 → 36.0 ms with
threads and a wait of 2**18 cycles (2**14: 36.5 ms). Waking OpenBLAS's sleeping thread costs each GEMM
after a gap, which is why a workload with many GEMMs and no kernel big enough to split (LeNet: 4.85 →
5.1-5.4 ms when shortened) keeps the long wait.
"""

from __future__ import annotations

import ctypes
import os
import threading

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


def _others_running() -> bool:
    """True when a Python thread other than this one and the engine's own (named ``onnxtrain-*``) is
    alive: it might be inside a BLAS call, which stopping OpenBLAS's threads would leave waiting forever."""
    me = threading.current_thread()
    return any(t is not me and not t.name.startswith("onnxtrain-") for t in threading.enumerate())


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
                shutdown()  # the threads restart on the next threaded call, reading the new wait
                applied = True
        _done.append(applied)
        return applied
