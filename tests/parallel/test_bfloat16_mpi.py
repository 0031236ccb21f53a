"""A model of bfloat16 weights trains under ``mpiexec -n 2`` in every data-parallel mode (MPI has no bfloat16
datatype: sums go through float32, copies move the bytes); it crashed in each. Also with two
micro-steps of gradient accumulation a rank (their sums are float32 there). Oracles, computed in this
process: one process on the whole batch (allreduce, ZeRO stage 1), and for Adasum each half's SGD step
combined by the float64 ``adasum_reference``."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper

from tests.parallel.conftest import run_mpi

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BF16 = ml_dtypes.bfloat16
LR = 0.1

SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import numpy as np
from mpi4py import MPI
from tests.parallel.test_bfloat16_mpi import batch, model, session
rank = MPI.COMM_WORLD.rank
out = {{}}
for mode in ("allreduce", "zero", "adasum"):
    for steps in (1, 2):  # with 2, two micro-steps of two rows each (float32 sums, spec 8.3)
        sess = session(mode, steps)
        x = batch()[4 * rank:4 * rank + 4]
        for part in np.split(x, steps):
            sess.run(["loss"], {{"x": part, "Learning_Rate": np.array([{lr}], np.float32)}})
        out[f"{{mode}}{{steps}}"] = sess.get_state()["W"].astype(np.float32)
np.savez({folder!r} + f"/rank{{rank}}.npz", **out)
"""


def model() -> bytes:
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((2, 3)).astype(np.float32)
    g = helper.make_graph([helper.make_node("Gemm", ["x", "W", "b"], ["lo"], transB=1),
                           helper.make_node("Mul", ["lo", "lo"], ["l2"]),
                           helper.make_node("ReduceMean", ["l2"], ["loss"], keepdims=0)], "t",
                          [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["N", 3])],
                          [helper.make_tensor_value_info("loss", TensorProto.BFLOAT16, [])],
                          [helper.make_tensor("W", TensorProto.BFLOAT16, [2, 3], w0.ravel().tolist()),
                           helper.make_tensor("b", TensorProto.BFLOAT16, [2], [0.5, 0.5])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def batch() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((8, 3)).astype(BF16)


def session(mode: str, steps: int = 1):
    from onnxtrain import TrainingParameters, TrainingSession

    p = TrainingParameters()
    p.gradient_accumulation_steps = steps
    p.gradient_accumulation_mode = "auto"
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    p.deepspeed_zero_stage = int(mode == "zero")
    p.enable_adasum = mode == "adasum"
    return TrainingSession(model(), p)


def _step(x: np.ndarray) -> np.ndarray:
    """W after one SGD step of one process on ``x``, as float32."""
    sess = session("allreduce")
    sess.run(["loss"], {"x": x, "Learning_Rate": np.array([LR], np.float32)})
    return sess.get_state()["W"].astype(np.float32)


@pytest.mark.mpi
def test_bfloat16_weights_train_in_every_data_parallel_mode(tmp_path) -> None:
    from onnxtrain.parallel.adasum import adasum_reference

    script = tmp_path / "bf16.py"
    script.write_text(SCRIPT.format(root=ROOT, folder=str(tmp_path), lr=LR))
    proc = run_mpi(worker=str(script))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    w0 = session("allreduce").get_state()["W"].astype(np.float64)
    whole = _step(batch())
    halves = [_step(batch()[4 * r:4 * r + 4]).astype(np.float64) for r in range(2)]
    combined = w0 + adasum_reference([[h - w0] for h in halves])[0]
    ulp = 2.0 ** -7  # bfloat16's relative spacing
    for mode, want in (("allreduce", whole), ("zero", whole), ("adasum", combined)):
        for key in (f"{mode}1", f"{mode}2"):
            for r in range(2):
                np.testing.assert_allclose(got[r][key], want, rtol=ulp, atol=ulp / 8,
                                           err_msg=f"{key} rank {r}")
            np.testing.assert_array_equal(got[0][key], got[1][key])
