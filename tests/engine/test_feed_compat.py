"""Feeds and input declarations as onnxruntime (side by side, the oracle) takes them: string inputs fed numpy
bytes, raw bytes (``np.void``) or objects other than str (onnxruntime gives str back: they were bytes, refused
or passed through), a sequence's elements of another type than declared (refused: they ran in their own
type), an optional input's declared shape (it was [])."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain


def _model(nodes, inputs, outputs, opset: int = 17) -> bytes:
    g = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString()


STRINGS = _model([helper.make_node("Identity", ["x"], ["y"])],
                 [helper.make_tensor_value_info("x", TensorProto.STRING, [2, 2])],
                 [helper.make_tensor_value_info("y", TensorProto.STRING, [2, 2])])
# (bytes shorter than the array's width: onnxruntime reads each up to its first NUL, past the element when
# it fills the width)
FEEDS = {"bytes": np.array([[b"ab", b"c"], [b"d", b"\xc3\xa9"]], dtype="S4"),
         "void": np.array([[b"must", b"have"], [b"same", b"size"]], dtype=np.void),
         "objects": np.array([[1, None], [2.5, "s"]], dtype=object),
         # bytes objects are str()-converted ("b'ab'"), not decoded (undecodable ones failed)
         "bytes_objects": np.array([[b"ab", "c"], [b"\xff\xfe", b""]], dtype=object)}


@pytest.mark.parametrize("kind", sorted(FEEDS))
def test_string_feeds_come_back_as_onnxruntimes(kind: str) -> None:
    want = ort.InferenceSession(STRINGS, providers=["CPUExecutionProvider"]).run(None, {"x": FEEDS[kind]})[0]
    got = onnxtrain.InferenceSession(STRINGS).run(None, {"x": FEEDS[kind]})[0]
    assert got.dtype == want.dtype and got.tolist() == want.tolist()
    assert all(isinstance(v, str) for v in got.flat)


def test_a_sequence_of_another_element_type_is_refused_as_by_onnxruntime() -> None:
    model = _model([helper.make_node("ConcatFromSequence", ["xs"], ["y"], axis=0)],
                   [helper.make_tensor_sequence_value_info("xs", TensorProto.FLOAT, None)],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    feeds = {"xs": [np.ones(2, np.float64), np.ones(2, np.float64)]}
    with pytest.raises(RuntimeError):
        ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    with pytest.raises(RuntimeError, match=r"input 'xs': element 0 is float64; the sequence holds float32"):
        onnxtrain.InferenceSession(model).run(None, feeds)


def test_an_optional_inputs_shape_is_its_tensors() -> None:
    opt = helper.make_optional_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, [5]))
    model = _model([helper.make_node("Identity", ["o"], ["p"])], [helper.make_value_info("o", opt)],
                   [helper.make_value_info("p", opt)], opset=16)
    for lib in (ort, onnxtrain):
        sess = lib.InferenceSession(model, providers=["CPUExecutionProvider"])
        assert sess.get_inputs()[0].shape == [5] and sess.get_outputs()[0].shape == [5], lib.__name__


def test_a_sequence_of_strings_takes_numpy_str_arrays() -> None:
    model = _model([helper.make_node("SequenceAt", ["xs", "zero"], ["y"])],
                   [helper.make_tensor_sequence_value_info("xs", TensorProto.STRING, None)],
                   [helper.make_tensor_value_info("y", TensorProto.STRING, None)])
    model_proto = onnx.load_from_string(model)
    model_proto.graph.initializer.append(numpy_helper.from_array(np.array(0, np.int64), "zero"))
    data = model_proto.SerializeToString()
    feeds = {"xs": [np.array(["a", "b"]), np.array(["c"])]}
    want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = onnxtrain.InferenceSession(data).run(None, feeds)[0]
    assert got.tolist() == want.tolist() == ["a", "b"]


def test_a_free_dimension_override_reaches_the_outputs_declaration() -> None:
    model = _model([helper.make_node("Neg", ["x"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])])
    for lib in (ort, onnxtrain):
        so = lib.SessionOptions()
        so.add_free_dimension_override_by_name("batch", 2)
        sess = lib.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        assert sess.get_outputs()[0].shape == [2, 3], lib.__name__


def test_outputs_take_the_sizes_inference_finds_from_overridden_inputs() -> None:
    """A Concat of the input with itself declared [M, 3] (or [batch, 3], which it is not): with batch fixed
    to 2, onnxruntime reports [4, 3], what its shape inference finds; onnxtrain renamed symbols only
    (['M', 3], and [2, 3] for an output of 4 rows)."""
    for declared in (["M", 3], ["batch", 3]):
        model = _model([helper.make_node("Concat", ["x", "x"], ["y"], axis=0)],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, declared)])
        for lib in (ort, onnxtrain):
            so = lib.SessionOptions()
            so.add_free_dimension_override_by_name("batch", 2)
            sess = lib.InferenceSession(model, so, providers=["CPUExecutionProvider"])
            assert sess.get_outputs()[0].shape == [4, 3], (lib.__name__, declared)
            assert sess.run(None, {"x": np.ones((2, 3), np.float32)})[0].shape == (4, 3)


def test_an_overridable_initializer_does_not_fix_the_inferred_output_sizes() -> None:
    """y = Reshape(x, shape) with ``shape`` an initializer that is also an input: its default does not fix
    y's sizes (inference took it for a constant: [3, 4], and the backend warned on every run fed [12, 1])."""
    g = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6]),
                           helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])],
                          [numpy_helper.from_array(np.array([3, 4], np.int64), "shape")])
    opsets = [helper.make_opsetid("", 17)]
    model = helper.make_model(g, opset_imports=opsets, ir_version=8).SerializeToString()
    for lib in (ort, onnxtrain):
        so = lib.SessionOptions()
        so.add_free_dimension_override_by_name("batch", 2)
        so.log_severity_level = 3
        sess = lib.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        assert sess.get_outputs()[0].shape == ["a", "b"], lib.__name__
        y = sess.run(None, {"x": np.ones((2, 6), np.float32), "shape": np.array([12, 1], np.int64)})[0]
        assert y.shape == (12, 1)


def test_below_ir_version_4_initializers_listed_as_inputs_are_constants() -> None:
    """IR version 3 lists every initializer as an input: onnxruntime takes them as constants (none is
    overridable, the Reshape target's value fixes the output sizes); onnxtrain listed them as overridable
    and, with a free-dimension override, left the sizes symbolic."""
    g = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6]),
                           helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])],
                          [numpy_helper.from_array(np.array([3, 4], np.int64), "shape")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 8)], ir_version=3).SerializeToString()
    for lib in (ort, onnxtrain):
        so = lib.SessionOptions()
        so.add_free_dimension_override_by_name("batch", 2)
        so.log_severity_level = 3
        sess = lib.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        assert sess.get_overridable_initializers() == [], lib.__name__
        assert sess.get_outputs()[0].shape == [3, 4], lib.__name__
        assert sess.run(None, {"x": np.ones((2, 6), np.float32)})[0].shape == (3, 4)
