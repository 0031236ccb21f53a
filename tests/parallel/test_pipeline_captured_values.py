"""Pipeline stages of a model whose ``If`` reads values of the outer graph inside its branches (captured,
not listed among its inputs, as exporters write control flow). :func:`onnxtrain.parallel.pipeline.partition`
placed a node by its listed inputs alone: the ``If`` (its only listed input a constant condition) went to
stage 0 although its branch reads ``g``, computed in stage 1, and the session was refused with "the loss is
computed in stage 0, not in the last stage", blaming a cut that is right; a captured value of an earlier
stage was not passed on to it. Oracle: one process accumulating the same micro-batches (float64, Adam), and
the placement by hand."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain.parallel.pipeline import parse_cut_info, partition
from tests.parallel.conftest import run_mpi


def captured_model() -> onnx.ModelProto:
    """x → MatMul W → h → Tanh → t → MatMul V → g; If(c) then g·t·h else g (the branches read g, t and h
    from the outer graph); loss = mean(o²). Cut at ``t``: the If belongs to stage 1."""
    rng = np.random.default_rng(0)
    w, v = rng.standard_normal((8, 4)), rng.standard_normal((4, 4))
    then_g = helper.make_graph(
        [helper.make_node("Mul", ["g", "t"], ["gt"]), helper.make_node("Mul", ["gt", "h"], ["o_then"])],
        "then", [], [helper.make_tensor_value_info("o_then", T.DOUBLE, None)],
    )
    else_g = helper.make_graph([helper.make_node("Identity", ["g"], ["o_else"])], "else", [],
                               [helper.make_tensor_value_info("o_else", T.DOUBLE, None)])
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Tanh", ["h"], ["t"]),
        helper.make_node("MatMul", ["t", "V"], ["g"]),
        helper.make_node("Constant", [], ["c"], value=helper.make_tensor("cv", T.BOOL, [], [True])),
        helper.make_node("If", ["c"], ["o"], then_branch=then_g, else_branch=else_g),
        helper.make_node("Mul", ["o", "o"], ["oo"]),
        helper.make_node("ReduceMean", ["oo"], ["loss"], keepdims=0),
    ]
    g = helper.make_graph(nodes, "captured", [helper.make_tensor_value_info("x", T.DOUBLE, ["N", 8])],
                          [helper.make_tensor_value_info("loss", T.DOUBLE, [])],
                          [numpy_helper.from_array(w, "W"), numpy_helper.from_array(v, "V")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_node_goes_to_the_stage_of_the_values_its_branches_read() -> None:
    m = captured_model()
    part = partition(m, parse_cut_info("t", 2), "loss")
    stage = {n.output[0]: part.stage_of[k] for k, n in enumerate(m.graph.node)}
    assert stage == {"h": 0, "t": 0, "g": 1, "c": 1, "o": 1, "oo": 1, "loss": 1}
    # the If reads h in stage 1 too: x·W reads only an input and a weight, so stage 1 runs its own copy
    # (a free node, as an Identity of a weight), and only the cut tensor is sent
    assert part.runs(0) == {0, 1}
    assert part.sends == [["t"]]
    # three stages: the If reads t from stage 0, passed on through stage 1 with g
    part = partition(m, parse_cut_info("t,g", 3), "loss")
    stage = {n.output[0]: part.stage_of[k] for k, n in enumerate(m.graph.node)}
    assert stage == {"h": 0, "t": 0, "g": 1, "c": 2, "o": 2, "oo": 2, "loss": 2}
    assert [sorted(s) for s in part.sends] == [["t"], ["g", "t"]]


_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
from onnxtrain import TrainingParameters, TrainingSession
from onnxtrain.parallel import world
from tests.parallel.test_pipeline_captured_values import captured_model

rng = np.random.default_rng(1)
batches = [rng.standard_normal((8, 8)) for _ in range(3)]
lr = np.array([0.05], np.float32)
p = TrainingParameters()
p.loss_output_name = "loss"
p.training_optimizer_name = "AdamOptimizer"
if world().size == 1:
    p.gradient_accumulation_steps, p.gradient_accumulation_mode = 2, "auto"
else:
    cut = {2: "t", 3: "t,g"}[world().size]
    p.pipeline_parallel_size, p.pipeline_cut_info_string, p.num_pipeline_micro_batches = world().size, cut, 2
sess = TrainingSession(captured_model().SerializeToString(), p)
losses = []
for x in batches:
    if world().size == 1:
        for half in (x[:4], x[4:]):
            (loss,) = sess.run(["loss"], {"x": half, "Learning_Rate": lr})
    else:
        (loss,) = sess.run(["loss"], {"x": x, "Learning_Rate": lr})
    losses.append(float(loss))
state = sess.gather_state() if world().size > 1 else sess.get_state()
if world().rank == 0:
    with open(sys.argv[2], "w") as f:
        json.dump({"losses": losses, "W": state["W"].tolist(), "V": state["V"].tolist()}, f)
"""


@pytest.mark.mpi
def test_two_and_three_stages_train_as_one_process(tmp_path) -> None:
    script = tmp_path / "captured.py"
    script.write_text(_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    got = {}
    for n in (1, 2, 3):
        out = tmp_path / f"out{n}.json"
        r = run_mpi(root, str(out), n=n, timeout=300, worker=str(script), env={"ONNXTRAIN_MPI_TIMEOUT": "60"})
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        got[n] = json.loads(out.read_text())
    one = got[1]
    for n in (2, 3):
        np.testing.assert_allclose(got[n]["losses"], one["losses"], rtol=1e-12, err_msg=f"{n} stages")
        for w in ("W", "V"):
            np.testing.assert_allclose(got[n][w], one[w], rtol=1e-12, atol=1e-14, err_msg=f"{n} stages: {w}")
    first = {t.name: numpy_helper.to_array(t) for t in captured_model().graph.initializer}
    for w in ("W", "V"):  # the weights moved
        assert np.abs(np.asarray(one[w]) - first[w]).max() > 1e-3, w
