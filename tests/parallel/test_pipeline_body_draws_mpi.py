"""End to end under ``mpiexec -n 2``: a pipeline whose ``If`` draws in its branch (an unseeded ``Dropout``)
and whose drawn value both stages read. :func:`onnxtrain.parallel.pipeline.partition` must run the ``If``
once, in stage 0, and send its value; copied into both stages, each rank drew its own mask and the loss and
the update mixed two draws of one tensor. Oracle: numpy in float64 on the fetched mask's values (the forward
and SGD's gradients of ``loss = mean((tanh(x·W + n)·V + n)²)`` by hand), the weights fetched before each
step."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from tests.parallel.conftest import run_mpi


def dropout_model(seed: int | None = None) -> onnx.ModelProto:
    """n = If(c) then Dropout(x, 0.5, training) else x (a graph output too); h = x·W + n; t = tanh(h) (the
    cut); loss = mean((t·V + n)²): n is read in both stages."""
    rng = np.random.default_rng(0)
    w, v = 0.5 * rng.standard_normal((8, 8)), 0.5 * rng.standard_normal((8, 8))
    extra = {} if seed is None else {"seed": seed}
    drop = helper.make_node("Dropout", ["x", "ratio", "on"], ["n_then"], **extra)
    then_g = helper.make_graph([drop], "then", [], [helper.make_tensor_value_info("n_then", T.DOUBLE, None)])
    else_g = helper.make_graph([helper.make_node("Identity", ["x"], ["n_else"])], "else", [],
                               [helper.make_tensor_value_info("n_else", T.DOUBLE, None)])
    nodes = [
        helper.make_node("Constant", [], ["ratio"], value=helper.make_tensor("r", T.DOUBLE, [], [0.5])),
        helper.make_node("Constant", [], ["on"], value=helper.make_tensor("o", T.BOOL, [], [True])),
        helper.make_node("Constant", [], ["c"], value=helper.make_tensor("cv", T.BOOL, [], [True])),
        helper.make_node("If", ["c"], ["noise"], then_branch=then_g, else_branch=else_g),
        helper.make_node("MatMul", ["x", "W"], ["h0"]),
        helper.make_node("Add", ["h0", "noise"], ["h"]),
        helper.make_node("Tanh", ["h"], ["t"]),
        helper.make_node("MatMul", ["t", "V"], ["g0"]),
        helper.make_node("Add", ["g0", "noise"], ["g"]),
        helper.make_node("Mul", ["g", "g"], ["gg"]),
        helper.make_node("ReduceMean", ["gg"], ["loss"], keepdims=0),
    ]
    g = helper.make_graph(nodes, "body_dropout", [helper.make_tensor_value_info("x", T.DOUBLE, ["N", 8])],
                          [helper.make_tensor_value_info("loss", T.DOUBLE, []),
                           helper.make_tensor_value_info("noise", T.DOUBLE, ["N", 8])],
                          [numpy_helper.from_array(w, "W"), numpy_helper.from_array(v, "V")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
from onnxtrain import TrainingParameters, TrainingSession
from onnxtrain.parallel import world
from tests.parallel.test_pipeline_body_draws_mpi import dropout_model

rng = np.random.default_rng(1)
batches = [rng.standard_normal((6, 8)) for _ in range(3)]
lr = np.array([0.1], np.float32)
p = TrainingParameters()
p.loss_output_name = "loss"
p.training_optimizer_name = "SGDOptimizer"
p.pipeline_parallel_size, p.pipeline_cut_info_string, p.num_pipeline_micro_batches = 2, "t", 1
seed = int(sys.argv[3]) if len(sys.argv) > 3 else None
sess = TrainingSession(dropout_model(seed).SerializeToString(), p)
steps = []
for x in batches:
    before = sess.gather_state()
    loss, noise = sess.run(["loss", "noise"], {"x": x, "Learning_Rate": lr})
    steps.append({"x": x.tolist(), "loss": float(loss), "noise": np.asarray(noise).tolist(),
                  "W": before["W"].tolist(), "V": before["V"].tolist()})
after = sess.gather_state()
if world().rank == 0:
    with open(sys.argv[2], "w") as f:
        json.dump({"steps": steps, "W": after["W"].tolist(), "V": after["V"].tolist()}, f)
"""


def _oracle(x, n, w, v, lr):
    """The loss and the weights after one SGD step, by hand in float64."""
    t = np.tanh(x @ w + n)
    g = t @ v + n
    loss = np.mean(g * g)
    dg = 2 * g / g.size
    dv = t.T @ dg
    dw = x.T @ ((dg @ v.T) * (1 - t * t))
    return loss, w - lr * dw, v - lr * dv


@pytest.mark.mpi
@pytest.mark.parametrize("seed", [None, 3])
def test_an_if_drawing_in_its_branch_draws_once_for_both_stages(tmp_path, seed: int | None) -> None:
    """Unseeded, each rank's copy drew from its own entropy (failed before 3347418b). Seeded, both copies
    drew the same values (their generators start from one seed and advance once a micro-batch), so that
    case passed before too: it checks that the seeded draw continues from step to step."""
    script = tmp_path / "body_draws.py"
    script.write_text(_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "out.json"
    args = (root, str(out)) if seed is None else (root, str(out), str(seed))
    r = run_mpi(*args, n=2, timeout=300, worker=str(script), env={"ONNXTRAIN_MPI_TIMEOUT": "60"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(out.read_text())
    lr = float(np.float32(0.1))
    steps = got["steps"]
    for k, s in enumerate(steps):
        x, n = np.asarray(s["x"]), np.asarray(s["noise"])
        dropped = n == 0
        assert 0 < dropped.sum() < n.size, k  # the mask drops some values, not all
        np.testing.assert_allclose(n[~dropped], 2 * x[~dropped], rtol=1e-15, err_msg=f"step {k}")
        loss, w, v = _oracle(x, n, np.asarray(s["W"]), np.asarray(s["V"]), lr)
        np.testing.assert_allclose(s["loss"], loss, rtol=1e-12, err_msg=f"step {k}: the loss")
        nxt = steps[k + 1] if k + 1 < len(steps) else got
        np.testing.assert_allclose(nxt["W"], w, rtol=1e-12, atol=1e-14, err_msg=f"step {k}: W")
        np.testing.assert_allclose(nxt["V"], v, rtol=1e-12, atol=1e-14, err_msg=f"step {k}: V")
    # each step drew a new mask
    assert not np.array_equal(np.asarray(steps[0]["noise"]) == 0, np.asarray(steps[1]["noise"]) == 0)
