"""``mpiexec -n 2 python initial_state_cut_worker.py`` (run by test_initial_state_cut): makes a horizontally
split session (horizontal_parallel_size 2: W1's rows and W2's columns split) of tests/session/helpers' MLP
with Adam and each case's set_optimizer_initial_state; prints, on rank 0, one JSON line: per case, each
rank's refusal ("Class: message") or its Update_Count of W1 and the first value of W1's Moment_1 (the state
taken, under the share's name)."""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from tests.session.helpers import mlp_model, params  # noqa: E402

# case → set_optimizer_initial_state's argument; W1 is [16, 8], b1 [16], W2 [4, 16], b2 [4]
CASES = {
    "key_unknown": {"W1": {"Moment_3": np.zeros((16, 8), np.float32)}},
    "shared_step_for_adam": {"shared_optimizer_state": {"Step": np.array([3], np.int64)}},
    "control": {"W1": {"Update_Count": np.array([3], np.int64),
                       "Moment_1": np.full((16, 8), 0.25, np.float32)}},
    # a moment of another shape than the weight's (one process refuses it: 'expected shape [16, 8]')
    "moment_of_twice_the_rows": {"W1": {"Moment_1": np.full((32, 8), 0.25, np.float32)}},
    "moment_of_twice_the_columns": {"W2": {"Moment_1": np.full((4, 32), 0.25, np.float32)}},
    # the whole moment: each rank takes its rows (W1's first value on rank 1 is row 8's: 64)
    "whole_moment": {"W1": {"Moment_1": np.arange(128, dtype=np.float32).reshape(16, 8)}},
}


def attempt(initial: dict) -> object:
    import onnxtrain

    weights = ("W1", "b1", "W2", "b2")
    p = params("AdamOptimizer", horizontal_parallel_size=2, optimizer_attributes_map={w: {} for w in weights},
               optimizer_int_attributes_map={w: {} for w in weights})
    p.set_optimizer_initial_state(initial)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            s = onnxtrain.TrainingSession(mlp_model().SerializeToString(), p)
    except Exception as e:  # noqa: BLE001 (the class is part of the answer)
        return f"{type(e).__name__}: {e}"
    st = next(v for k, v in s.get_optimizer_state().items() if k.startswith("W1"))  # (its share's name)
    return [int(st["Update_Count"][0]), float(np.asarray(st["Moment_1"]).ravel()[0])]


def main() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    result = {case: comm.gather(attempt(initial), root=0) for case, initial in CASES.items()}
    if comm.rank == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
