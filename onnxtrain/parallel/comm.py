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
# seconds a rank failing before MPI started waits at most in MPI_Init for its peers, to abort them
ABORT_INIT_LIMIT = 60.0


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
    return _start_mpi()


def _start_mpi(init_limit: float | None = None) -> Communicator:
    """:func:`get_communicator`, with ``MPI_Init`` bounded by ``init_limit`` seconds if less than the
    collective timeout."""
    global _COMM
    with _LOCK:
        if _COMM is None:
            with _init_watchdog(init_limit):
                mpi = _import_mpi()
            _COMM = Communicator(mpi.COMM_WORLD)
            from onnxtrain.engine.blas import share_blas_threads_among_ranks

            share_blas_threads_among_ranks()  # ranks sharing a host must not each take every CPU
        return _COMM


def _import_mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError("data parallelism needs mpi4py and an MPI library: pip install mpi4py mpich (from "
                          "a checkout: pip install -e '.[mpi]'), or mpi4py built against your cluster's MPI "
                          f"({e})") from e
    return MPI


def _launcher_size() -> int:
    """The number of ranks the launcher's environment variables give (1 when not under ``mpiexec``)."""
    if not launched_by_mpi():
        return 1
    w = _env_world()
    return w.size if w is not None else 1


@contextmanager
def _init_watchdog(limit: float | None = None) -> Iterator[None]:
    """Bound ``MPI_Init`` by the collective timeout: a rank that died or exited before starting MPI leaves the
    others waiting in it, before any communicator (and its watchdog) exists. ``MPI_Init`` holds the GIL, so
    the bound is faulthandler's C watchdog: past the timeout it prints where each thread waits and exits
    (code 1). (It replaces a ``faulthandler.dump_traceback_later`` of the caller's meanwhile.)"""
    try:
        timeout = _timeout_from_env()
    except ValueError:
        timeout = DEFAULT_TIMEOUT
    if limit is not None and (timeout <= 0 or limit < timeout):
        timeout = limit
    armed = False
    if timeout > 0 and _launcher_size() > 1:
        import faulthandler

        try:
            sys.stderr.write("")  # faulthandler needs a real stderr
            faulthandler.dump_traceback_later(timeout, exit=True)
            armed = True
        except (AttributeError, ValueError, OSError, RuntimeError):
            armed = False
    try:
        yield
    finally:
        if armed:
            import faulthandler

            faulthandler.cancel_dump_traceback_later()


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
        """Sum ``buf`` (contiguous) over all ranks, in place (a type MPI has no sum for, such as bfloat16, is
        summed in float32 and rounded once)."""
        if _no_mpi_type(buf):
            wide = buf.astype(np.float32)
            buf[...] = self.allreduce_(wide, what)
            return buf
        with self.guarded(what):
            self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        return buf

    def reduce_scatter_(self, buf: np.ndarray, out: np.ndarray, what: str = "reduce-scatter") -> np.ndarray:
        """Sum ``buf`` (size = size·len(out)) over ranks; this rank receives block ``rank`` in ``out``
        (bfloat16 and the like summed in float32, as :meth:`allreduce_`)."""
        if _no_mpi_type(buf):
            wide = np.empty(out.shape, np.float32)
            out[...] = self.reduce_scatter_(buf.astype(np.float32), wide, what)
            return out
        with self.guarded(what):
            self.comm.Reduce_scatter_block(buf, out, op=self.MPI.SUM)
        return out

    def allgather_(self, buf: np.ndarray, what: str = "allgather") -> np.ndarray:
        """Every rank contributes block ``rank`` of ``buf`` (equal blocks); all receive every block."""
        with self.guarded(what):
            self.comm.Allgather(self.MPI.IN_PLACE, _as_bytes(buf))
        return buf

    def sendrecv(self, send: np.ndarray, recv: np.ndarray, peer: int, what: str = "exchange") -> np.ndarray:
        with self.guarded(what):
            self.comm.Sendrecv(_as_bytes(send), peer, 0, _as_bytes(recv), peer, 0)
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


def _no_mpi_type(buf: np.ndarray) -> bool:
    """Whether ``buf``'s element type is one MPI has no datatype for: ml_dtypes' bfloat16 and float8 types,
    which numpy sees as opaque (kind 'V')."""
    return buf.dtype.kind == "V"


def _as_bytes(buf: np.ndarray) -> np.ndarray:
    """``buf`` as its bytes when MPI has no datatype for its elements (copies move bytes), else itself."""
    return buf.view(np.uint8) if _no_mpi_type(buf) else buf


class _Request:
    """A pending send: ``wait()`` completes it under the communicator's watchdog."""

    def __init__(self, comm: Communicator, request: Any, what: str):
        self._comm, self._request, self._what = comm, request, what

    def wait(self) -> None:
        with self._comm.guarded(self._what):
            self._request.wait()


def install_abort_on_exception(comm: Communicator | None = None) -> None:
    """An uncaught exception prints its traceback, then aborts every rank (exit code non-zero). Without
    ``comm``: the job-wide communicator, started then if MPI is not yet (installed at import under
    ``mpiexec``, so that a rank failing before its first session does not leave the others in
    ``MPI_Init``)."""
    previous = sys.excepthook
    if getattr(previous, "_onnxtrain_abort", False):
        return

    def hook(etype: type[BaseException], value: BaseException, tb: Any) -> None:
        try:
            previous(etype, value, tb)
        except Exception:
            import traceback  # here: single-process sessions never need it (93 KB of Python objects)

            traceback.print_exception(etype, value, tb)
        abort_job(f"uncaught {etype.__name__}: {value}", 1, comm)

    hook._onnxtrain_abort = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def abort_job(message: str, code: int = 1, comm: Communicator | None = None) -> None:
    """End every rank of the job with ``code`` (``comm``, else the job-wide communicator). When MPI has not
    been started yet, it is started first: the other ranks may be waiting for this one in ``MPI_Init``; should
    that not complete within the collective timeout (at most ``ABORT_INIT_LIMIT`` seconds), this rank exits
    alone (code 1)."""
    if comm is None:
        comm = _COMM
    if comm is None:
        try:  # the peers waiting in MPI_Init go on at once; one that never starts MPI (it ended, or works
            # without it) would hold this rank up to the timeout: at most ABORT_INIT_LIMIT then
            comm = _start_mpi(ABORT_INIT_LIMIT)
        except BaseException as e:  # no MPI to abort through: this rank alone ends
            sys.stderr.write(f"onnxtrain: {message}; could not start MPI to abort the other ranks ({e})\n")
            sys.stderr.flush()
            os._exit(code)
    if comm.size > 1:
        comm.abort(message, code)


@contextmanager
def abort_on_error() -> Iterator[None]:
    """Wrap a program's main: any exception, or ``sys.exit`` with a non-zero code, aborts every rank.

    Needed where the program catches errors itself (a CLI turning them into an exit status), since
    a rank that simply exits would leave the others waiting in their next collective.
    """
    try:
        yield
    except SystemExit as e:
        if e.code not in (None, 0) and _several_ranks():
            abort_job(f"exit status {e.code}", e.code if isinstance(e.code, int) else 1)
        raise
    except BaseException as e:
        if _several_ranks():
            import traceback

            traceback.print_exc()
            abort_job(f"{type(e).__name__}: {e}", 1)
        raise


def _several_ranks() -> bool:
    """Whether this process is one of several ranks (MPI started or not)."""
    return _COMM.size > 1 if _COMM is not None else _launcher_size() > 1


# under mpiexec with several ranks, an uncaught exception aborts the job from the start: a rank that fails
# before any session starts MPI would otherwise leave the others waiting for it in MPI_Init forever
if _launcher_size() > 1:
    install_abort_on_exception()
