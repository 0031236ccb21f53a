"""``mpiexec -n 2 python float64_cut_worker.py MODE BACKEND OUT``: a float64 MLP (MSE, Adam with
``max_norm_clip``) in a 2-stage pipeline (MODE pipeline) or split horizontally (MODE horizontal), on the
numpy engine or onnxruntime (BACKEND); rank 0 saves the global norms it fetched."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from onnxtrain import SessionOptions, TrainingParameters, TrainingSession  # noqa: E402
from onnxtrain.parallel import world  # noqa: E402
from onnxtrain.testing import to_float64  # noqa: E402
from tests.session.helpers import batches, mlp_model  # noqa: E402


def train(mode: str, backend: str, rank: int = 0, size: int = 1) -> list[np.ndarray]:
    """The global norms of three steps (MODE "single": one process)."""
    model = to_float64(mlp_model(loss="mse"))
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "AdamOptimizer"
    p.optimizer_attributes_map = {t.name: {"max_norm_clip": 0.3} for t in model.graph.initializer if t.dims}
    if mode == "pipeline":
        p.pipeline_parallel_size, p.pipeline_cut_info_string, p.num_pipeline_micro_batches = 2, "hr", 2
    elif mode == "horizontal":
        p.horizontal_parallel_size = 2
    if mode != "single":
        p.world_size, p.world_rank = size, rank
    so = SessionOptions()
    if backend == "onnxruntime":
        so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    sess = TrainingSession(model.SerializeToString(), p, so)
    norms = []
    for x, y in batches(3, 4, loss="mse"):
        lr = np.array([0.1], np.float32)
        feeds = {"x": x.astype(np.float64), "y": y.astype(np.float64), "Learning_Rate": lr}
        norms.append(sess.run(["global_gradient_norm"], feeds)[0])
    return norms


def main() -> None:
    mode, backend, out = sys.argv[1:4]
    w = world()
    norms = train(mode, backend, w.rank, w.size)
    if w.rank == 0:
        np.savez(out, norms=np.stack(norms), dtypes=np.array([n.dtype.str for n in norms]))


if __name__ == "__main__":
    main()
