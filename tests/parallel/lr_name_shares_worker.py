"""``mpiexec -n 2 python lr_name_shares_worker.py`` (run by test_lr_name_shares): a horizontally split
session (horizontal_parallel_size 2) of tests/session/helpers' MLP with Adam, each case's
lr_params_feed_name; prints, on rank 0, one JSON line: per case, each rank's refusal ("Class: message") or
"made"; for Learning_Rate, the whole weights (gather_state) after two steps (lr 0.05). ``attempt(name,
False)`` without MPI: one process's session of the same options, the test's reference."""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from tests.session.helpers import mlp_model, params  # noqa: E402

WEIGHTS = ("W1", "b1", "W2", "b2")
# names of one rank's shares (W1 and b1 split by columns, W2 by rows) and of values derived from them
NAMES = ["W1_column_rank_0", "W2_row_rank_1", "b1_column_rank_1", "W1_column_rank_0_grad",
         "Moment_1_W1_column_rank_1", "Update_Count_W2_row_rank_0"]


def attempt(lr: str, horizontal: bool = True) -> object:
    import onnxtrain

    kw = {"horizontal_parallel_size": 2} if horizontal else {}
    p = params("AdamOptimizer", optimizer_attributes_map={w: {} for w in WEIGHTS},
               optimizer_int_attributes_map={w: {} for w in WEIGHTS}, lr_params_feed_name=lr, **kw)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            s = onnxtrain.TrainingSession(mlp_model().SerializeToString(), p)
    except Exception as e:  # noqa: BLE001 (the class is part of the answer)
        return f"{type(e).__name__}: {e}"
    if lr != "Learning_Rate":
        return "made"  # (no step: a rank whose peer refused would wait in the step's exchange)
    rng = np.random.default_rng(3)
    for _ in range(2):
        s.run(["loss"], {"x": rng.standard_normal((6, 8)).astype(np.float32),
                         "y": rng.integers(0, 4, 6).astype(np.int64), lr: np.array([0.05], np.float32)})
    state = s.gather_state() if horizontal else s.get_state()
    return {w: np.asarray(state[w]).tolist() for w in WEIGHTS}


def main() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    result = {lr: comm.gather(attempt(lr), root=0) for lr in [*NAMES, "Learning_Rate"]}
    if comm.rank == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
