"""``mpiexec -n 2 python float64_worker.py MODE OUT``: a float64 model trained data-parallel (MODE
allreduce or zero, Adam with clipping) on half batches; rank 0 saves the norms fetched and the weights."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from onnxtrain import TrainingSession  # noqa: E402
from onnxtrain.parallel import split_batch, world  # noqa: E402
from tests.session.helpers import params  # noqa: E402
from tests.session.test_float64_models import W0, _batches  # noqa: E402


def _mean_model() -> onnx.ModelProto:
    """loss = mean((x·W)²) of float64, x [N, 3]: a mean, so that ranks averaging their half batches'
    gradients step as one process on the whole batch."""
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Mul", ["h", "h"], ["h2"]),
         helper.make_node("ReduceMean", ["h2"], ["loss"], keepdims=0)], "f64_mean",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["N", 3])],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        [numpy_helper.from_array(W0.copy(), "W")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def train(mode: str, rank: int = 0, size: int = 1) -> tuple[list[np.ndarray], np.ndarray]:
    """Norms fetched at each step and the weights after three steps (one process: MODE "single")."""
    kw = {} if mode == "single" else {"data_parallel_size": size, "world_size": size, "world_rank": rank}
    if mode == "zero":
        kw["deepspeed_zero_stage"] = 1
    p = params("AdamOptimizer", weights_to_train={"W"}, **kw)
    sess = TrainingSession(_mean_model().SerializeToString(), p)
    norms = []
    for x in _batches(3):
        part = x if mode == "single" else split_batch(x, rank, size)
        feeds = {"x": part, "Learning_Rate": np.array([0.1], np.float32)}
        _, norm = sess.run(["loss", "global_gradient_norm"], feeds)
        norms.append(norm)
    return norms, sess.get_state()["W"]


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    w = world()
    norms, weights = train(mode, w.rank, w.size)
    if w.rank == 0:
        dtypes = np.array([n.dtype.str for n in norms])
        np.savez(out, weights=weights, norms=np.stack(norms), norm_dtypes=dtypes)


if __name__ == "__main__":
    main()
