"""``mpiexec -n 2 python lr_name_boundary_grad_worker.py`` (run by test_lr_name_boundary_grad): a two-stage
pipeline session of test_legacy_ort116_unlisted_loss's model (x → MatMul W = a → Add G = y → loss) whose
lr_params_feed_name is the gradient name of a tensor the stages pass on (``<t>_grad``, which the stage graphs
define), or of a tensor they do not pass on (control). Prints, on rank 0, one JSON line: per case, each
rank's refusal ("Class: message") or the W and G it holds after two Adam steps (lr 0.1). Without MPI
(``attempt(None, ...)``): one process's session, the test's reference."""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from tests.session.test_legacy_ort116_unlisted_loss import _feeds, _model, _params  # noqa: E402

# (cut, learning-rate feed name)
CASES = [("a", "a_grad"), ("y", "y_grad"), ("a", "y_grad"), ("y", "a_grad")]


def attempt(cut: str | None, lr: str) -> object:
    import onnxtrain

    p = onnxtrain.TrainingParameters()
    for k, v in _params("AdamOptimizer").items():
        setattr(p, k, v)
    p.lr_params_feed_name = lr
    if cut is not None:
        p.pipeline_parallel_size, p.pipeline_cut_info_string = 2, cut
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            s = onnxtrain.TrainingSession(_model().SerializeToString(), p)
    except Exception as e:  # noqa: BLE001 (the class is part of the answer)
        return f"{type(e).__name__}: {e}"
    for k in range(2):
        s.run(["yo"], {**_feeds(k, False), lr: np.array([0.1], np.float32)})
    return {k: v.tolist() for k, v in s.get_state().items() if k in ("W", "G")}


def main() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    result = {f"{cut} {lr}": comm.gather(attempt(cut, lr), root=0) for cut, lr in CASES}
    if comm.rank == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
