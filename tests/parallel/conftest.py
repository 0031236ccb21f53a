"""The ``mpi`` marker: tests that spawn ``mpiexec -n 2``; skipped with a reason without mpiexec/mpi4py."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_worker.py")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "mpi: spawns `mpiexec -n 2 python ...` (needs mpiexec and mpi4py)")


def mpi_missing() -> str | None:
    if shutil.which("mpiexec") is None:
        return "mpiexec is not on PATH (pip install mpich, or pip install -e '.[mpi]' from a checkout)"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not importable (pip install mpi4py mpich)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = mpi_missing()
    if reason is None:
        return
    for item in items:
        if "mpi" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


def run_mpi(*args: str, n: int = 2, timeout: float = 120.0, env: dict[str, str] | None = None,
            worker: str = WORKER) -> subprocess.CompletedProcess:
    """``mpiexec -n N python WORKER ARGS`` (default ``mpi_worker.py``); the launcher's environment variables
    are not inherited."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "MPI_", "PMIX_"))}
    clean.update(env or {})
    return run_job(["mpiexec", "-n", str(n), sys.executable, worker, *args], timeout, clean)


def run_job(cmd: list[str], timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``cmd`` run in a process group of its own (output captured as text), whatever of the group is left when
    it ends killed: a rank the launcher left behind (seen once, from the ``world_rank one`` guard case) spun
    on a CPU for the rest of the suite."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.communicate()
        raise
    finally:
        _kill_group(proc.pid)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # (nothing left of it)
        os.killpg(pgid, signal.SIGKILL)
