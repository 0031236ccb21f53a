"""Review M: a ``world_size`` or ``world_rank`` of ``TrainingParameters`` that MPI contradicts ends the job at
once (``mpiexec -n 2``), with an error naming the property and both numbers: the same wrong size on every
rank, ranks given different sizes, a size of 3 with pipeline stages or 4 with split layers, ranks' explicit
ranks swapped. No timeout is involved (the collective timeout is 600 s).

One case cannot fail at once: a rank given ``world_size = 1`` trains alone, as in onnxruntime (whose legacy
session never touched MPI then), while the others wait for it in the start-up check; only the collective
timeout ends that job. Telling it at once would need a collective in every session under ``mpiexec``, which a
rank training alone (or a session without an optimizer, which one rank may build alone) must not make. The
timeout's message names ``world_size`` (extended tier: it waits for a 3-second timeout).
onnxruntime's legacy session had no such check: built with MPI it replaced a ``world_size`` above 1 and a
``world_rank`` by MPI's, with a warning (orttraining_pybind_state.cc); the CPU wheel of 1.16.3, built without
MPI, refuses every ``world_size`` above 1 at construction ("Performing Allreduce is only supported using
NCCL"; Adasum: "ORT is not built with NCCL"), so it is no oracle for a run over MPI."""

from __future__ import annotations

import os
import time

import pytest

from tests.parallel.conftest import run_mpi
from tests.tiers import extended

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import numpy as np
from onnxtrain import TrainingSession
from onnxtrain.parallel import world
from tests.parallel.guard_worker import LR, data, model_bytes, params
case, rank = sys.argv[1], world().rank
p = params()
if case == "three":
    p.world_size = 3
elif case == "different":
    p.world_size = 4 if rank == 0 else 2
elif case == "pipeline":
    p.pipeline_parallel_size, p.pipeline_cut_info_string, p.num_pipeline_micro_batches = 2, "hr", 2
    p.world_size = 3
elif case == "horizontal":
    p.horizontal_parallel_size = 2
    p.world_size = 4
elif case == "swapped":
    p.world_rank = 1 - rank
elif case == "alone":
    p.world_size = 1 if rank == 1 else 2
s = TrainingSession(model_bytes(), p)
(x, y), _ = data()
s.run(["loss"], {{"x": x, "y": y, "Learning_Rate": LR}})
print(f"rank {{rank}} trained a step", flush=True)
"""

# case → (a rank's error, in the job's output)
FAST = {
    "three": "TrainingParameters.world_size=3 but mpiexec started 2 ranks",
    "different": "TrainingParameters.world_size=4 but mpiexec started 2 ranks",
    "pipeline": "TrainingParameters.world_size=3 but mpiexec started 2 ranks",
    "horizontal": "TrainingParameters.world_size=4 but mpiexec started 2 ranks",
    "swapped": "TrainingParameters.world_rank=1 but MPI says this is rank 0 of 2",
}


def _job(tmp_path, case: str, timeout: float = 60, env: dict | None = None):
    script = tmp_path / "world.py"
    script.write_text(SCRIPT.format(root=ROOT))
    t0 = time.perf_counter()
    r = run_mpi(case, worker=str(script), timeout=timeout, env=env)
    return r, time.perf_counter() - t0


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["three", "swapped", *(extended(c) for c in ("different", "pipeline",
                                                                             "horizontal"))])
def test_world_options_contradicting_mpi_end_the_job_at_once(tmp_path, case: str) -> None:
    r, took = _job(tmp_path, case)
    assert r.returncode != 0, r.stdout + r.stderr
    assert took < 20, f"{case}: the job took {took:.1f} s to end"
    want = FAST[case]
    if case == "swapped":  # either rank may be the first to abort the job
        assert want in r.stderr or "world_rank=0 but MPI says this is rank 1 of 2" in r.stderr, r.stderr
    else:
        assert want in r.stderr, r.stderr
    assert "trained a step" not in r.stdout, r.stdout


@pytest.mark.mpi
@pytest.mark.extended
def test_a_rank_training_alone_ends_the_job_at_the_timeout_naming_world_size(tmp_path) -> None:
    r, took = _job(tmp_path, "alone", env={"ONNXTRAIN_MPI_TIMEOUT": "3"})
    assert r.returncode != 0, r.stdout + r.stderr
    assert took < 30, f"the job took {took:.1f} s to end"
    assert "rank 1 trained a step" in r.stdout, r.stdout  # rank 1 alone, as in onnxruntime
    assert "TrainingParameters.world_size = 1 trains alone" in r.stderr, r.stderr
