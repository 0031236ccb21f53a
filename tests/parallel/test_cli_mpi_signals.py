"""SIGTERM under ``mpiexec -n 2 onnxtrain train``: a scheduler stops the job by signalling mpiexec, which
forwards the signal to every rank; a rank can also be signalled alone, or the ranks some steps apart. Every
rank must stop after the same step (a rank that left would keep the others waiting in their next
collective for ever), save one checkpoint there and exit 143; ``--resume`` then ends as the uninterrupted
run, byte for byte. Each job runs under a timeout: a hang fails the test instead of stalling the suite."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.parallel.conftest import _kill_group
from tests.tiers import extended

pytestmark = pytest.mark.mpi

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "configs", "digits_mlp.yaml")
# The run that is stopped and resumed: long enough that the signal, sent once its first checkpoint exists,
# lands while it trains even on a loaded host (a 300-step run took under a second: a signal that the test's
# scan of /proc delayed past its end found the job finished, and exit 15 when it reached a rank exiting)
STEPS = 1000
LONG = 10**6  # a run that is only stopped: it never gets near its end
SETS = ["--set", "training.checkpoint_every=10", "--set", "training.eval_every=100", "--set",
        "training.keep_checkpoints=0", "--set", "output.plot=false"]
FIRST = os.path.join("checkpoints", "step_00000010.ckpt")
LAST = os.path.join("checkpoints", f"step_{STEPS:08d}.ckpt")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "MPI_", "PMIX_"))}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _start(out: str, *extra: str, steps: int = STEPS) -> subprocess.Popen:
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "onnxtrain", "train", CONFIG, *SETS, "--set",
           f"training.steps={steps}", "--output-dir", out, "-q", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """The job's exit code and what it wrote: its stderr, then its stdout (where mpiexec reports a rank's
    "BAD TERMINATION")."""
    try:
        said, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        said, err = proc.communicate()
        pytest.fail(f"the job did not end within {timeout} s of the signal (a rank hangs?): {err[-3000:]}")
    finally:
        _kill_group(proc.pid)
    return proc.returncode, err + said


def _ranks(launcher: int) -> dict[int, int]:
    """rank → pid of the ranks started under the mpiexec of pid ``launcher`` (from /proc)."""
    parent, rank = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                parent[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        except (OSError, ValueError, IndexError):
            continue
        if b"PMI_RANK" in env:
            rank[int(name)] = int(env[b"PMI_RANK"])

    def under(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 0)
            if pid == launcher:
                return True
        return False

    return {r: pid for pid, r in rank.items() if under(pid)}


def _wait_for(path: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 180
    while not os.path.exists(path):
        if proc.poll() is not None:
            pytest.fail(f"the job ended before {path}: {proc.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, f"no {path} within 180 s"
        time.sleep(0.01)


def _stopped_at(err: str) -> int:
    lines = [line for line in err.splitlines() if "stopped by SIGTERM at step" in line]
    assert len(lines) == 1, err[-3000:]  # rank 0 alone says it
    return int(lines[0].split("at step ")[1].split(";")[0])


def _descendants(pid: int) -> list[int]:
    """The pids of the processes below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(name))
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        out += below
        todo += below
    return out


def _signal(proc: subprocess.Popen, how: str) -> None:
    if how == "mpiexec":  # the scheduler's way: mpiexec forwards it to every rank
        proc.send_signal(signal.SIGTERM)
        return
    if how == "every process":  # a cgroup-wide kill (systemd, Slurm): each rank gets it twice, from mpiexec
        ranks = _ranks(proc.pid)  # and directly (spaced so that a rank's Python sees two, not one signal)
        for pid in [proc.pid, *_descendants(proc.pid)]:
            if pid not in ranks.values():
                os.kill(pid, signal.SIGTERM)
        time.sleep(0.02)
        for pid in ranks.values():
            with contextlib.suppress(ProcessLookupError):  # (one that has stopped and ended)
                os.kill(pid, signal.SIGTERM)
        return
    ranks = _ranks(proc.pid)
    assert sorted(ranks) == [0, 1], ranks
    os.kill(ranks[1], signal.SIGTERM)
    if how == "rank 1, then rank 0":  # some steps apart
        time.sleep(0.02)
        os.kill(ranks[0], signal.SIGTERM)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("mpi_sigterm") / "whole")
    code, err = _finish(_start(out), 300)
    assert code == 0, err[-3000:]
    return out


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_sigterm_to_mpiexec_saves_where_every_rank_stops_and_resumes_bit_for_bit(uninterrupted, tmp_path):
    out = str(tmp_path / "run")
    proc = _start(out)
    _wait_for(os.path.join(out, FIRST), proc)
    _signal(proc, "mpiexec")
    t0 = time.monotonic()
    code, err = _finish(proc, 60)
    print(f"ended {time.monotonic() - t0:.1f} s after the signal, exit {code}")
    assert code == 143, err[-3000:]
    step = _stopped_at(err)
    assert 10 <= step < STEPS
    saved = os.path.join(out, "checkpoints", f"step_{step:08d}.ckpt")
    assert os.path.exists(saved) and f"the last checkpoint is {saved}" in err, err[-3000:]
    proc = _start(out, "--resume")
    code, err = _finish(proc, 300)
    assert code == 0, err[-3000:]
    for name in (LAST, "model.onnx"):
        assert _read(os.path.join(out, name)) == _read(os.path.join(uninterrupted, name)), name


@pytest.mark.parametrize("how", ["rank 1", extended("rank 1, then rank 0", id="rank 1, then rank 0"),
                                 "every process"])
def test_sigterm_to_some_ranks_stops_them_all_after_one_step(tmp_path, how):
    """SIGTERM to rank 1 alone, or to rank 1 and rank 0 some steps later, or to every process of the job at
    once: both ranks stop after the same step, rank 0 writes its checkpoint, and the job exits 143 within a
    few seconds (a SIGTERM reaching rank 0 once it had stopped ended it by the default action: exit 15,
    mpiexec's "bad termination"; a cgroup-wide SIGTERM, which each rank gets directly and again from
    mpiexec, was taken as a second one: the job aborted without its stop's checkpoint)."""
    out = str(tmp_path / "run")
    proc = _start(out, steps=LONG)
    _wait_for(os.path.join(out, FIRST), proc)
    _signal(proc, how)
    t0 = time.monotonic()
    code, err = _finish(proc, 60)
    print(f"ended {time.monotonic() - t0:.1f} s after the signal, exit {code}")
    assert code == 143, err[-3000:]
    step = _stopped_at(err)
    assert os.path.exists(os.path.join(out, "checkpoints", f"step_{step:08d}.ckpt"))
    assert "BAD TERMINATION" not in err, err[-3000:]


@pytest.mark.extended
def test_two_sigterms_in_a_row_are_one_stop(tmp_path):
    """Two SIGTERMs 2 ms apart to mpiexec are one stop request delivered twice (SIGTERM_REPEAT_S): the
    ranks stop after the same step and save there (exit 143; a second SIGTERM later than that stops the
    save at once, as a second Ctrl-C, and the ranks abort together); the checkpoints there are whole."""
    from onnxtrain.checkpoint import load_checkpoint
    from onnxtrain.train.outputs import list_checkpoints

    out = str(tmp_path / "run")
    proc = _start(out, steps=LONG)
    _wait_for(os.path.join(out, FIRST), proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.002)
    proc.send_signal(signal.SIGTERM)
    code, err = _finish(proc, 60)
    assert code == 143, err[-3000:]
    assert os.path.exists(os.path.join(out, "checkpoints", f"step_{_stopped_at(err):08d}.ckpt"))
    for _, path in list_checkpoints(out):
        load_checkpoint(path)
