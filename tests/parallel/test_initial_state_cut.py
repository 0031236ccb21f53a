"""The horizontally split session checks set_optimizer_initial_state's keys as one process's session does:
a key the optimizer keeps no state under (Adam's Moment_3, Lamb's shared Step given to Adam) is refused,
naming it, on every rank. It handed the state to its load_state, which skips names it does not hold, so it
trained from zero moments without a word. (onnxruntime-training 1.16.3 skips such keys too; onnxtrain refuses
them in one process, test_parameters' test_initial_optimizer_state_is_checked_by_name, and a script moved to
ranks keeps that. The pipeline session's checks: test_pipeline_refused_dumps.) A moment of another shape than
the weight's is refused on every rank too, as one process refuses it (review of b929b842, which left shapes to
load_state: it cut any array long enough along the split axis, so a [32, 8] moment of the [16, 8] W1 was taken
as rows 0-7 and 8-15 without a word); the whole moment is cut into the ranks' rows."""

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


@pytest.mark.mpi
@pytest.mark.parametrize("case,name,shape", [("moment_of_twice_the_rows", "Moment_1_W1", "[32, 8]"),
                                             ("moment_of_twice_the_columns", "Moment_1_W2", "[4, 32]")])
def test_a_moment_of_another_shape_is_refused_on_every_rank(outcome: dict, case: str, name: str,
                                                           shape: str) -> None:
    for rank, got in enumerate(outcome[case]):
        assert isinstance(got, str), f"{case}: rank {rank} made its session ({got})"
        assert got.startswith("FailValueError") and name in got and f"got {shape}" in got, got


@pytest.mark.mpi
def test_one_process_refuses_those_shapes() -> None:
    """(the oracle the cases above follow)"""
    import warnings

    import onnxtrain
    from tests.parallel.initial_state_cut_worker import CASES
    from tests.session.helpers import mlp_model, params

    weights = ("W1", "b1", "W2", "b2")
    for case in ("moment_of_twice_the_rows", "moment_of_twice_the_columns"):
        p = params("AdamOptimizer", optimizer_attributes_map={w: {} for w in weights},
                   optimizer_int_attributes_map={w: {} for w in weights})
        p.set_optimizer_initial_state(CASES[case])
        with warnings.catch_warnings(), pytest.raises(ValueError, match="expected shape"):
            warnings.simplefilter("ignore")
            onnxtrain.TrainingSession(mlp_model().SerializeToString(), p)


@pytest.mark.mpi
def test_the_whole_moment_is_cut_into_the_ranks_rows(outcome: dict) -> None:
    assert outcome["whole_moment"] == [[1, 0.0], [1, 64.0]]  # (Update_Count starts at 1)
