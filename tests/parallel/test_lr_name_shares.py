"""A horizontally split session refuses, on every rank, a lr_params_feed_name naming one rank's share of a
split weight or a value derived from it (``W1_column_rank_0``, its gradient, its moments: review of
150efc5c, whose check before the split knows the model's names only). Before, the rank holding that share
refused it ("is an input of the model of shape [8, 8], not one value") and the other made its session, to
wait alone in the first step's exchange; a moment's name (``Moment_1_W1_column_rank_1``) was taken on both
ranks, and their steps hung. One process's session has no such names: with the feed named Learning_Rate
both agree (control)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from onnx import numpy_helper

from tests.parallel.conftest import run_mpi
from tests.parallel.lr_name_shares_worker import NAMES, WEIGHTS, attempt
from tests.session.helpers import mlp_model

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lr_name_shares_worker.py")


@pytest.fixture(scope="module")
def outcome() -> dict:
    r = run_mpi(n=2, worker=WORKER, timeout=150)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.mpi
@pytest.mark.parametrize("name", NAMES)
def test_a_share_name_is_refused_on_every_rank(outcome: dict, name: str) -> None:
    for rank, got in enumerate(outcome[name]):
        assert got != "made", f"{name}: rank {rank} made its session"
        assert got.startswith("FailValueError") and f"lr_params_feed_name {name!r}" in got, got
        assert "share" in got, got


@pytest.mark.mpi
def test_the_learning_rate_feed_trains_as_one_process(outcome: dict) -> None:
    ref = attempt("Learning_Rate", horizontal=False)
    w0 = {t.name: numpy_helper.to_array(t) for t in mlp_model().graph.initializer}
    for rank, got in enumerate(outcome["Learning_Rate"]):
        for w in WEIGHTS:
            np.testing.assert_allclose(np.array(got[w]), np.array(ref[w]), rtol=1e-5, atol=1e-6,
                                       err_msg=f"rank {rank} {w}")
            assert np.array(got[w]).shape == w0[w].shape and not np.allclose(got[w], w0[w])  # (moved)
