"""Pipeline and horizontal sessions sum float16/bfloat16 gradients in float32, as one process's accumulation
buffers do (spec §8.3): over the micro-batches of a run and over the micro-steps of an accumulation, the mean
cast back to the weight's type for the update. Oracle: one process accumulating the same micro-batches,
whose float32 sums ``tests/graph_transforms/test_half_weights.py`` checks against numpy's. The first and last
micro-steps' gradients cancel and the middle one's are 2^-8 of theirs: a sum kept in the half type loses a
tenth of what remains."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.parallel.conftest import run_mpi

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
ET = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
LR = np.array([100.0], np.float32)  # the mean step is about 1e-3: a change the weights' rounding keeps
STEPS = 3
MICRO = 2  # the pipeline's micro-batches per run

SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import numpy as np
from mpi4py import MPI
from tests.parallel.test_half_sums_cut import steps, session
rank = MPI.COMM_WORLD.rank
out = {{}}
for kind in ("float16", "bfloat16"):
    for mode in ("pipeline", "horizontal"):
        sess = session(kind, mode)
        for feeds in steps(kind):
            sess.run(["loss"], {{**feeds, "Learning_Rate": np.array([{lr}], np.float32)}})
        for k, v in sess.gather_state().items():
            out[f"{{kind}}.{{mode}}.{{k}}"] = v.astype(np.float32)
if rank == 0:
    np.savez({folder!r} + "/state.npz", **out)
"""


def model(kind: str) -> onnx.ModelProto:
    """loss = mean(relu(x·W1)·W2 * y): an MLP block (split by the horizontal session, cut at ``r`` by the
    pipeline), whose gradients scale with y."""
    rng = np.random.default_rng(0)
    et, half = ET[kind], NP[kind]
    ws = {"W1": (rng.standard_normal((4, 4)) * 0.5).astype(np.float32).astype(half),
          "W2": (rng.standard_normal((4, 3)) * 0.5).astype(np.float32).astype(half)}
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["o"]), helper.make_node("Mul", ["o", "y"], ["d"]),
             helper.make_node("ReduceMean", ["d"], ["loss"], keepdims=0)]
    g = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", et, ["N", 4]), helper.make_tensor_value_info("y", et, ["N", 3])],
        [helper.make_tensor_value_info("loss", et, [])],
        [numpy_helper.from_array(v, k) for k, v in ws.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def steps(kind: str) -> list[dict[str, np.ndarray]]:
    """Three runs' feeds: the third's gradients cancel the first's, the second's are 2^-8 of theirs."""
    rng = np.random.default_rng(4)
    half = NP[kind]
    x1, x2 = (rng.standard_normal((4, 4)).astype(np.float32).astype(half) for _ in range(2))
    y1, y2 = ((rng.standard_normal((4, 3)) * s).astype(np.float32).astype(half) for s in (1.0, 1 / 256))
    return [{"x": x, "y": y} for x, y in zip([x1, x2, x1], [y1, y2, -y1])]


def session(kind: str, mode: str, accumulation: int = STEPS):
    from onnxtrain import TrainingParameters, TrainingSession

    p = TrainingParameters()
    p.loss_output_name, p.training_optimizer_name = "loss", "SGDOptimizer"
    p.gradient_accumulation_steps, p.gradient_accumulation_mode = accumulation, "auto"
    if mode == "pipeline":
        p.pipeline_parallel_size, p.pipeline_cut_info_string, p.num_pipeline_micro_batches = 2, "r", MICRO
    elif mode == "horizontal":
        p.horizontal_parallel_size = 2
    elif mode == "zero":
        p.deepspeed_zero_stage = 1
    return TrainingSession(model(kind).SerializeToString(), p)


def one_process(kind: str, micro: int) -> dict[str, np.ndarray]:
    """One process accumulating every micro-batch of the three runs before its one update."""
    sess = session(kind, "one", STEPS * micro)
    for feeds in steps(kind):
        for k in range(micro):
            part = {n: np.split(v, micro)[k] for n, v in feeds.items()}
            sess.run(["loss"], {**part, "Learning_Rate": LR})
    return {k: v.astype(np.float32) for k, v in sess.get_state().items()}


@pytest.mark.mpi
def test_cut_sessions_sum_half_gradients_in_float32(tmp_path) -> None:
    script = tmp_path / "half_sums.py"
    script.write_text(SCRIPT.format(root=ROOT, folder=str(tmp_path), lr=float(LR[0])))
    proc = run_mpi(worker=str(script), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = np.load(tmp_path / "state.npz")
    for kind in NP:
        for mode, micro in (("pipeline", MICRO), ("horizontal", 1)):
            want = one_process(kind, micro)
            for w in ("W1", "W2"):
                key = f"{kind}.{mode}.{w}"
                np.testing.assert_array_equal(got[key], want[w], err_msg=key)
