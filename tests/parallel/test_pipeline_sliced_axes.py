"""``sliced_axes`` is checked when a pipeline session is made, on every rank, naming the option: a key that is
no input of the model (a typo; ``sliced_tensor_names`` and ``sliced_schema`` are refused for one), and an axis
outside the input's rank. Only the stage whose graphs declare the input checked its axis (stage 0 for ``x``,
stage 1 for the labels ``y``), when building them; the other rank made its session and failed in its first
run with a bare ``IndexError: tuple index out of range`` from ``MicroBatching._slice``. An unknown key was
taken without a word (the input it meant was cut along axis 0).

An input the model declares without a shape (review of 4d6c0533) can only have its axis checked against the
array fed, when a run cuts it into micro-batches: an axis outside that array's rank must be refused there, on
every rank, naming ``sliced_axes`` and the input; it raised the bare ``IndexError`` on both ranks."""

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

shapeless = mlp_model()  # x declared without a shape: its axis is checked against the array fed
next(v for v in shapeless.graph.input if v.name == "x").type.tensor_type.ClearField("shape")
got = {}
x = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
feeds = {"x": x, "y": np.zeros(8, np.int64), "Learning_Rate": np.array([0.1], np.float32)}
for case, axes in (("x_axis_2", {"x": 2}), ("x_axis_minus_3", {"x": -3}), ("y_axis_1", {"y": 1}),
                   ("unknown_key", {"X": 0}), ("control", {"x": 0, "y": 0}),
                   ("shapeless_x_axis_2", {"x": 2}), ("shapeless_x_axis_minus_3", {"x": -3}),
                   ("shapeless_control", {"x": 0})):
    model = shapeless if case.startswith("shapeless") else mlp_model()
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    p.pipeline_parallel_size = 2
    p.pipeline_cut_info_string = "hr"
    p.num_pipeline_micro_batches = 2
    p.sliced_axes = axes
    try:
        sess = TrainingSession(model.SerializeToString(), p)
    except Exception as e:
        got[case] = ["made", f"{type(e).__name__}: {e}"]
        continue
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
    folder = tmp_path_factory.mktemp("sliced")
    script = folder / "sliced_axes.py"
    script.write_text(_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = run_mpi(root, str(folder), n=2, timeout=300, worker=str(script), env={"ONNXTRAIN_MPI_TIMEOUT": "60"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads((folder / f"rank{k}.json").read_text()) for k in (0, 1)]


@pytest.mark.mpi
def test_the_control_runs_on_both_ranks(outcome: list[dict]) -> None:
    losses = [got["control"] for got in outcome]
    assert all(kind == "ran" for kind, _ in losses), losses
    assert losses[0][1] == losses[1][1]


@pytest.mark.mpi
@pytest.mark.parametrize("case,words", [("x_axis_2", ["sliced_axes", "'x'"]),
                                        ("x_axis_minus_3", ["sliced_axes", "'x'"]),
                                        ("y_axis_1", ["sliced_axes", "'y'"]),
                                        ("unknown_key", ["sliced_axes", "'X'"])])
def test_a_bad_sliced_axes_is_refused_on_every_rank(outcome: list[dict], case: str, words: list[str]) -> None:
    for rank, got in enumerate(outcome):
        kind, what = got[case]
        assert kind == "made", f"{case}: rank {rank} made its session, then {kind}: {what}"
        assert what.startswith(("ValueError", "FailValueError")), (case, rank, what)
        for w in words:
            assert w in what, (case, rank, what)


@pytest.mark.mpi
def test_a_valid_axis_of_a_shapeless_input_runs_on_both_ranks(outcome: list[dict]) -> None:
    runs = [got["shapeless_control"] for got in outcome]
    assert all(kind == "ran" for kind, _ in runs), runs
    assert runs[0] == runs[1], runs


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["shapeless_x_axis_2", "shapeless_x_axis_minus_3"])
def test_a_shapeless_inputs_axis_outside_the_fed_rank_is_refused(outcome: list[dict], case: str) -> None:
    for rank, got in enumerate(outcome):
        kind, text = got[case]
        assert kind == "run", (rank, got[case])
        assert text.startswith("ValueError"), (rank, text)
        assert "sliced_axes" in text and "'x'" in text, (rank, text)
