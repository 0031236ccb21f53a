"""A run on an empty batch leaves BatchNorm's running statistics as they were (torch's training-mode
BatchNorm does), in the sessions that run over MPI: a data-parallel rank fed an empty part keeps its own,
and pipeline stages and horizontal shares fed an empty batch keep theirs."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from onnx import numpy_helper

from tests.parallel.conftest import run_mpi
from tests.parallel.pipeline_worker import bn_blocks_model, bn_model

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "empty_batch_worker.py")


def _start(model) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _ran(tmp_path, mode: str) -> list[dict[str, np.ndarray]]:
    out = str(tmp_path / mode)
    r = run_mpi(out, mode, worker=WORKER, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return [dict(np.load(f"{out}.{k}.npz")) for k in range(2)]


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["pipe", "horizontal"])
def test_stages_and_shares_fed_an_empty_batch_keep_the_statistics(tmp_path, mode: str) -> None:
    start = _start(bn_blocks_model() if mode == "horizontal" else bn_model())
    bn = torch.nn.BatchNorm1d(8).train()
    bn(torch.zeros(0, 8))  # the oracle: torch's statistics do not move on an empty batch
    assert bn.running_mean.abs().max() == 0 and (bn.running_var == 1).all()
    held = 0
    for state in _ran(tmp_path, mode):
        for k in ("bn_mean", "bn_var", "bn1_mean", "bn1_var", "bn2_mean", "bn2_var"):
            if k in state:
                np.testing.assert_array_equal(state[k], start[k], err_msg=f"{mode}: {k}")
                held += 1
    assert held >= 4  # both ranks hold statistics


@pytest.mark.mpi
def test_a_data_parallel_rank_fed_an_empty_part_keeps_its_statistics(tmp_path) -> None:
    start = _start(bn_model())
    fed, empty = _ran(tmp_path, "dp")
    for k in ("bn1_mean", "bn1_var"):
        np.testing.assert_array_equal(empty[k], start[k], err_msg=k)
    # the rank fed a batch moves them as torch does from the same start (momentum 0.8: ONNX keeps 0.8 of
    # the old value, torch's momentum is the new value's share)
    w1 = numpy_helper.to_array(next(t for t in bn_model().graph.initializer if t.name == "W1"))
    h = torch.tensor(fed["x"]) @ torch.tensor(w1).T
    bn = torch.nn.BatchNorm1d(16, momentum=0.2).train()
    with torch.no_grad():
        bn.running_mean.copy_(torch.from_numpy(start["bn1_mean"]))
        bn.running_var.copy_(torch.from_numpy(start["bn1_var"]))
        bn(h)
    np.testing.assert_allclose(fed["bn1_mean"], bn.running_mean.numpy(), rtol=1e-5, atol=1e-6)
