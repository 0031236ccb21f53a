"""Review R5 of 11b96cdb: the legacy session's dumps keep the user's model's producer name and version, as
onnxruntime-training 1.16.3's do (tests/session/test_review_r2_dump_producer.py), and the README says a
pipeline stage's dumps are written as the single-process session's. A two-stage pipeline session's stage
dumps (``<root>.stage<k>.onnx``) did not follow: stage 0's gradient, training and optimized dumps named
onnxtrain 0.1.0, the rest an empty producer (now session.described_as, as the single-process dumps).
1.16.3's CPU wheel runs no pipeline (no world size above 1), so the oracle is the single-process session's
rule."""

from __future__ import annotations

import json
import os

import pytest

from tests.parallel.conftest import run_mpi

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "review_r5_stage_dumps_worker.py")


@pytest.mark.mpi
def test_stage_dumps_keep_the_models_producer(tmp_path) -> None:
    r = run_mpi(str(tmp_path), n=2, worker=WORKER, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(found) == sorted(f"{root}.stage{k}.onnx" for root in ("gradient", "optimized", "training",
                                                                       "transformed") for k in (0, 1))
    assert {name: tuple(f) for name, f in found.items() if f != ["pytorch", "2.13.0"]} == {}
