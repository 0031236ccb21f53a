"""OrtValue and IOBinding for values other than tensors, and numpy's array protocol, as onnxruntime (run
side by side, the oracle) has them: a sequence output bound through IOBinding is a list of arrays (it was
stacked into one array, or failed for elements of different shapes), its OrtValue is no tensor and names
its sequence type, an empty optional has no value, ``np.asarray(value)`` is its array."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnxtrain

I64 = TensorProto.INT64


def _sequence_model() -> bytes:
    g = helper.make_graph([helper.make_node("SequenceConstruct", ["a", "b"], ["s"])], "g",
                          [helper.make_tensor_value_info("a", I64, [2, 3]),
                           helper.make_tensor_value_info("b", I64, [2, None])],
                          [helper.make_tensor_sequence_value_info("s", I64, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _optional_model() -> bytes:
    opt = helper.make_optional_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, [5]))
    g = helper.make_graph([helper.make_node("Identity", ["o"], ["p"])], "g",
                          [helper.make_value_info("o", opt)], [helper.make_value_info("p", opt)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 16)]).SerializeToString()


def _observed(lib) -> dict:
    a, b = np.arange(6, dtype=np.int64).reshape(2, 3), np.arange(4, dtype=np.int64).reshape(2, 2)
    sess = lib.InferenceSession(_sequence_model(), providers=["CPUExecutionProvider"])
    io = sess.io_binding()
    io.bind_cpu_input("a", a)
    io.bind_cpu_input("b", b)
    io.bind_output("s")
    sess.run_with_iobinding(io)
    value = io.get_outputs()[0]
    copied = io.copy_outputs_to_cpu()[0]
    empty = lib.InferenceSession(_optional_model(), providers=["CPUExecutionProvider"]).run_with_ort_values(
        None, {})[0]
    x = np.array([[1.5, 2.5]], np.float32)
    tensor = lib.OrtValue.ortvalue_from_numpy(x)
    return {"is_tensor": value.is_tensor(), "type": value.data_type(),
            "copied": [c.tolist() for c in copied], "empty_has_value": empty.has_value(),
            "asarray": np.asarray(tensor).tolist(), "asarray_f64": np.asarray(tensor, np.float64).dtype.name,
            "bytes": tensor.tensor_size_in_bytes()}


def test_values_other_than_tensors_and_the_array_protocol_are_onnxruntimes() -> None:
    want, got = _observed(ort), _observed(onnxtrain)
    assert got == want
    assert want["copied"] == [[[0, 1, 2], [3, 4, 5]], [[0, 1], [2, 3]]] and not want["is_tensor"]


def test_a_tensor_query_on_a_sequence_is_an_error() -> None:
    value = onnxtrain.OrtValue([np.zeros(2), np.ones(3)])
    assert value.is_tensor_sequence() and not value.is_tensor()
    with pytest.raises(RuntimeError, match=r"seq\(tensor\(double\)\), not a tensor"):
        value.shape()


@pytest.mark.parametrize("lib", [ort, onnxtrain], ids=["onnxruntime", "onnxtrain"])
def test_an_empty_sequence_keeps_its_element_type_and_sequences_feed_back(lib) -> None:
    """An empty int64 sequence's data_type() is the graph's (it said float), and a sequence OrtValue a run
    handed back feeds another session through run, run_with_ort_values and IOBinding (it was refused)."""
    g = helper.make_graph([helper.make_node("SequenceEmpty", [], ["s"], dtype=TensorProto.INT64)], "g", [],
                          [helper.make_tensor_sequence_value_info("s", TensorProto.INT64, None)])
    empty = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    sess = lib.InferenceSession(empty, providers=["CPUExecutionProvider"])
    assert sess.run_with_ort_values(None, {})[0].data_type() == "seq(tensor(int64))"
    seq_int = helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.INT64, None))
    g = helper.make_graph([helper.make_node("SequenceEmpty", [], ["s"], dtype=TensorProto.INT64),
                           helper.make_node("Optional", ["s"], ["o"])], "g", [],
                          [helper.make_value_info("o", helper.make_optional_type_proto(seq_int))])
    held = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()
    sess = lib.InferenceSession(held, providers=["CPUExecutionProvider"])
    assert sess.run_with_ort_values(None, {})[0].data_type() == "seq(tensor(int64))"  # the optional's value
    seq = helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, None))
    split = helper.make_model(helper.make_graph(
        [helper.make_node("SplitToSequence", ["x"], ["s"], axis=0, keepdims=1)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 2])],
        [helper.make_value_info("s", seq)]),
        opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()
    concat = helper.make_model(helper.make_graph(
        [helper.make_node("ConcatFromSequence", ["s"], ["y"], axis=0)], "g",
        [helper.make_value_info("s", seq)], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]),
        opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    first = lib.InferenceSession(split, providers=["CPUExecutionProvider"])
    second = lib.InferenceSession(concat, providers=["CPUExecutionProvider"])
    value = first.run_with_ort_values(None, {"x": lib.OrtValue.ortvalue_from_numpy(x)})[0]
    np.testing.assert_array_equal(second.run(None, {"s": value})[0], x)
    np.testing.assert_array_equal(second.run_with_ort_values(None, {"s": value})[0].numpy(), x)
    binding = second.io_binding()
    binding.bind_ortvalue_input("s", value)
    binding.bind_output("y")
    second.run_with_iobinding(binding)
    np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], x)


def test_dense_ortvalue_feeds_run_without_an_import_per_call() -> None:
    """A run fed dense OrtValues answers as onnxruntime does, and neither it nor ``OrtValue.numpy()`` /
    ``is_sparse_tensor()`` executes an import statement: the sparse-tensor check (7df6a95) imported its
    module inside ``is_sparse_tensor``, twice per OrtValue fed and once per ``numpy()`` (about 1 µs each)."""
    import builtins

    g = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    x = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5
    expected = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    sess = onnxtrain.InferenceSession(model)
    value = onnxtrain.OrtValue.ortvalue_from_numpy(x)
    sess.run(None, {"x": value})  # (first-run work done)

    imported: list[str] = []
    real = builtins.__import__

    def spy(name: str, *args, **kwargs):
        imported.append(name)
        return real(name, *args, **kwargs)

    builtins.__import__ = spy
    try:
        got = sess.run(None, {"x": value})[0]
        bound = sess.run_with_ort_values(None, {"x": value})[0].numpy()
        dense = not value.is_sparse_tensor()
    finally:
        builtins.__import__ = real
    assert dense
    assert imported == []
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(bound, expected)
