"""ZeRO stage 1 on a model of float16 or bfloat16 weights (no mixed precision) with clipping: the global
gradient norm that the ranks fetch, and that clips their updates, is the float32 norm one process and plain
allreduce compute (``norm_dtype``: float32 unless a weight is float64), not one rounded to the weights' half
type. Rounded, a bfloat16 norm is 0.13 % off (90624 for 90508), and a float16 norm above 65504 is inf: Adam
then clips every gradient to zero and the weights stop moving, where one process and allreduce train.

The model: W [1, K] of K = 8192 half weights, loss = mean(x·Wᵀ) over a batch of 16 rows x ≈ 1000, so the
gradient is the batch mean of x (each element about 1000, representable) and its norm about 90508 (float16's
largest value is 65504). Oracles, in this process: the float64 norm of the batch mean of x, and one process
on the whole batch for the weights."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper

from tests.parallel.conftest import run_mpi

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K = 8192
LR = 0.01
STEPS = 2
HALF = {"float16": (np.float16, TensorProto.FLOAT16), "bfloat16": (ml_dtypes.bfloat16, TensorProto.BFLOAT16)}

SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import numpy as np
from mpi4py import MPI
from tests.parallel.test_zero_half_norm import batch, train
rank = MPI.COMM_WORLD.rank
out = {{}}
for dtype in ("float16", "bfloat16"):
    for mode in ("allreduce", "zero"):
        norms, w = train(dtype, mode, batch(dtype)[8 * rank:8 * rank + 8])
        out[f"{{dtype}}/{{mode}}/norms"] = norms
        out[f"{{dtype}}/{{mode}}/W"] = w
np.savez({folder!r} + f"/rank{{rank}}.npz", **out)
"""


def model(dtype: str) -> bytes:
    np_type, onnx_type = HALF[dtype]
    w0 = (np.random.default_rng(0).standard_normal((1, K)) * 1e-4).astype(np_type).astype(np.float32)
    g = helper.make_graph([helper.make_node("Gemm", ["x", "W"], ["lo"], transB=1),
                           helper.make_node("ReduceMean", ["lo"], ["loss"], keepdims=0)], "half_norm",
                          [helper.make_tensor_value_info("x", onnx_type, ["N", K])],
                          [helper.make_tensor_value_info("loss", onnx_type, [])],
                          [helper.make_tensor("W", onnx_type, [1, K], w0.ravel().tolist())])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def batch(dtype: str, rows: int = 16) -> np.ndarray:
    x = 1000 + np.random.default_rng(1).standard_normal((rows, K)) * 30
    return x.astype(HALF[dtype][0])


def train(dtype: str, mode: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The norms fetched at each of ``STEPS`` Adam steps (clipping at 1) on ``x``, and W after them."""
    from onnxtrain import TrainingParameters, TrainingSession

    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "AdamOptimizer"
    p.optimizer_attributes_map = {"W": {"max_norm_clip": 1.0}}
    p.deepspeed_zero_stage = int(mode == "zero")
    sess = TrainingSession(model(dtype), p)
    norms = []
    for _ in range(STEPS):
        feeds = {"x": x, "Learning_Rate": np.array([LR], np.float32)}
        _, norm = sess.run(["loss", "global_gradient_norm"], feeds)
        norms.append(float(np.asarray(norm, np.float64).reshape(-1)[0]))
    return np.array(norms), sess.get_state()["W"].astype(np.float32)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, np.ndarray]]:
    folder = tmp_path_factory.mktemp("zero_half_norm")
    script = folder / "half_norm.py"
    script.write_text(SCRIPT.format(root=ROOT, folder=str(folder)))
    proc = run_mpi(worker=str(script), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [dict(np.load(folder / f"rank{r}.npz")) for r in range(2)]


def _oracle_norm(dtype: str) -> float:
    """The float64 norm of the gradient of mean(x·Wᵀ): the batch mean of x (the weights do not enter it)."""
    return float(np.linalg.norm(batch(dtype).astype(np.float64).mean(axis=0)))


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_allreduce_fetches_the_float32_norm_of_half_gradients(ranks, dtype: str) -> None:
    """The control: plain allreduce's norm is the float64 oracle's (half gradients, a float32 norm)."""
    want = _oracle_norm(dtype)
    for r in range(2):
        np.testing.assert_allclose(ranks[r][f"{dtype}/allreduce/norms"], want, rtol=1e-4, err_msg=f"rank {r}")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_zero_fetches_and_clips_by_the_float32_norm_of_half_gradients(ranks, dtype: str) -> None:
    want = _oracle_norm(dtype)
    whole = train(dtype, "allreduce", batch(dtype))[1]  # one process on the whole batch
    ulp = 2.0 ** (-10 if dtype == "float16" else -7)
    for r in range(2):
        norms = ranks[r][f"{dtype}/zero/norms"]
        np.testing.assert_allclose(norms, want, rtol=1e-4, err_msg=f"rank {r}: the fetched norm")
        np.testing.assert_allclose(ranks[r][f"{dtype}/zero/W"], whole, rtol=ulp, atol=ulp * 1e-4,
                                   err_msg=f"rank {r}: W after {STEPS} steps")
