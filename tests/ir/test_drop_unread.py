"""ir.graphs.drop_unread: what a rewrite leaves unread goes, and only that."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.ir.graphs import drop_unread


def test_unread_constants_and_their_inputs_go_the_rest_stays() -> None:
    ints = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    nodes = [helper.make_node("Constant", [], ["c"], value=ints("cv", [1])),
             helper.make_node("Concat", ["c", "i1"], ["pads"], axis=0),  # unread once its reader went
             helper.make_node("Constant", [], ["other"], value=ints("ov", [2])),  # unread, not named: stays
             helper.make_node("Identity", ["x"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                                       helper.make_tensor_value_info("fed", TensorProto.INT64, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                          [ints("i1", [3]), ints("fed", [4]), ints("kept", [5])])
    drop_unread(g, {"pads", "fed"}, ops=("Constant", "Concat"))
    assert [n.output[0] for n in g.node] == ["other", "y"]
    # the Concat's initializer input went with it; one that is also a graph input stays (it may be fed)
    assert [t.name for t in g.initializer] == ["fed", "kept"]
