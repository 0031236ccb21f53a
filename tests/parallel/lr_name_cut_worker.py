"""``mpiexec -n 2 python lr_name_cut_worker.py`` (run by test_lr_name_cut): for a two-stage pipeline session
(cut "a": W on stage 0, G on stage 1) and a horizontally split session of test_legacy_ort116_unlisted_loss's
model, each case's lr_params_feed_name with Adam; prints, on rank 0, one JSON line: per mode and case, each
rank's refusal ("Class: message"), or the sums of |W| and |G| it holds after one step (lr 0.1) when it made
the session."""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from tests.session.test_legacy_ort116_unlisted_loss import _feeds, _model, _params  # noqa: E402

NAMES = ["Learning_Rate", "global_gradient_norm", "W_grad", "G_grad", "Moment_1_G", "Update_Count_W"]


def attempt(mode: str, lr: str) -> object:
    import onnxtrain

    p = onnxtrain.TrainingParameters()
    for k, v in _params("AdamOptimizer").items():
        setattr(p, k, v)
    p.lr_params_feed_name = lr
    if mode == "pipeline":
        p.pipeline_parallel_size, p.pipeline_cut_info_string = 2, "a"
    else:
        p.horizontal_parallel_size = 2
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            s = onnxtrain.TrainingSession(_model().SerializeToString(), p)
    except Exception as e:  # noqa: BLE001 (the class is part of the answer)
        return f"{type(e).__name__}: {e}"
    feeds = {**_feeds(0, False), lr: np.array([0.1], np.float32)}
    s.run(["yo"], feeds)
    return {k: float(np.abs(v).sum()) for k, v in s.get_state().items() if k in ("W", "G")}


def main() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    result = {f"{mode} {lr}": comm.gather(attempt(mode, lr), root=0)
              for mode in ("pipeline", "horizontal") for lr in NAMES}
    if comm.rank == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
