"""Review R2: the cut legacy sessions (pipeline stages, a horizontal split; ``mpiexec -n 2``) refuse and warn
of what one process's session refuses and warns of (review G's c52c02da and 64ce18c6 fixed one process's
session only; d4e8aa4b's config entries are checked here too, they pass through TrainingSession.__init__).

- ``lr_params_feed_name = "loss_scale"`` under mixed precision: the stages and ranks took the one feed as both
  the learning rate and the loss scale, so a run fed loss scale 256 and learning rate 0.05 made an SGD step of
  lr 256 (the weights moved by 33-66, 5120 times the 0.0064-0.013 of the same step with the rate named
  otherwise). Refused now on every rank, naming the property and the input, as one process refuses it.
- ``max_norm_clip`` in ``optimizer_attributes_map`` that nothing clips by (enable_grad_norm_clip=False, or
  legacy_cpu_adam, onnxruntime's CPU Adam): one process's session warns, the cut sessions said nothing.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.parallel.conftest import run_mpi

pytestmark = pytest.mark.mpi

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "review_r2_cut_worker.py")
CASES = {"pipeline": "adam2_mp_clip", "horizontal": "adam_h2_mp_gelu"}


@pytest.fixture(scope="module", params=list(CASES))
def results(request, tmp_path_factory) -> list[dict]:
    out = str(tmp_path_factory.mktemp(request.param) / "out")
    r = run_mpi(out, CASES[request.param], n=2, timeout=240, worker=WORKER,
                env={"ONNXTRAIN_MPI_TIMEOUT": "60"})
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.load(open(f"{out}.{rank}.json")) for rank in range(2)]


def test_learning_rate_named_as_the_loss_scale_is_refused_on_every_rank(results) -> None:
    for rank in results:
        error = rank["lr_is_loss_scale"]["error"]
        assert error is not None and "lr_params_feed_name 'loss_scale' names the loss scale input" in error, \
            (error, rank["lr_is_loss_scale"]["change"])
        fine = rank["lr_named_otherwise"]  # (the refusal is not over-broad: the rate named otherwise trains)
        assert fine["error"] is None and 0 < fine["change"] < 0.1, fine


def test_max_norm_clip_that_nothing_clips_by_is_named(results) -> None:
    for rank in results:
        for check, why in (("clip_without_norm_clip", "enable_grad_norm_clip=False"),
                           ("clip_under_cpu_adam", "legacy_cpu_adam")):
            said = [w for w in rank[check]["warnings"] if "max_norm_clip" in w]
            assert rank[check]["error"] is None and len(said) == 1 and why in said[0] and "'W1'" in said[0], \
                (check, rank[check])
        assert not [w for w in rank["clip_used"]["warnings"] if "max_norm_clip" in w], rank["clip_used"]


def test_config_entries_the_numpy_engine_cannot_honour(results) -> None:
    """d4e8aa4b's warning and refusal reach the cut sessions (they construct through TrainingSession)."""
    for rank in results:
        said = rank["denormal_as_zero"]["warnings"]
        assert any("session.set_denormal_as_zero" in w for w in said), said
        error = rank["no_cpu_fallback"]["error"]
        assert error is not None and "session.disable_cpu_ep_fallback" in error, error
