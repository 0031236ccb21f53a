"""A pipeline session refuses, on every rank, a lr_params_feed_name that is the gradient name of a tensor its
stages pass on (``<t>_grad``: the stage graphs take the gradient of what a stage sent under that name; review
of 150efc5c). Before, both ranks made the session, and in the first run the stage that sent ``t`` took the
learning-rate feed as t's gradient (rank 0: "Gemm needs 2-D A and B, got shapes (3, 12) and (1,)"), which
aborted the job (a caller catching it left the other rank waiting in the pipeline's exchange). One process's
session trains with such a name, but onnxruntime-training 1.16.3 refuses any ``<v>_grad`` its backward
computes ("Duplicate definition of name (hr_grad)", measured with test_legacy_ort116_numerics' MLP). A
gradient name of a tensor the stages do not pass on still trains, to one process's weights (with the feed
named Learning_Rate)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.parallel.conftest import run_mpi
from tests.parallel.lr_name_boundary_grad_worker import attempt

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lr_name_boundary_grad_worker.py")


@pytest.fixture(scope="module")
def outcome() -> dict:
    r = run_mpi(n=2, worker=WORKER, timeout=150)  # (a rank waiting for one that refused hangs: killed)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["a a_grad", "y y_grad"])
def test_the_gradient_name_of_a_passed_tensor_is_refused_on_every_rank(outcome: dict, case: str) -> None:
    name = case.split()[1]
    for rank, got in enumerate(outcome[case]):
        assert isinstance(got, str), f"{case}: rank {rank} made its session and stepped"
        assert got.startswith("FailValueError") and f"lr_params_feed_name {name!r}" in got, got
        assert "pipeline" in got, got


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["a y_grad", "y a_grad"])
def test_another_gradient_name_trains_as_one_process(outcome: dict, case: str) -> None:
    ref = attempt(None, "Learning_Rate")  # (one process, in this process: no MPI)
    got = outcome[case]
    held = {}
    for rank, state in enumerate(got):
        assert isinstance(state, dict), f"{case}: rank {rank}: {state}"
        held.update(state)
    assert sorted(held) == ["G", "W"], held
    for k in ("W", "G"):
        np.testing.assert_allclose(np.array(held[k]), np.array(ref[k]), rtol=1e-6, atol=1e-7, err_msg=k)
        assert not np.allclose(np.array(ref[k]), np.array(_initial()[k])), k  # (the steps moved it)


def _initial() -> dict:
    from onnx import numpy_helper

    from tests.session.test_legacy_ort116_unlisted_loss import _model

    return {t.name: numpy_helper.to_array(t) for t in _model().graph.initializer}
