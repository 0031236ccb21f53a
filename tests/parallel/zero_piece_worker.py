"""``mpiexec -n 2 python zero_piece_worker.py OUT``: ZeRO stage 1 over weights W1 (31 values) and W2
(3 × 3): 40 values padded to 64, 32 a rank, so that rank 0's part ends with a one-element piece of W2.
Adam, three steps; each rank gathers the whole state and loads it into a fresh ZeRO session, rank 0 also
into a one-process session, and saves the results."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from onnxtrain import TrainingSession  # noqa: E402
from onnxtrain.parallel import split_batch, world  # noqa: E402
from tests.session.helpers import params  # noqa: E402

LR = np.array([0.05], np.float32)


def model_bytes() -> bytes:
    """loss = mean(((x · W1)[:, :3] @ W2 - y)²), x [N, 31], W1 [31], W2 [3, 3]."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Mul", ["x", "W1"], ["a"]),
             helper.make_node("Slice", ["a", "starts", "ends", "axes"], ["b"]),
             helper.make_node("MatMul", ["b", "W2"], ["c"]), helper.make_node("Sub", ["c", "y"], ["d"]),
             helper.make_node("Mul", ["d", "d"], ["e"]),
             helper.make_node("ReduceMean", ["e"], ["loss"], keepdims=0)]
    inits = [numpy_helper.from_array(rng.standard_normal(31).astype(np.float32), "W1"),
             numpy_helper.from_array(rng.standard_normal((3, 3)).astype(np.float32), "W2"),
             *(numpy_helper.from_array(np.array([v], np.int64), n) for n, v in
               (("starts", 0), ("ends", 3), ("axes", 1)))]
    vi = helper.make_tensor_value_info
    g = helper.make_graph(nodes, "zero_piece", [vi("x", TensorProto.FLOAT, ["N", 31]),
                                                vi("y", TensorProto.FLOAT, ["N", 3])],
                          [vi("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.standard_normal((8, 31)).astype(np.float32), rng.standard_normal((8, 3)).astype(np.float32)


def main() -> None:
    out = sys.argv[1]
    w = world()
    sess = TrainingSession(model_bytes(), params("AdamOptimizer", deepspeed_zero_stage=1))
    x, y = batch()
    for _ in range(3):
        sess.run(["loss"], {"x": split_batch(x, w.rank, w.size), "y": split_batch(y, w.rank, w.size),
                            "Learning_Rate": LR})
    full = sess.gather_state()
    result = {"update_count_w2": full["Update_Count_W2"], "update_count_w1": full["Update_Count_W1"]}
    try:
        TrainingSession(model_bytes(), params("AdamOptimizer", deepspeed_zero_stage=1)).load_state(full)
        result["zero_load"] = np.array(True)
    except Exception as e:  # noqa: BLE001 (reported to the test)
        result["zero_load"] = np.array(False)
        print(f"rank {w.rank}: {type(e).__name__}: {e}", file=sys.stderr)
    if w.rank == 0:
        one = TrainingSession(model_bytes(), params("AdamOptimizer", world_size=1))
        one.load_state(full)
        result["one_loss"] = one.run(["loss"], {"x": x, "y": y, "Learning_Rate": LR})[0]
    np.savez(f"{out}.{w.rank}.npz", **result)


if __name__ == "__main__":
    main()
