"""Runs one of the README's MPI blocks on each rank (``mpiexec -n N python readme_mpi_worker.py CASE OUT``)
and saves what the rank got in ``OUT.rank<k>.npz``: the session's class name, its stage and the first run's
loss.

Cases: ``pipeline`` (the pipeline block, 2 ranks, on the test MLP cut at "hr") and ``staged_split`` (the
block of stages whose blocks are split, 4 ranks, on a two-layer transformer)."""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import onnxtrain  # noqa: E402
from tests.docs.test_readme_examples import block, readme_batch  # noqa: E402
from tests.session.helpers import mlp_model, params  # noqa: E402

PIPELINE = 'p.pipeline_cut_info_string = "hr"'
STAGED_SPLIT = "p.horizontal_parallel_size = 2"


def main(case: str, out: str) -> None:
    lr = np.array([1e-3], np.float32)
    p = params("AdamOptimizer")  # the legacy block's parameters: loss "loss", Adam
    if case == "pipeline":
        x, y = readme_batch(case)
        env = {"onnxtrain": onnxtrain, "p": p, "x": x, "y": y, "lr": lr,
               "model_bytes": mlp_model().SerializeToString()}
        exec(block(PIPELINE), env)  # noqa: S102 - the README's code
        sess, loss = env["sess"], env["loss"]
    else:
        from tests.docs.test_readme_examples import staged_split_model

        env = {"p": p}
        exec(block(STAGED_SPLIT), env)  # noqa: S102 - the README's code
        sess = onnxtrain.TrainingSession(staged_split_model().SerializeToString(), env["p"])
        x, y = readme_batch(case)
        (loss,) = sess.run(["loss"], {"x": x, "y": y, "Learning_Rate": lr})
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    np.savez(f"{out}.rank{rank}.npz", kind=type(sess).__name__, stage=getattr(sess, "stage", -1), loss=loss)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
