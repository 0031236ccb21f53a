"""Run under ``mpiexec -n 2``: a training run on an empty batch leaves BatchNorm's running statistics as they
were, as torch does, in the data-parallel, pipeline and horizontal sessions.

``python empty_batch_worker.py OUT MODE`` (MODE ``dp``, ``pipe`` or ``horizontal``) builds the session,
runs one step (data parallel: rank 0 fed a batch of 4, rank 1 an empty one; the others: every rank fed an
empty batch) and writes each rank's state after it to ``OUT.<rank>.npz``."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from onnxtrain import TrainingParameters, TrainingSession  # noqa: E402
from onnxtrain.parallel import world  # noqa: E402
from tests.parallel.pipeline_worker import bn_blocks_model, bn_model  # noqa: E402


def main(out: str, mode: str) -> None:
    model = bn_blocks_model() if mode == "horizontal" else bn_model()
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    if mode == "dp":
        p.data_parallel_size = 2
    elif mode == "pipe":
        p.pipeline_parallel_size = 2
        p.pipeline_cut_info_string = "hr"
        p.num_pipeline_micro_batches = 2
    else:
        p.horizontal_parallel_size = 2
    sess = TrainingSession(model.SerializeToString(), p)
    rank = world().rank
    rows = 4 if mode == "dp" and rank == 0 else 0
    x = np.random.default_rng(rank).standard_normal((rows, 8)).astype(np.float32)
    sess.run(None, {"x": x, "y": np.zeros(rows, np.int64), "Learning_Rate": np.array([0.1], np.float32)})
    np.savez(f"{out}.{rank}.npz", x=x, **sess.get_state())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
