"""Review R3 (of 90cfb3d7, which marks the Adds expand_sums makes of a Sum by a doc_string starting
'an Add of Sum: ' and reads it back as JSON): a graph's own Add may carry any doc_string, that prefix too;
such an Add that failed raised json's JSONDecodeError ('Expecting value') from Plan._raise_failed, naming
no node. Oracle: onnxruntime 1.32 fails naming the Add; so does onnxtrain for the same Add without that
doc_string."""

from __future__ import annotations

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper  # noqa: E402

import onnxtrain  # noqa: E402


@pytest.mark.parametrize("doc", ["", "an Add of Sum: the author's note", 'an Add of Sum: {"a": 1}'])
def test_a_graphs_add_whose_doc_string_looks_like_an_expanded_sums_fails_naming_it(doc: str) -> None:
    node = helper.make_node("Add", ["a", "b"], ["y"], name="plain_add", doc_string=doc)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["A"]),
                                        helper.make_tensor_value_info("b", TensorProto.FLOAT, ["B"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    model = model.SerializeToString()
    feeds = {"a": np.ones(4, np.float32), "b": np.ones(3, np.float32)}
    with pytest.raises(Exception, match="running Add node. Name:'plain_add'"):  # noqa: PT011 - its Fail
        ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    with pytest.raises(RuntimeError, match=r"node 'plain_add' \(Add\) failed on inputs \[a: float32\[4\], "
                                           r"b: float32\[3\]\]"):
        onnxtrain.InferenceSession(model).run(None, feeds)
