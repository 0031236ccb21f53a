"""onnxruntime's API details scripts hit: a misspelt option field is an AttributeError (it was stored and
ignored), ``OrtValue.update_inplace(data=...)``, and a model of an opset newer than onnx knows is refused."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper

from onnxtrain import InferenceSession, OrtValue, RunOptions, SessionOptions
from onnxtrain.capi.onnxruntime_pybind11_state import Fail


@pytest.mark.parametrize("cls, good, typo", [(SessionOptions, "intra_op_num_threads", "intra_op_threads"),
                                             (RunOptions, "terminate", "terminat")])
def test_misspelt_option_fields_are_refused(cls: type, good: str, typo: str) -> None:
    ours, theirs = cls(), getattr(onnxruntime, cls.__name__)()
    for o in (ours, theirs):
        setattr(o, good, getattr(o, good))
        with pytest.raises(AttributeError):
            setattr(o, typo, 1)


def test_update_inplace_by_keyword() -> None:
    v = OrtValue.ortvalue_from_numpy(np.zeros(3, np.float32))
    v.update_inplace(data=np.arange(3, dtype=np.float32))
    np.testing.assert_array_equal(v.numpy(), [0, 1, 2])


def test_an_opset_onnx_does_not_know_is_refused() -> None:
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    newest = onnx.defs.onnx_opset_version()
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", newest + 1)]).SerializeToString()
    with pytest.raises(Fail, match=f"opset {newest + 1} is newer than the installed onnx"):
        InferenceSession(model)
    with pytest.raises(Exception):  # noqa: B017 - onnxruntime's class for it differs by version
        onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])


def test_subclasses_keep_their_own_fields() -> None:
    class Tagged(SessionOptions):
        def __init__(self) -> None:
            super().__init__()
            self.tag = "mine"

    assert Tagged().tag == "mine"


def test_initializers_passed_through_and_sequence_feeds_are_copies() -> None:
    """A float_data initializer returned by an Identity was the plan's own array (writing it changed the
    next run); a sequence feed's items came back as the output's items."""
    g = helper.make_graph([helper.make_node("Identity", ["W"], ["y"])], "g", [],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
                          [helper.make_tensor("W", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])])
    opset = [helper.make_opsetid("", 17)]
    sess = InferenceSession(helper.make_model(g, opset_imports=opset).SerializeToString())
    y = sess.run(None, {})[0]
    y[0] = 99
    np.testing.assert_array_equal(sess.run(None, {})[0], [1, 2, 3])
    g = helper.make_graph([helper.make_node("Identity", ["s"], ["t"])], "g",
                          [helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_sequence_value_info("t", TensorProto.FLOAT, [2])])
    seq = [np.ones(2, np.float32), np.zeros(2, np.float32)]
    sess = InferenceSession(helper.make_model(g, opset_imports=opset).SerializeToString())
    t = sess.run(None, {"s": seq})[0]
    assert not any(np.shares_memory(a, b) for a, b in zip(t, seq))
