"""A legacy session without an optimizer (``training_optimizer_name = ""``, spec §4.4: no update, the
gradients read as outputs) exchanges nothing across ranks (spec §11: the exchange belongs to the optimizer
graph), so under ``mpiexec`` one rank alone may make and run one: rank 0 reading gradients or evaluating
while the others wait. onnxtrain's session compared the ranks' setups at start-up, a collective, for such a
session too: rank 0 waited in it until ONNXTRAIN_MPI_TIMEOUT ended the job (600 s by default).

Oracle: loss = mean(x·Wᵀ) over x [8, 5], W [1, 5], so dW is the batch mean of x (float64 numpy)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.parallel.conftest import run_mpi

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import numpy as np
from onnxtrain import TrainingParameters, TrainingSession
from onnxtrain.parallel import get_communicator
from tests.parallel.test_rank_local_sessions import batch, model
comm = get_communicator()
if comm.rank == 0:  # rank 0 alone reads the gradient of its batch
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = ""
    p.set_gradients_as_graph_outputs = True
    sess = TrainingSession(model(), p)
    grad = sess.run(["W_grad"], {{"x": batch()}})[0]
    np.save({folder!r} + "/grad.npy", grad)
comm.barrier("the other ranks wait for rank 0")
"""


def model() -> bytes:
    w0 = np.random.default_rng(0).standard_normal((1, 5)).astype(np.float32)
    g = helper.make_graph([helper.make_node("Gemm", ["x", "W"], ["lo"], transB=1),
                           helper.make_node("ReduceMean", ["lo"], ["loss"], keepdims=0)], "lin",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          [numpy_helper.from_array(w0, "W")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def batch() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((8, 5)).astype(np.float32)


@pytest.mark.mpi
def test_one_rank_alone_reads_gradients_from_a_session_without_optimizer(tmp_path) -> None:
    script = tmp_path / "rank0_only.py"
    script.write_text(SCRIPT.format(root=ROOT, folder=str(tmp_path)))
    proc = run_mpi(worker=str(script), timeout=120, env={"ONNXTRAIN_MPI_TIMEOUT": "30"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = batch().astype(np.float64).mean(axis=0, keepdims=True)
    np.testing.assert_allclose(np.load(tmp_path / "grad.npy"), want, rtol=1e-6, atol=1e-7)
