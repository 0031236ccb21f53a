"""The MPI communicator: rank and size from ``mpiexec``, collectives on numpy buffers, fault handling.

mpi4py is imported only when the process runs under an MPI launcher (or when asked for), so that
onnxtrain works without it. Every collective runs under a watchdog: when it does not complete within
the timeout (``ONNXTRAIN_MPI_TIMEOUT`` seconds, default 600, 0 = never), the rank prints what it was
waiting for and aborts the whole job. An uncaught exception on any rank aborts the job as well
(``MPI_Abort`` from ``sys.excepthook``), so that no rank waits for ever on a dead peer.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np

# environment variables that MPI launchers set in every rank: (size variable, rank variable)
_LAUNCHER_VARS = (("PMI_SIZE", "PMI_RANK"),  # MPICH / hydra, Intel MPI
                  ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),  # Open MPI
                  ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK"),  # MVAPICH
                  ("PMIX_SIZE", "PMIX_RANK"))
_LOCAL_VARS = (("MPI_LOCALNRANKS", "MPI_LOCALRANKID"),
               ("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
               ("MV2_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_RANK"))

DEFAULT_TIMEOUT = 600.0
# seconds an aborting rank waits between printing its error and MPI_Abort: the launcher forwards the output
# of every rank before it tears the job down (without it, a message was lost about one time in fifteen)
ABORT_GRACE = 0.5


class World(NamedTuple):
    """This process's place in the job: global rank and size, rank and size on its host."""

    rank: int
    size: int
    local_rank: int
    local_size: int


def launched_by_mpi() -> bool:
    """True when an MPI launcher started this process (``ONNXTRAIN_MPI=0/1`` overrides the guess)."""
    forced = os.environ.get("ONNXTRAIN_MPI", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return any(size in os.environ or rank in os.environ for size, rank in _LAUNCHER_VARS)


def _env_world() -> World | None:
    for size_var, rank_var in _LAUNCHER_VARS:
        if size_var in os.environ and rank_var in os.environ:
            try:
                size, rank = int(os.environ[size_var]), int(os.environ[rank_var])
            except ValueError:
                continue
            local_rank, local_size = 0, 1
            for ls, lr in _LOCAL_VARS:
                if ls in os.environ and lr in os.environ:
                    local_size, local_rank = int(os.environ[ls]), int(os.environ[lr])
                    break
            return World(rank, size, local_rank, local_size)
    return None


_COMM: Communicator | None = None
_LOCK = threading.Lock()


def world() -> World:
    """Rank and size of this process: from MPI under ``mpiexec``, else ``World(0, 1, 0, 1)``.

    Does not import mpi4py when the launcher's environment already tells the answer.
    """
    if _COMM is not None:
        return _COMM.world
    if not launched_by_mpi():
        return World(0, 1, 0, 1)
    w = _env_world()
    return w if w is not None else get_communicator().world


def get_communicator() -> Communicator:
    """The job-wide communicator (created once; imports mpi4py and initialises MPI)."""
    global _COMM
    with _LOCK:
        if _COMM is None:
            _COMM = Communicator(_import_mpi().COMM_WORLD)
            from onnxtrain.engine.blas import share_blas_threads_among_ranks

            share_blas_threads_among_ranks()  # ranks sharing a host must not each take every CPU
        return _COMM


def _import_mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError("data parallelism needs mpi4py and an MPI library: pip install 'onnxtrain[mpi]' "
                          "(mpi4py + the mpich wheel), or mpi4py built against your cluster's MPI "
                          f"({e})") from e
    return MPI


def _timeout_from_env() -> float:
    raw = os.environ.get("ONNXTRAIN_MPI_TIMEOUT", "")
    try:
        return float(raw) if raw.strip() else DEFAULT_TIMEOUT
    except ValueError:
        raise ValueError(f"ONNXTRAIN_MPI_TIMEOUT must be a number of seconds, got {raw!r}") from None


class Communicator:
    """Collectives over an mpi4py communicator, on numpy buffers, each one under the watchdog."""

    def __init__(self, comm: Any, timeout: float | None = None, parent: Communicator | None = None):
        self.MPI = _import_mpi()
        self.comm = comm
        self._parent = parent  # a group split off it: faults abort the parent's whole job
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        env = _env_world()
        local = (env.local_rank, env.local_size) if env is not None and env.size == self.size else (0, 1)
        self.world = World(self.rank, self.size, *local)
        self.timeout = _timeout_from_env() if timeout is None else float(timeout)
        self._deadline = 0.0
        self._what = ""
        self._aborting = False
        if self.size > 1:
            install_abort_on_exception(parent or self)
            threading.Thread(target=self._watch, name="onnxtrain-mpi-watchdog", daemon=True).start()

    # ---- faults ----------------------------------------------------------------------
    def abort(self, message: str, code: int = 1) -> None:
        """Print ``message`` (prefixed by the rank) and end every rank of the job with ``code``."""
        if self._parent is not None:
            self._parent.abort(message, code)
            return
        if self._aborting:
            return
        self._aborting = True
        try:
            sys.stderr.write(f"onnxtrain [rank {self.rank}/{self.size}]: {message}; aborting all ranks\n")
            sys.stderr.flush()
            sys.stdout.flush()
            time.sleep(ABORT_GRACE)
        finally:
            self.comm.Abort(code)

    def _watch(self) -> None:
        while True:
            time.sleep(0.5 if self.timeout <= 0 else min(1.0, max(0.05, self.timeout / 20)))
            d = self._deadline
            if d and self.timeout > 0 and time.monotonic() > d:
                self.abort(f"{self._what} did not complete within {self.timeout:g} s (another rank died, "
                           "raised or runs different code; set ONNXTRAIN_MPI_TIMEOUT to change the limit)", 3)

    @contextmanager
    def guarded(self, what: str) -> Iterator[None]:
        """Run a collective under the watchdog: abort the job if it exceeds the timeout."""
        self._what = what
        self._deadline = time.monotonic() + self.timeout
        try:
            yield
        finally:
            self._deadline = 0.0

    def split(self, color: int, key: int, what: str = "splitting the ranks") -> Communicator:
        """The ranks that pass the same ``color``, ordered by ``key`` (a collective); its faults abort the
        whole job."""
        with self.guarded(what):
            sub = self.comm.Split(color, key)
        return Communicator(sub, self.timeout, parent=self)

    # ---- collectives -----------------------------------------------------------------
    def allreduce_(self, buf: np.ndarray, what: str = "allreduce") -> np.ndarray:
        """Sum ``buf`` (contiguous) over all ranks, in place."""
        with self.guarded(what):
            self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        return buf

    def reduce_scatter_(self, buf: np.ndarray, out: np.ndarray, what: str = "reduce-scatter") -> np.ndarray:
        """Sum ``buf`` (size = size·len(out)) over ranks; this rank receives block ``rank`` in ``out``."""
        with self.guarded(what):
            self.comm.Reduce_scatter_block(buf, out, op=self.MPI.SUM)
        return out

    def allgather_(self, buf: np.ndarray, what: str = "allgather") -> np.ndarray:
        """Every rank contributes block ``rank`` of ``buf`` (equal blocks); all receive every block."""
        with self.guarded(what):
            self.comm.Allgather(self.MPI.IN_PLACE, buf)
        return buf

    def sendrecv(self, send: np.ndarray, recv: np.ndarray, peer: int, what: str = "exchange") -> np.ndarray:
        with self.guarded(what):
            self.comm.Sendrecv(send, peer, 0, recv, peer, 0)
        return recv

    def isend_object(self, obj: Any, dest: int, tag: int, what: str = "send") -> _Request:
        """Start sending ``obj`` (pickled) to rank ``dest``; the result's ``wait()`` runs under the
        watchdog."""
        return _Request(self, self.comm.isend(obj, dest=dest, tag=tag), what)

    def recv_object(self, source: int, tag: int, what: str = "receive") -> Any:
        """The object rank ``source`` sends with ``tag`` (under the watchdog)."""
        with self.guarded(what):
            return self.comm.recv(source=source, tag=tag)

    def allgather_object(self, obj: Any, what: str = "allgather") -> list[Any]:
        with self.guarded(what):
            return self.comm.allgather(obj)

    def allreduce_scalar(self, value: float, what: str = "allreduce") -> float:
        buf = np.array([value], np.float64)
        return float(self.allreduce_(buf, what)[0])

    def barrier(self, what: str = "barrier") -> None:
        with self.guarded(what):
            self.comm.Barrier()


class _Request:
    """A pending send: ``wait()`` completes it under the communicator's watchdog."""

    def __init__(self, comm: Communicator, request: Any, what: str):
        self._comm, self._request, self._what = comm, request, what

    def wait(self) -> None:
        with self._comm.guarded(self._what):
            self._request.wait()


def install_abort_on_exception(comm: Communicator) -> None:
    """An uncaught exception prints its traceback, then aborts every rank (exit code non-zero)."""
    previous = sys.excepthook
    if getattr(previous, "_onnxtrain_abort", False):
        return

    def hook(etype: type[BaseException], value: BaseException, tb: Any) -> None:
        try:
            previous(etype, value, tb)
        except Exception:
            traceback.print_exception(etype, value, tb)
        comm.abort(f"uncaught {etype.__name__}: {value}", 1)

    hook._onnxtrain_abort = True  # type: ignore[attr-defined]
    sys.excepthook = hook


@contextmanager
def abort_on_error() -> Iterator[None]:
    """Wrap a program's main: any exception, or ``sys.exit`` with a non-zero code, aborts every rank.

    Needed where the program catches errors itself (a CLI turning them into an exit status), since
    a rank that simply exits would leave the others waiting in their next collective.
    """
    try:
        yield
    except SystemExit as e:
        if e.code not in (None, 0) and _COMM is not None and _COMM.size > 1:
            _COMM.abort(f"exit status {e.code}", e.code if isinstance(e.code, int) else 1)
        raise
    except BaseException as e:
        if _COMM is not None and _COMM.size > 1:
            traceback.print_exc()
            _COMM.abort(f"{type(e).__name__}: {e}", 1)
        raise
