"""Review R4 of 296014a4 (the pipeline and horizontal sessions' replicas hand the half gradients' float32 sums
to the exchange, scaled by 1/(count·replicas) after the sum): under ZeRO-1 and allreduce with Adam (moments
and weights), and without replicas (a run of the cut session alone, no exchange), float16 and bfloat16
weights accumulated over three runs are one process's, bit for bit: weights and every moment.

Oracle: one process's TrainingSession accumulating every replica's micro-batches of the three runs before
its one update (``tests/parallel/test_review_r1_half_exchange.py``'s data). Before 296014a4 the ZeRO and
allreduce cases' moments differed (the replicas' means rounded to the half type twice); without replicas
nothing changed. Adasum (each replica steps with its own mean, combined by Adasum, not a mean) was checked by
hand to give the same bits before and after 296014a4 and is not repeated here.

Extended tier: two spawns (``mpiexec -n 4`` and ``-n 2``, about 10 s together)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.parallel.conftest import run_mpi
from tests.parallel.test_half_sums_cut import NP, STEPS, model
from tests.parallel.test_review_r1_half_exchange import one_process as one_process_sgd
from tests.tiers import extended

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LR = np.array([1e-3], np.float32)
# ranks → the exchanges run (None: no replicas)
EXCHANGES = {4: ("allreduce", "zero"), 2: (None,)}

SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import numpy as np
from mpi4py import MPI
from tests.parallel.test_review_r4_half_replicas import EXCHANGES, LR, session
from tests.parallel.test_review_r1_half_exchange import replica_feeds, steps
comm = MPI.COMM_WORLD
out = {{}}
for kind in ("float16", "bfloat16"):
    for mode in ("pipeline", "horizontal"):
        for exch in EXCHANGES[comm.size]:
            sess = session(kind, mode, exch)
            d = getattr(sess, "data_parallel_rank", 0)
            for feeds in steps(kind):
                sess.run(["loss"], {{**replica_feeds(feeds, d, comm.size // 2), "Learning_Rate": LR}})
            for k, v in sess.gather_state().items():
                out[f"{{kind}}.{{mode}}.{{exch}}.{{k}}.{{comm.rank}}"] = np.asarray(v).astype(np.float32)
parts = comm.gather(out, 0)
if comm.rank == 0:
    np.savez({folder!r} + "/state.npz", **{{k: v for p in parts for k, v in p.items()}})
"""


def session(kind: str, mode: str, exchange: str | None, accumulation: int = STEPS):
    """Adam without clipping (the norm's summation order is the cut sessions' own), accumulating over runs."""
    from onnxtrain import TrainingParameters, TrainingSession

    p = TrainingParameters()
    p.loss_output_name, p.training_optimizer_name = "loss", "AdamOptimizer"
    p.enable_grad_norm_clip = False
    p.gradient_accumulation_steps, p.gradient_accumulation_mode = accumulation, "auto"
    if mode == "pipeline":
        p.pipeline_parallel_size, p.pipeline_cut_info_string, p.num_pipeline_micro_batches = 2, "r", 2
    elif mode == "horizontal":
        p.horizontal_parallel_size = 2
    if exchange == "zero":
        p.deepspeed_zero_stage = 1
    return TrainingSession(model(kind).SerializeToString(), p)


def one_process(kind: str, replicas: int, micro: int) -> dict[str, np.ndarray]:
    """One process accumulating the same micro-batches with this file's Adam session."""
    return one_process_sgd(kind, replicas, micro, lambda k, n: session(k, "one", None, n), LR)


@pytest.fixture(scope="module", params=[extended(4, id="4"), extended(2, id="2")])
def ranks_state(request, tmp_path_factory) -> tuple[int, dict[str, np.ndarray]]:
    n = request.param
    folder = tmp_path_factory.mktemp(f"r4_half_replicas_{n}")
    script = folder / "worker.py"
    script.write_text(SCRIPT.format(root=ROOT, folder=str(folder)))
    proc = run_mpi(worker=str(script), n=n, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return n, dict(np.load(folder / "state.npz"))


@pytest.mark.mpi
@pytest.mark.parametrize("kind", list(NP))
@pytest.mark.parametrize("mode", ["pipeline", "horizontal"])
def test_half_adam_over_cut_replicas_is_one_process(ranks_state, mode: str, kind: str) -> None:
    n, state = ranks_state
    want = one_process(kind, n // 2, 2 if mode == "pipeline" else 1)
    assert any(k.startswith("Moment_") for k in want)
    for exch in EXCHANGES[n]:
        for rank in range(n):
            for k, v in want.items():
                key = f"{kind}.{mode}.{exch}.{k}.{rank}"
                assert key in state, key
                np.testing.assert_array_equal(state[key], v, err_msg=key)
