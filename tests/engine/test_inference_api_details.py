"""onnxruntime inference-API details an outside review found, each script run with onnxruntime and with
onnxtrain (only the import differs): a Constant passed through to an output was the session's own array
(writing it changed later runs), outputs that are views (Transpose) were not row-major (an OrtValue's
``data_ptr()`` with its shape described other values), ``bind_input`` refused an ONNX type number, a scalar
output could not fill a one-value buffer, a scalar input refused ``[[7]]``, a binding with no output ran every
output, and an unconvertible list feed raised numpy's errors rather than a RuntimeError."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain

N = helper.make_node
LIBS = [onnxruntime, onnxtrain]
IDS = ["onnxruntime", "onnxtrain"]


def _model(nodes: list, inputs: list, outputs: list) -> bytes:
    g = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def _session(lib: Any, model: bytes) -> Any:
    so = lib.SessionOptions()
    so.log_severity_level = 3
    return lib.InferenceSession(model, so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("lib", LIBS, ids=IDS)
@pytest.mark.parametrize("kind", ["floats", "strings", "float_data"])
def test_a_constant_output_is_the_callers_copy(lib: Any, kind: str) -> None:
    if kind == "floats":
        node, et, first = N("Constant", [], ["y"], value_floats=[1.0, 2.0]), TensorProto.FLOAT, [1.0, 2.0]
    elif kind == "strings":
        node, et, first = N("Constant", [], ["y"], value_strings=[b"p", b"q"]), TensorProto.STRING, ["p", "q"]
    else:
        t = helper.make_tensor("v", TensorProto.FLOAT, [2], [1.0, 2.0])  # float_data, not raw bytes
        node, et, first = N("Constant", [], ["y"], value=t), TensorProto.FLOAT, [1.0, 2.0]
    sess = _session(lib, _model([node], [], [helper.make_tensor_value_info("y", et, [2])]))
    y = sess.run(None, {})[0]
    y[...] = 99 if et == TensorProto.FLOAT else "CHANGED"
    assert sess.run(None, {})[0].tolist() == first


@pytest.mark.parametrize("lib", LIBS, ids=IDS)
def test_a_view_output_is_row_major_for_pointer_consumers(lib: Any) -> None:
    """A Transpose's output handed on by pointer (``data_ptr()`` and ``shape()``) to a second session."""
    f = TensorProto.FLOAT
    first = _session(lib, _model([N("Relu", ["x"], ["r"]), N("Transpose", ["r"], ["y"], perm=[1, 0])],
                                 [helper.make_tensor_value_info("x", f, [3, 4])],
                                 [helper.make_tensor_value_info("y", f, [4, 3])]))
    second = _session(lib, _model([N("Identity", ["a"], ["b"])],
                                  [helper.make_tensor_value_info("a", f, [4, 3])],
                                  [helper.make_tensor_value_info("b", f, [4, 3])]))
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = first.run(None, {"x": x})[0]
    assert y.flags.c_contiguous
    v = first.run_with_ort_values(["y"], {"x": lib.OrtValue.ortvalue_from_numpy(x)})[0]
    binding = second.io_binding()
    binding.bind_input("a", "cpu", 0, np.float32, v.shape(), v.data_ptr())
    binding.bind_output("b")
    second.run_with_iobinding(binding)
    np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], x.T)


def _neg_int64() -> bytes:
    i = TensorProto.INT64
    return _model([N("Neg", ["x"], ["y"])], [helper.make_tensor_value_info("x", i, [])],
                  [helper.make_tensor_value_info("y", i, [])])


@pytest.mark.parametrize("lib", LIBS, ids=IDS)
def test_bindings_by_type_number_and_one_value_buffers(lib: Any) -> None:
    sess = _session(lib, _neg_int64())
    x = np.array(7, np.int64)
    out = np.zeros(1, np.int64)  # a one-value buffer for the scalar output
    binding = sess.io_binding()
    binding.bind_input("x", "cpu", 0, TensorProto.INT64, [], x.ctypes.data)  # an ONNX type number
    binding.bind_output("y", "cpu", 0, np.int64, [1], out.ctypes.data)
    sess.run_with_iobinding(binding)
    assert out.tolist() == [-7]


@pytest.mark.parametrize("lib", LIBS, ids=IDS)
def test_a_one_value_array_of_any_rank_feeds_a_scalar_input(lib: Any) -> None:
    got = _session(lib, _neg_int64()).run(None, {"x": np.array([[7]], np.int64)})[0]
    assert got.tolist() == [[-7]]


@pytest.mark.parametrize("lib", LIBS, ids=IDS)
def test_a_binding_without_outputs_is_refused(lib: Any) -> None:
    sess = _session(lib, _neg_int64())
    binding = sess.io_binding()
    binding.bind_cpu_input("x", np.array(7, np.int64))
    with pytest.raises(RuntimeError, match="At least one output should be requested"):
        sess.run_with_iobinding(binding)


@pytest.mark.parametrize("lib", LIBS, ids=IDS)
@pytest.mark.parametrize("feed", [[300], [[1, 2], [3]], [1 + 2j]], ids=["overflow", "ragged", "complex"])
def test_an_unconvertible_list_feed_is_a_runtime_error(lib: Any, feed: list) -> None:
    i8 = TensorProto.INT8
    sess = _session(lib, _model([N("Neg", ["x"], ["y"])], [helper.make_tensor_value_info("x", i8, [1])],
                                [helper.make_tensor_value_info("y", i8, [1])]))
    with pytest.raises(RuntimeError):
        sess.run(None, {"x": feed})


def test_folded_constants_are_read_only_in_the_plan() -> None:
    """The engine's own view: a Constant folded at compile time is shared by every run."""
    m = onnx.load_from_string(_model([N("Constant", [], ["c"], value=numpy_helper.from_array(np.ones(2))),
                                      N("Identity", ["c"], ["y"])], [],
                                     [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [2])]))
    from onnxtrain.engine import compile_model

    plan = compile_model(m)
    assert all(not v.flags.writeable for _, v in plan._const_values)


@pytest.mark.parametrize("lib", LIBS, ids=IDS)
def test_an_empty_sequence_output_keeps_its_element_type(lib: Any) -> None:
    """``element_type()`` of a sequence is its elements' (it raised), and an empty one through IOBinding is
    typed as the graph declares it (it said seq(tensor(float)))."""
    out = helper.make_tensor_sequence_value_info("s", TensorProto.INT16, None)
    sess = _session(lib, _model([N("SequenceEmpty", [], ["s"], dtype=TensorProto.INT16)], [], [out]))
    v = sess.run_with_ort_values(["s"], {})[0]
    assert (v.data_type(), v.element_type()) == ("seq(tensor(int16))", TensorProto.INT16)
    binding = sess.io_binding()
    binding.bind_output("s")
    sess.run_with_iobinding(binding)
    assert binding.get_outputs()[0].data_type() == "seq(tensor(int16))"


@pytest.mark.parametrize("lib", LIBS, ids=IDS)
def test_node_arg_types_of_maps_and_sparse_tensors(lib: Any) -> None:
    """Unused map, sequence-of-map and sparse inputs: their NodeArg types (and the sparse one's dense shape)
    as onnxruntime names them (they read 'unknown' and [])."""
    f = TensorProto.FLOAT
    m = helper.make_value_info("m", helper.make_map_type_proto(TensorProto.STRING,
                                                               helper.make_tensor_type_proto(f, None)))
    sm = helper.make_value_info("sm", helper.make_sequence_type_proto(helper.make_map_type_proto(
        TensorProto.INT64, helper.make_tensor_type_proto(f, None))))
    sp = helper.make_value_info("sp", helper.make_sparse_tensor_type_proto(f, [2, 2]))
    x = helper.make_tensor_value_info("x", f, [2])
    model = _model([N("Relu", ["x"], ["y"])], [x, m, sm, sp], [helper.make_tensor_value_info("y", f, [2])])
    got = {a.name: (a.type, a.shape) for a in _session(lib, model).get_inputs()}
    assert got["m"][0] == "map(string,tensor(float))"
    assert got["sm"][0] == "seq(map(int64,tensor(float)))"
    assert got["sp"] == ("sparse_tensor(float)", [2, 2])
