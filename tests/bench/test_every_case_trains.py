"""Every bench model trains in onnxtrain's peers: the worker processes of `python -m bench` (legacy session
and on-device API) take two steps on each case, and their first losses equal torch's on the same batch
(torch's peer runs in this process: the same step function as its worker's, without a second import of
torch).

`--quick` runs only two of the cases, so a model the full run needs could break unseen (the GPT decoder's
on-device peer did, refused by an input check); this runs all of them, briefly, each in one peer by default
and in both with ONNXTRAIN_FULL_TESTS=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from bench import models, worker  # noqa: E402
from tests.tiers import covering  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _first_losses(peer: str, folder: str) -> list[float]:
    """The losses of a peer's first two steps, from its worker process."""
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "worker.py"), peer, folder],
        input="run 2\nstats\nquit\n", capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    replies = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    ok = proc.returncode == 0 and replies and "error" not in replies[0]
    assert ok, (peer, proc.stdout, proc.stderr[-3000:])
    return replies[-1]["first_losses"]


def _torch_losses(folder: str) -> list[float]:
    """The losses of torch's first two steps, by the worker's torch peer in this process."""
    step, _ = worker.torch_peer(folder)
    return [float(step(x, y)) for x, y in worker._batches(folder)[:2]]


# The default suite runs each case in one of the two peers, alternately (the GPT decoder in the on-device
# one), ONNXTRAIN_FULL_TESTS=1 in both (tests/tiers.py).
@pytest.mark.parametrize("case,peer", covering(models.ALL_CASES, ["api", "legacy"], strength=1),
                         ids=lambda v: getattr(v, "key", None))
def test_bench_case_trains_in_every_onnxtrain_peer(case, peer, tmp_path) -> None:
    folder = str(tmp_path / case.key)  # the torch peer finds its model by the folder's name
    models.prepare(case, folder)
    want = _torch_losses(folder)
    got = _first_losses(peer, folder)
    assert len(got) == 2
    assert got[0] == pytest.approx(want[0], rel=1e-5), peer  # the same weights and batch
    assert got[1] == pytest.approx(want[1], rel=2e-3), peer  # after one AdamW step
