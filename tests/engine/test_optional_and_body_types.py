"""Optional feeds, empty loop outputs and body types (an outside review of control flow, sequences and
optionals), against onnxruntime: an optional tensor input's feed was not checked (another dtype, rank or a
list of Python floats ran, the list as float64); a Loop of no iteration stacked a body output that declares
no shape as rank 1; If branches of two element types and a SequenceInsert of another element type ran
(onnx.checker and onnxruntime refuse both at load)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import InferenceSession
from onnxtrain.errors import Fail, InvalidFeed, InvalidFeedType

ort = pytest.importorskip("onnxruntime")
F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
N = helper.make_node


def _vi(name: str, et: int, dims: list | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, et, dims)


def _model(nodes: list, inputs: list, outputs: list, opset: int = 18) -> bytes:
    g = helper.make_graph(nodes, "g", inputs, outputs)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)
    return m.SerializeToString()


def _const(name: str, value: np.ndarray) -> onnx.NodeProto:
    return N("Constant", [], [name], value=numpy_helper.from_array(value))


def _ort(model: bytes, feeds: dict[str, Any]) -> list[Any]:
    so = ort.SessionOptions()
    so.log_severity_level = 4
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _optional_model() -> bytes:
    """z = (o if o has a value else zeros) + x, o: optional(tensor(float)[2])."""
    got = helper.make_graph([N("OptionalGetElement", ["o"], ["v"])], "then", [], [_vi("v", F, [2])])
    zero = helper.make_graph([_const("z0", np.zeros(2, np.float32))], "else", [], [_vi("z0", F, [2])])
    nodes = [N("OptionalHasElement", ["o"], ["has"]),
             N("If", ["has"], ["g"], then_branch=got, else_branch=zero), N("Add", ["g", "x"], ["z"])]
    o = helper.make_value_info("o", helper.make_optional_type_proto(helper.make_tensor_type_proto(F, [2])))
    return _model(nodes, [o, _vi("x", F, [2])], [_vi("z", F, [2])])


def test_an_optional_tensor_feed_is_checked_as_a_tensor_feed() -> None:
    m, x = _optional_model(), np.array([0.5, 0.25], np.float32)
    for o in (np.array([1.0, 2.0], np.float32), [1.0, 2.0], None):
        feeds = {"o": o, "x": x}
        got, want = InferenceSession(m).run(None, feeds)[0], _ort(m, feeds)[0]
        assert got.dtype == want.dtype == np.float32  # a list takes the element type (it ran as float64)
        np.testing.assert_array_equal(got, want)
    for bad, error in ((np.array([1, 2], np.int64), InvalidFeedType),
                       (np.ones((2, 2), np.float32), InvalidFeed), (np.ones(3, np.float32), InvalidFeed)):
        with pytest.raises(Exception):  # noqa: B017 - onnxruntime's class differs by check
            _ort(m, {"o": bad, "x": x})
        with pytest.raises(error, match="input 'o'"):
            InferenceSession(m).run(None, {"o": bad, "x": x})


def test_a_loop_of_no_iteration_stacks_an_undeclared_body_output_at_its_inferred_rank() -> None:
    """The body outputs Shape(x) for a carried x of shape [N, 3], declaring no shape: with no iteration the
    stack is [0, 2] by shape inference (it was [0]), and the Concat after it runs as in onnxruntime."""
    body = helper.make_graph(
        [N("Identity", ["c_in"], ["c_out"]), N("Identity", ["x_in"], ["x_out"]), N("Shape", ["x_in"], ["s"])],
        "body", [_vi("i", I64, []), _vi("c_in", B, []), _vi("x_in", F, ["n", 3])],
        [_vi("c_out", B, []), _vi("x_out", F, ["n", 3]), helper.make_tensor_value_info("s", I64, None)])
    nodes = [N("Loop", ["m", "", "x"], ["xf", "ss"], body=body), _const("k", np.array([[7, 7]], np.int64)),
             N("Concat", ["ss", "k"], ["out"], axis=0)]
    m = _model(nodes, [_vi("m", I64, []), _vi("x", F, ["n", 3])], [_vi("out", I64, ["k", 2])])
    x = np.ones((4, 3), np.float32)
    for trips in (2, 0):
        feeds = {"m": np.array(trips, np.int64), "x": x}
        got = InferenceSession(m).run(None, feeds)[0]
        np.testing.assert_array_equal(got, _ort(m, feeds)[0])
        assert got.shape == (trips + 1, 2)


def test_a_loop_of_no_iteration_keeps_rank_1_where_the_body_declares_nothing() -> None:
    """A body whose input and scan output declare no shape at all: onnxruntime stacks no iteration as rank 1
    (its load-time inference finds no shape), and so does onnxtrain (it took the fed arrays' shapes, and
    the Concat after the loop failed)."""
    body = helper.make_graph(
        [N("Identity", ["c"], ["c_out"]), N("Identity", ["v"], ["v_out"]), N("Add", ["v", "v"], ["s"])],
        "b", [_vi("i", I64, []), _vi("c", B, []), _vi("v", F, None)],
        [_vi("c_out", B, []), _vi("v_out", F, None), _vi("s", F, None)])
    nodes = [N("Loop", ["n", "", "x"], ["vf", "scan"], body=body),
             N("Concat", ["scan", "r"], ["out"], axis=0)]
    m = _model(nodes, [_vi("n", I64, []), _vi("x", F, [2, 3]), _vi("r", F, [4])], [_vi("out", F, None)], 17)
    feeds = {"n": np.array(0, np.int64), "x": np.ones((2, 3), np.float32),
             "r": np.arange(4, dtype=np.float32)}
    np.testing.assert_array_equal(InferenceSession(m).run(None, feeds)[0], _ort(m, feeds)[0])


def test_if_branches_of_two_element_types_are_refused() -> None:
    then = helper.make_graph([_const("t", np.array([1.5], np.float32))], "then", [], [_vi("t", F, [1])])
    other = helper.make_graph([_const("e", np.array([1], np.int64))], "else", [], [_vi("e", I64, [1])])
    m = _model([N("If", ["c"], ["y"], then_branch=then, else_branch=other), N("Add", ["y", "x"], ["z"])],
               [_vi("c", B, []), _vi("x", F, [1])], [_vi("z", F, [1])])
    with pytest.raises(Exception):  # noqa: B017
        _ort(m, {"c": np.array(False), "x": np.ones(1, np.float32)})
    with pytest.raises(Fail, match="then_branch declares tensor.float., else_branch tensor.int64."):
        InferenceSession(m)


def test_sequence_insert_of_another_element_type_is_refused() -> None:
    nodes = [N("SequenceConstruct", ["x"], ["s"]), N("SequenceInsert", ["s", "k"], ["s2"]),
             N("ConcatFromSequence", ["s2"], ["cat"], axis=0)]
    m = _model(nodes, [_vi("x", F, [2]), _vi("k", I64, [2])], [_vi("cat", F, [4])])
    with pytest.raises(Exception):  # noqa: B017
        _ort(m, {"x": np.ones(2, np.float32), "k": np.ones(2, np.int64)})
    with pytest.raises(Fail, match="input 1 'k' is tensor.int64., but sequence 's' holds tensor.float."):
        InferenceSession(m)
