"""A node that reads only graph inputs and constants runs in every stage that reads it instead of being
sent (:func:`onnxtrain.parallel.pipeline.partition`), unless it draws random values or keeps running
statistics: run twice, it would draw twice, and the stages would see different values of one tensor. The
check looked at the node's own op only: an ``If`` whose branch draws (``RandomNormalLike``, a ``Dropout``) or
normalizes in training mode was copied into both stages. Oracle: the placement by hand, the same draw as a
node of the graph itself as control."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper

from onnxtrain.parallel.pipeline import parse_cut_info, partition


def noisy_model(body_op: str | None) -> onnx.ModelProto:
    """noise = (If(c) with a branch of ``body_op`` on x, else x), or ``body_op`` itself when ``body_op`` is
    prefixed ``top:``; h = x·W + noise; t = tanh(h) (the cut); loss = mean((t·V + noise)²): noise is read in
    both stages."""
    if body_op and body_op.startswith("top:"):
        draw = [helper.make_node("RandomNormalLike", ["x"], ["noise"])]
    else:
        if body_op == "RandomNormalLike":
            inner = [helper.make_node("RandomNormalLike", ["x"], ["n_then"])]
        elif body_op == "Dropout":
            inner = [helper.make_node("Dropout", ["x", "ratio", "on"], ["n_then"])]
        else:  # a training-mode BatchNormalization over x's 8 features
            inner = [helper.make_node("BatchNormalization", ["x", "sc", "bi", "mean", "var"],
                                      ["n_then", "m_out", "v_out"], training_mode=1)]
        then_g = helper.make_graph(inner, "then", [],
                                   [helper.make_tensor_value_info("n_then", T.FLOAT, None)])
        else_g = helper.make_graph([helper.make_node("Identity", ["x"], ["n_else"])], "else", [],
                                   [helper.make_tensor_value_info("n_else", T.FLOAT, None)])
        draw = [
            helper.make_node("Constant", [], ["c"], value=helper.make_tensor("cv", T.BOOL, [], [True])),
            helper.make_node("If", ["c"], ["noise"], then_branch=then_g, else_branch=else_g),
        ]
    nodes = [
        helper.make_node("Constant", [], ["ratio"], value=helper.make_tensor("r", T.FLOAT, [], [0.5])),
        helper.make_node("Constant", [], ["on"], value=helper.make_tensor("o", T.BOOL, [], [True])),
        *draw,
        helper.make_node("MatMul", ["x", "W"], ["h0"]),
        helper.make_node("Add", ["h0", "noise"], ["h"]),
        helper.make_node("Tanh", ["h"], ["t"]),
        helper.make_node("MatMul", ["t", "V"], ["g"]),
        helper.make_node("Add", ["g", "noise"], ["gn"]),
        helper.make_node("Mul", ["gn", "gn"], ["gg"]),
        helper.make_node("ReduceMean", ["gg"], ["loss"], keepdims=0),
    ]
    inits = [onnx.numpy_helper.from_array(np.ones(s, np.float32), n)
             for n, s in (("W", (8, 8)), ("V", (8, 8)), ("sc", (8,)), ("bi", (8,)), ("mean", (8,)),
                          ("var", (8,)))]
    g = helper.make_graph(nodes, "noisy", [helper.make_tensor_value_info("x", T.FLOAT, ["N", 8])],
                          [helper.make_tensor_value_info("loss", T.FLOAT, [])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("body_op",
                         ["top:RandomNormalLike", "RandomNormalLike", "Dropout", "BatchNormalization"])
def test_a_node_that_draws_in_its_body_runs_in_one_stage(body_op: str) -> None:
    m = noisy_model(body_op)
    part = partition(m, parse_cut_info("t", 2), "loss")
    k = next(k for k, n in enumerate(m.graph.node) if n.output[0] == "noise")
    assert part.runs(k) == {0}, body_op  # drawn once, in the first stage that reads it
    assert "noise" in part.sends[0], body_op  # and sent to the next


def test_a_node_without_draws_in_its_body_still_runs_where_it_is_read() -> None:
    """Control: an If whose branches only compute from x (no draw) is copied into both stages, as before."""
    m = noisy_model("RandomNormalLike")
    for n in m.graph.node:
        if n.op_type == "If":
            then_g = n.attribute[0].g if n.attribute[0].name == "then_branch" else n.attribute[1].g
            then_g.node[0].CopyFrom(helper.make_node("Sigmoid", ["x"], ["n_then"]))
    part = partition(m, parse_cut_info("t", 2), "loss")
    k = next(k for k, n in enumerate(m.graph.node) if n.output[0] == "noise")
    assert part.runs(k) == {0, 1}
    assert "noise" not in part.sends[0]
