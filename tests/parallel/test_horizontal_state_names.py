"""A horizontally split session's ``get_model_state()`` and ``get_optimizer_state()`` are keyed by the model's
weight names, each entry holding the rank's share (spec §5.3-5.4: "partition names are mapped back to the
original weight name; the value is the local shard"), as one process's session keys them. They were keyed by
the shares' names (``W1_column_rank_0``), so a script reading ``state["W1"]`` failed under the split.

Oracle: ``gather_state()`` holds the whole weights and moments under one process's names; each rank's entry
must be one of the two equal slices of it along the axis where the shapes differ."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.parallel.conftest import run_mpi

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import sys, json
sys.path.insert(0, {root!r})
import numpy as np
from onnxtrain import TrainingSession
from onnxtrain.parallel import get_communicator
from tests.session.helpers import batches, mlp_model, params
comm = get_communicator()
sess = TrainingSession(mlp_model(), params("AdamOptimizer", horizontal_parallel_size=2))
for x, y in batches(2, 8):
    sess.run(["loss"], {{"x": x, "y": y, "Learning_Rate": np.array([0.1], np.float32)}})
whole = sess.gather_state()
model = sess.get_model_state()["full_precision"]
opt = sess.get_optimizer_state()
np.savez({folder!r} + f"/rank{{comm.rank}}.npz", **{{"model/" + k: v for k, v in model.items()}},
         **{{f"opt/{{w}}/{{k}}": v for w, d in opt.items() for k, v in d.items()}},
         **{{"whole/" + k: v for k, v in whole.items()}})
"""


def _is_share(part: np.ndarray, whole: np.ndarray, rank: int) -> bool:
    """Whether ``part`` is slice ``rank`` of ``whole`` cut in two along the one axis where they differ (or
    ``whole`` itself, for a weight the split leaves whole)."""
    if part.shape == whole.shape:
        return np.array_equal(part, whole)
    axes = [a for a, (p, w) in enumerate(zip(part.shape, whole.shape)) if p != w]
    return len(axes) == 1 and np.array_equal(part, np.split(whole, 2, axis=axes[0])[rank])


@pytest.mark.mpi
def test_split_state_is_keyed_by_the_models_weight_names(tmp_path) -> None:
    script = tmp_path / "state_names.py"
    script.write_text(SCRIPT.format(root=ROOT, folder=str(tmp_path)))
    proc = run_mpi(worker=str(script), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    weights = {"W1", "b1", "W2", "b2"}
    for rank in range(2):
        got = np.load(tmp_path / f"rank{rank}.npz")
        model = {k[len("model/"):] for k in got.files if k.startswith("model/")}
        assert model == weights, json.dumps(sorted(got.files))
        opt = {k.split("/")[1] for k in got.files if k.startswith("opt/")}
        assert opt == weights, json.dumps(sorted(got.files))
        split = 0
        for w in sorted(weights):
            whole = got[f"whole/{w}"]
            assert _is_share(got[f"model/{w}"], whole, rank), (rank, w)
            split += got[f"model/{w}"].shape != whole.shape
            for key in ("Moment_1", "Moment_2"):
                assert _is_share(got[f"opt/{w}/{key}"], got[f"whole/{key}_{w}"], rank), (rank, w, key)
        assert split == 3, "W1, b1 and W2 are split; b2 stays whole"
