"""``sliced_axes`` of an input the model declares without a shape (review of 4d6c0533): the session can only
check its axis against the array fed, when a run cuts it into micro-batches. An axis outside the fed array's
rank must be refused there, on every rank, naming ``sliced_axes`` and the input, as the declared rank is
refused when the session is made; it raised a bare ``IndexError: tuple index out of range`` from
``MicroBatching._slice`` on both ranks. ``mpiexec -n 2``; a valid axis runs (control)."""

from __future__ import annotations

import json
import os

import pytest

from tests.parallel.conftest import run_mpi

_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
from onnxtrain import TrainingParameters, TrainingSession
from onnxtrain.parallel import world
from tests.session.helpers import mlp_model

model = mlp_model()
next(v for v in model.graph.input if v.name == "x").type.tensor_type.ClearField("shape")
x = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
feeds = {"x": x, "y": np.zeros(8, np.int64), "Learning_Rate": np.array([0.1], np.float32)}
got = {}
for case, axes in (("x_axis_2", {"x": 2}), ("x_axis_minus_3", {"x": -3}), ("control", {"x": 0})):
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    p.pipeline_parallel_size = 2
    p.pipeline_cut_info_string = "hr"
    p.num_pipeline_micro_batches = 2
    p.sliced_axes = axes
    sess = TrainingSession(model.SerializeToString(), p)
    try:
        (loss,) = sess.run(["loss"], feeds)
        got[case] = ["ran", float(loss)]
    except Exception as e:
        got[case] = ["run", f"{type(e).__name__}: {e}"]
with open(f"{sys.argv[2]}/rank{world().rank}.json", "w") as f:
    json.dump(got, f)
"""


@pytest.fixture(scope="module")
def outcome(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("shapeless")
    script = folder / "shapeless.py"
    script.write_text(_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = run_mpi(root, str(folder), n=2, timeout=300, worker=str(script), env={"ONNXTRAIN_MPI_TIMEOUT": "60"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads((folder / f"rank{k}.json").read_text()) for k in (0, 1)]


@pytest.mark.mpi
def test_a_valid_axis_runs_on_both_ranks(outcome: list[dict]) -> None:
    """Control: x cut along its axis 0 (the batch) runs, both ranks returning the last micro-batch's loss."""
    runs = [got["control"] for got in outcome]
    assert all(kind == "ran" for kind, _ in runs), runs
    assert runs[0] == runs[1], runs


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["x_axis_2", "x_axis_minus_3"])
def test_an_axis_outside_the_fed_rank_is_refused_by_name(outcome: list[dict], case: str) -> None:
    for rank, got in enumerate(outcome):
        kind, text = got[case]
        assert kind == "run", (rank, got[case])
        assert text.startswith("ValueError"), (rank, text)
        assert "sliced_axes" in text and "'x'" in text, (rank, text)
