"""The horizontally split session checks set_optimizer_initial_state's keys as one process's session does:
a key the optimizer keeps no state under (Adam's Moment_3, Lamb's shared Step given to Adam) is refused,
naming it, on every rank. It handed the state to its load_state, which skips names it does not hold, so it
trained from zero moments without a word. (onnxruntime-training 1.16.3 skips such keys too; onnxtrain refuses
them in one process, test_parameters' test_initial_optimizer_state_is_checked_by_name, and a script moved to
ranks keeps that. The pipeline session's checks: test_pipeline_refused_dumps.)"""

from __future__ import annotations

import json
import os

import pytest

from tests.parallel.conftest import run_mpi

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "initial_state_cut_worker.py")


@pytest.fixture(scope="module")
def outcome() -> dict:
    r = run_mpi(n=2, worker=WORKER, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.mpi
@pytest.mark.parametrize("case,words", [("key_unknown", ["'Moment_3'", "'W1'"]),
                                        ("shared_step_for_adam", ["'Step'", "'shared_optimizer_state'"])])
def test_an_unknown_key_is_refused_on_every_rank(outcome: dict, case: str, words: list[str]) -> None:
    for rank, got in enumerate(outcome[case]):
        assert isinstance(got, str), f"{case}: rank {rank} made its session ({got})"
        assert got.startswith("FailValueError: set_optimizer_initial_state: no optimizer state"), got
        for word in words:
            assert word in got, (case, rank, got)


@pytest.mark.mpi
def test_a_valid_state_is_taken(outcome: dict) -> None:
    assert outcome["control"] == [[3, 0.25], [3, 0.25]]
