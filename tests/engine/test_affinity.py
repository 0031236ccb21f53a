"""CPU placement of a run's threads (``onnxtrain.engine.affinity``), each case in a fresh interpreter: the
placement follows OpenBLAS's restart, which happens once per process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
pytestmark = pytest.mark.skipif(len(CPUS) < 2 or not os.path.isdir("/proc/self/task"),
                                reason="needs Linux and two CPUs or more")

_SETUP = """
    import os, threading
    import numpy as np
    from onnxtrain.engine import affinity, blas, parallel
    from onnxtrain.engine.plan import Plan
    cpus = sorted(os.sched_getaffinity(0))
    width = len(cpus)
    with parallel.running_with(width):  # the first split: OpenBLAS's wait shortened, its threads restarted
        parallel.parallel_for(width, lambda i: None)
    np.ones((128, 128), np.float32) @ np.ones((128, 128), np.float32)
"""


def _python(code: str, **env: str) -> list[str]:
    """Run ``_SETUP`` then ``code`` in a fresh interpreter; its printed lines."""
    base = {k: v for k, v in os.environ.items()
            if "THREAD_TIMEOUT" not in k and k not in ("ONNXTRAIN_PIN_THREADS", "ONNXTRAIN_NUM_THREADS",
                                                        "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")}
    base.update(OPENBLAS_NUM_THREADS=str(len(CPUS)), **env)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_SETUP) + textwrap.dedent(code)],
                         capture_output=True, text=True, timeout=120, env=base,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_helpers_get_cpus_of_their_own_and_a_run_the_first() -> None:
    lines = _python("""
        assert blas._done == [True], blas._done
        helpers = affinity._helpers
        assert len(helpers) == width - 1, helpers  # OpenBLAS's helpers: its threads but the caller's
        assert all(os.sched_getaffinity(t) == {affinity.helper_cpu(i)} for i, t in enumerate(helpers))
        workers = [t for t in threading.enumerate() if t.name.startswith("onnxtrain-worker")]
        for i, t in enumerate(workers):
            assert os.sched_getaffinity(t.native_id) == {affinity.helper_cpu(i)}
        assert cpus[0] not in {affinity.helper_cpu(i) for i in range(width - 1)}
        with affinity.placed(width):
            print(sorted(os.sched_getaffinity(0)))
        print(sorted(os.sched_getaffinity(0)))
        # a run of a plan: the calling thread is on the first CPU while the run lasts
        from onnx import TensorProto, helper
        seen = []
        real = affinity.os.sched_setaffinity
        affinity.os.sched_setaffinity = lambda pid, mask: (seen.append(sorted(mask)), real(pid, mask))
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
        g = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "g", [x], [y])
        plan = Plan(helper.make_model(g), threads=width)
        plan.run({"x": np.ones(4, np.float32)})
        print(seen)
    """)
    assert lines == [str([CPUS[0]]), str(CPUS), str([[CPUS[0]], CPUS])]


def test_runs_back_to_back_are_each_placed() -> None:
    # Skipping the pin of a run that starts soon after the thread's last placed run ended saved under 1 % of
    # the bench MLP's step and left the thread unplaced for whole runs under load (bench/HISTORY.md,
    # 2026-12-07 10:28): every run is placed, however close to the one before.
    lines = _python("""
        seen = []
        real = affinity.os.sched_setaffinity
        affinity.os.sched_setaffinity = lambda pid, mask: (seen.append(sorted(mask)), real(pid, mask))
        for _ in range(2):
            with affinity.placed(width):
                print(sorted(os.sched_getaffinity(0)))
        print(seen, sorted(os.sched_getaffinity(0)))
    """)
    assert lines == [str([CPUS[0]])] * 2 + [f"{[[CPUS[0]], CPUS] * 2} {CPUS}"]


@pytest.mark.parametrize("env", [{"ONNXTRAIN_PIN_THREADS": "0"}, {"MPI_LOCALNRANKS": "2"}])
def test_placement_off_by_request_and_among_mpi_ranks(env: dict[str, str]) -> None:
    lines = _python("""
        with affinity.placed(width):
            print(sorted(os.sched_getaffinity(0)))
        print(all(os.sched_getaffinity(t) == set(cpus) for t in affinity.thread_ids()))
    """, **env)
    assert lines == [str(CPUS), "True"]


def test_a_thread_its_owner_placed_stays_there_and_one_run_at_a_time_is_placed() -> None:
    lines = _python("""
        os.sched_setaffinity(0, {cpus[-1]})
        with affinity.placed(width):
            print(sorted(os.sched_getaffinity(0)))
        os.sched_setaffinity(0, set(cpus))
        got, go = [], threading.Event()

        def other_run():  # a second run at the same time, from a thread made before the first began
            go.wait()
            with affinity.placed(width):
                got.append(sorted(os.sched_getaffinity(0)))

        t = threading.Thread(target=other_run)
        t.start()
        with affinity.placed(width):
            go.set()
            t.join()
            print(sorted(os.sched_getaffinity(0)), got[0])
        with affinity.placed(width - 1):  # a narrower run leaves the thread as it is
            print(sorted(os.sched_getaffinity(0)))
    """)
    assert lines == [str([CPUS[-1]]), f"{[CPUS[0]]} {CPUS}", str(CPUS)]


def test_a_refused_placement_runs_the_block_where_it_is() -> None:
    lines = _python("""
        real = affinity.os.sched_setaffinity

        def refuse(pid, mask):
            raise OSError(22, "Invalid argument")

        affinity.os.sched_setaffinity = refuse
        ran = []
        with affinity.placed(width):
            ran.append(sorted(os.sched_getaffinity(0)))
        affinity.os.sched_setaffinity = real
        print(ran[0], affinity._pinned_runs[0])
    """)
    assert lines == [f"{CPUS} 0"]
