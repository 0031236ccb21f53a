"""Horizontal (Megatron) parallelism, ``mpiexec -n 2``: a random node outside the split blocks runs whole on
every rank of a replica, so the ranks must draw the same values (``HorizontalSession._seed_random_nodes``
gives each unseeded one a seed they agree on). An ``If`` whose branch draws (an unseeded ``Dropout``) ahead of
the block is such a node too, but only the graph's own nodes were seeded: each rank drew its own mask, fed
its share of the block a different input and the summed output mixed two draws. Oracle: numpy in float64 on
the fetched mask (the forward and SGD's gradients of ``loss = mean((relu(n·W1)·W2 + n)²)`` by hand), on
each rank; the same Dropout as a node of the graph itself is the control."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from tests.parallel.conftest import run_mpi


def drawing_model(in_body: bool) -> onnx.ModelProto:
    """n = Dropout(x, 0.5, training), inside an If's branch when ``in_body``; o = relu(n·W1)·W2 (the split
    block, 16 hidden units); loss = mean((o + n)²); n a graph output too."""
    rng = np.random.default_rng(0)
    w1, w2 = 0.5 * rng.standard_normal((8, 16)), 0.5 * rng.standard_normal((16, 8))
    if in_body:
        drop = helper.make_node("Dropout", ["x", "ratio", "on"], ["n_then"])
        then_g = helper.make_graph([drop], "then", [],
                                   [helper.make_tensor_value_info("n_then", T.DOUBLE, None)])
        else_g = helper.make_graph([helper.make_node("Identity", ["x"], ["n_else"])], "else", [],
                                   [helper.make_tensor_value_info("n_else", T.DOUBLE, None)])
        draw = [helper.make_node("Constant", [], ["c"], value=helper.make_tensor("cv", T.BOOL, [], [True])),
                helper.make_node("If", ["c"], ["noise"], then_branch=then_g, else_branch=else_g)]
    else:
        draw = [helper.make_node("Dropout", ["x", "ratio", "on"], ["noise"])]
    nodes = [
        helper.make_node("Constant", [], ["ratio"], value=helper.make_tensor("r", T.DOUBLE, [], [0.5])),
        helper.make_node("Constant", [], ["on"], value=helper.make_tensor("o", T.BOOL, [], [True])),
        *draw,
        helper.make_node("MatMul", ["noise", "W1"], ["a"]),
        helper.make_node("Relu", ["a"], ["r"]),
        helper.make_node("MatMul", ["r", "W2"], ["o"]),
        helper.make_node("Add", ["o", "noise"], ["g"]),
        helper.make_node("Mul", ["g", "g"], ["gg"]),
        helper.make_node("ReduceMean", ["gg"], ["loss"], keepdims=0),
    ]
    g = helper.make_graph(nodes, "horizontal_draws", [helper.make_tensor_value_info("x", T.DOUBLE, ["N", 8])],
                          [helper.make_tensor_value_info("loss", T.DOUBLE, []),
                           helper.make_tensor_value_info("noise", T.DOUBLE, ["N", 8])],
                          [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
from onnxtrain import TrainingParameters, TrainingSession
from onnxtrain.parallel import world
from tests.parallel.test_horizontal_body_draws import drawing_model

p = TrainingParameters()
p.loss_output_name = "loss"
p.training_optimizer_name = "SGDOptimizer"
p.horizontal_parallel_size = 2
sess = TrainingSession(drawing_model(sys.argv[3] == "body").SerializeToString(), p)
rng = np.random.default_rng(1)
steps = []
for _ in range(2):
    x = rng.standard_normal((6, 8))
    before = sess.gather_state()
    loss, noise = sess.run(["loss", "noise"], {"x": x, "Learning_Rate": np.array([0.1], np.float32)})
    steps.append({"x": x.tolist(), "loss": float(loss), "noise": np.asarray(noise).tolist(),
                  "W1": before["W1"].tolist(), "W2": before["W2"].tolist()})
after = sess.gather_state()
with open(f"{sys.argv[2]}.{world().rank}", "w") as f:
    json.dump({"steps": steps, "W1": after["W1"].tolist(), "W2": after["W2"].tolist()}, f)
"""


def _oracle(x, n, w1, w2, lr):
    """The loss and the weights after one SGD step, by hand in float64."""
    a = n @ w1
    r = np.maximum(a, 0)
    g = r @ w2 + n
    dg = 2 * g / g.size
    dw2 = r.T @ dg
    dw1 = n.T @ ((dg @ w2.T) * (a > 0))
    return np.mean(g * g), w1 - lr * dw1, w2 - lr * dw2


@pytest.mark.mpi
@pytest.mark.parametrize("where", ["top", "body"])
def test_a_draw_outside_the_blocks_is_alike_on_both_ranks(tmp_path, where: str) -> None:
    script = tmp_path / "draws.py"
    script.write_text(_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "out.json"
    r = run_mpi(root, str(out), where, n=2, timeout=300, worker=str(script),
                env={"ONNXTRAIN_MPI_TIMEOUT": "60"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lr = float(np.float32(0.1))
    for rank in (0, 1):
        got = json.loads((tmp_path / f"out.json.{rank}").read_text())
        steps = got["steps"]
        for k, s in enumerate(steps):
            x, n = np.asarray(s["x"]), np.asarray(s["noise"])
            dropped = n == 0
            assert 0 < dropped.sum() < n.size, (rank, k)
            np.testing.assert_allclose(n[~dropped], 2 * x[~dropped], rtol=1e-15)
            loss, w1, w2 = _oracle(x, n, np.asarray(s["W1"]), np.asarray(s["W2"]), lr)
            np.testing.assert_allclose(s["loss"], loss, rtol=1e-12, err_msg=f"rank {rank}, step {k}: loss")
            nxt = steps[k + 1] if k + 1 < len(steps) else got
            for w, want in (("W1", w1), ("W2", w2)):
                np.testing.assert_allclose(nxt[w], want, rtol=1e-12, atol=1e-14,
                                           err_msg=f"rank {rank}, step {k}: {w}")
