"""The sessions that cut the model refuse a lr_params_feed_name that their graphs define otherwise, on every
rank, as one process's session does (training_graph._check_learning_rate_clash; onnxruntime-training 1.16.3:
"Duplicate definition of name"): the global gradient norm their update graphs read (they trained with it as
the learning rate: |W| 31.74 after one step where it is 33.74), a trained weight's gradient (refused by the
stage holding the weight only, so the other rank went on alone and the job was killed), or optimizer state.
Before, the worker hung there (one rank refused, the other waited for it) until the timeout killed it."""

from __future__ import annotations

import json
import os

import pytest

from tests.parallel.conftest import run_mpi

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lr_name_cut_worker.py")
CLASHES = ["global_gradient_norm", "W_grad", "G_grad", "Moment_1_G", "Update_Count_W"]


@pytest.fixture(scope="module")
def outcome() -> dict:
    r = run_mpi(n=2, worker=WORKER, timeout=120)  # (a rank waiting for one that refused hangs: killed)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["pipeline", "horizontal"])
@pytest.mark.parametrize("name", CLASHES)
def test_a_name_the_graphs_define_is_refused_on_every_rank(outcome: dict, mode: str, name: str) -> None:
    for rank, got in enumerate(outcome[f"{mode} {name}"]):
        assert isinstance(got, str), f"{mode} {name}: rank {rank} made its session and stepped to {got}"
        assert got.startswith("FailValueError") and f"lr_params_feed_name {name!r}" in got, got


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["pipeline", "horizontal"])
def test_the_learning_rate_feed_trains(outcome: dict, mode: str) -> None:
    got = outcome[f"{mode} Learning_Rate"]
    assert all(isinstance(g, dict) and g for g in got), got
