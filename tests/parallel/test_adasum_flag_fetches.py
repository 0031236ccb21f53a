"""``adasum_all_deltas_finite`` (an output of an Adasum session under mixed precision, spec §11.3) exists
only on an update step: a gradient-accumulation micro-step or a run on the fetches' path alone has no deltas.
Fetched there, the session must say so as for any output a micro-step does not compute (a ValueError naming
it, "not computed on a gradient-accumulation micro-step") and count no micro-step, so that the run can be
repeated without it. It raised a bare KeyError: 'adasum_all_deltas_finite' from the graph pruning
(model_for_outputs), which names neither the cause nor the run kind. A loop fetching the same list on every
run in the "auto" accumulation mode (loss, all_gradients_finite, adasum_all_deltas_finite) stopped at its
first micro-step, and ``run(None, feeds)`` (every output) failed on every run, the micro-step never counted.

The control: all_gradients_finite on the same micro-step is computed (the accumulated gradients' flag)."""

from __future__ import annotations

import os

import pytest

from tests.parallel.conftest import run_mpi

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import sys, json
sys.path.insert(0, {root!r})
import numpy as np
from onnxtrain import RunOptions, TrainingSession
from onnxtrain.parallel import split_batch, world
from tests.session.helpers import batches, mlp_model, params
rank = world().rank
kw = dict(gradient_accumulation_steps=2, gradient_accumulation_mode="auto", use_mixed_precision=True,
          enable_adasum=True)
sess = TrainingSession(mlp_model(din=10).SerializeToString(), params("AdamOptimizer", **kw))
path = RunOptions()
path.only_execute_path_to_fetches = True
got = {{}}
for i, (x, y) in enumerate(batches(2, 16, din=10)):
    feeds = {{"x": split_batch(x), "y": split_batch(y), "Learning_Rate": np.array([0.01], np.float32),
              sess.loss_scale_input_name: np.array([8.0], np.float32)}}
    if i == 0:
        for label, options in (("micro-step", None), ("path", path)):
            try:
                sess.run(["loss", "adasum_all_deltas_finite"], feeds, options)
                got[label] = "no error"
            except Exception as e:  # noqa: BLE001
                got[label] = type(e).__name__ + ": " + str(e)
        # the micro-step itself (a run the "auto" mode counts), with the control's flag
        got["control"] = bool(np.asarray(sess.run(["loss", "all_gradients_finite"], feeds)[1]).all())
    else:
        got["update"] = [bool(np.asarray(v).all()) for v in
                         sess.run(["adasum_all_deltas_finite", "all_gradients_finite"], feeds)]
sess = TrainingSession(mlp_model(din=10).SerializeToString(), params("AdamOptimizer", **kw))
got["outputs"] = len(sess.get_outputs())
for i, (x, y) in enumerate(batches(2, 16, din=10)):  # every output (output_names None), each run
    feeds = {{"x": split_batch(x), "y": split_batch(y), "Learning_Rate": np.array([0.01], np.float32),
              sess.loss_scale_input_name: np.array([8.0], np.float32)}}
    try:
        got[f"all outputs {{i}}"] = len(sess.run(None, feeds))
    except Exception as e:  # noqa: BLE001
        got[f"all outputs {{i}}"] = type(e).__name__ + ": " + str(e)
with open({folder!r} + f"/rank{{rank}}.json", "w") as fh:
    json.dump(got, fh)
"""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    import json

    folder = tmp_path_factory.mktemp("adasum_flag")
    script = folder / "flag.py"
    script.write_text(SCRIPT.format(root=ROOT, folder=str(folder)))
    proc = run_mpi(worker=str(script), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.mpi
def test_the_flags_of_an_update_step_and_the_control(ranks) -> None:
    for r, got in enumerate(ranks):
        assert got["control"] is True, r
        assert got["update"] == [True, True], r  # (the failed fetches counted no micro-step)


@pytest.mark.mpi
@pytest.mark.parametrize("label", ["micro-step", "path"])
def test_adasum_deltas_flag_off_an_update_step_is_refused_by_name(ranks, label: str) -> None:
    for r, got in enumerate(ranks):
        msg = got[label]
        assert msg.startswith("ValueError") and "adasum_all_deltas_finite" in msg, (r, msg)
        assert "micro-step" in msg, (r, msg)


@pytest.mark.mpi
def test_every_output_of_each_run(ranks) -> None:
    """``run(None, feeds)``: the micro-step returns every output but the deltas' flag, the update all of them
    (an allreduce session of the same options returned its 5 on both runs)."""
    for r, got in enumerate(ranks):
        assert got["all outputs 0"] == got["outputs"] - 1, (r, got["all outputs 0"])
        assert got["all outputs 1"] == got["outputs"], (r, got["all outputs 1"])
