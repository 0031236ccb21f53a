"""InferenceSession where scripts written for onnxruntime meet it: feed conversions, outputs the caller owns,
run options, optional inputs, NodeArg shapes and error classes, each against onnxruntime's plain package."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.capi import _pybind_state as C

ort = pytest.importorskip("onnxruntime")


def _model() -> bytes:
    """x float [N, 3] → Relu (no declared shape) and Identity; s string [N] → Identity; W passed through."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Identity", ["x"], ["xid"]),
             helper.make_node("Identity", ["s"], ["s2"]), helper.make_node("Identity", ["W"], ["Wout"])]
    g = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3]),
         helper.make_tensor_value_info("s", TensorProto.STRING, ["N"])],
        [helper.make_tensor_value_info("r", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("xid", TensorProto.FLOAT, ["N", 3]),
         helper.make_tensor_value_info("s2", TensorProto.STRING, ["N"]),
         helper.make_tensor_value_info("Wout", TensorProto.FLOAT, [2])],
        [numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "W")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def _both(model: bytes):
    return (onnxtrain.InferenceSession(model),
            ort.InferenceSession(model, providers=["CPUExecutionProvider"]))


def test_lists_and_numpy_strings_are_converted_to_the_input_type() -> None:
    ours, theirs = _both(_model())
    for feeds in ({"x": [[1.0, -2.0, 3.0]], "s": np.array(["a", "bc"])[:1]},
                  {"x": np.array([[1.0, -2.0, 3.0]], np.float32), "s": ["p"]}):
        a, b = ours.run(None, feeds), theirs.run(None, feeds)
        for u, v in zip(a, b):
            assert u.dtype == v.dtype and u.shape == v.shape
            np.testing.assert_array_equal(u, v)


def test_outputs_are_the_callers_own_arrays() -> None:
    ours, theirs = _both(_model())
    x = np.array([[1.0, -2.0, 3.0]], np.float32)
    feeds = {"x": x, "s": np.array(["a"], object)}
    for sess in (ours, theirs):
        xid, wout = sess.run(["xid", "Wout"], feeds)
        assert xid is not x and not np.shares_memory(xid, x)
        wout[0] = 99.0  # writeable, and the model's weight stays as it was
        x[0, 0] = 42.0
        assert xid[0, 0] == 1.0
        x[0, 0] = 1.0
        np.testing.assert_array_equal(sess.run(["Wout"], feeds)[0], [1.0, 2.0])


def test_terminate_unknown_outputs_and_string_output_names() -> None:
    ours, theirs = _both(_model())
    feeds = {"x": np.zeros((1, 3), np.float32), "s": np.array(["a"], object)}
    theirs_c = ort.capi.onnxruntime_pybind11_state
    for mod, sess, fail in ((onnxtrain, ours, C.Fail), (ort, theirs, theirs_c.Fail)):
        ro = mod.RunOptions()
        ro.terminate = True
        with pytest.raises(fail, match="terminate"):
            sess.run(None, feeds, ro)
    with pytest.raises(C.InvalidArgument, match="unknown output 'nope'"):
        ours.run(["nope"], feeds)
    with pytest.raises(theirs_c.InvalidArgument):
        theirs.run(["nope"], feeds)
    for sess in (ours, theirs):
        with pytest.raises(TypeError):
            sess.run("r", feeds)


def test_an_optional_input_may_be_left_out() -> None:
    opt = helper.make_tensor_value_info("o", TensorProto.FLOAT, [None])
    opt.type.CopyFrom(helper.make_optional_type_proto(opt.type))
    g = helper.make_graph([helper.make_node("OptionalHasElement", ["o"], ["has"]),
                           helper.make_node("Identity", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]), opt],
                          [helper.make_tensor_value_info("has", TensorProto.BOOL, []),
                           helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    ours, theirs = _both(model.SerializeToString())
    x = np.ones(2, np.float32)
    has = [bool(sess.run(["has"], {"x": x})[0]) for sess in (ours, theirs)]
    assert has == [False, False]
    with pytest.raises(C.InvalidArgument, match="missing input"):
        ours.run(None, {})


def test_node_arg_shapes_and_model_errors() -> None:
    ours, theirs = _both(_model())
    # no declared shape: the one shape inference finds (['N', 3]), as onnxruntime's
    assert ours.get_outputs()[0].shape == ["N", 3]
    assert [o.shape for o in ours.get_outputs()] == [o.shape for o in theirs.get_outputs()]
    with pytest.raises(C.NoSuchFile) as e:
        onnxtrain.InferenceSession("/nonexistent/model.onnx")
    assert isinstance(e.value, FileNotFoundError)
    with pytest.raises(C.InvalidProtobuf):
        onnxtrain.InferenceSession(b"not a model at all")


def test_iobinding_refuses_names_the_session_lacks_and_ortvalues_take_onnx_type_numbers() -> None:
    ours, theirs = _both(_model())
    x = np.zeros((1, 3), np.float32)
    for sess in (ours, theirs):
        io = sess.io_binding()
        with pytest.raises(Exception, match="zz"):
            io.bind_cpu_input("zz", x)
        io.bind_cpu_input("x", x)
    with pytest.raises(C.InvalidArgument, match="no output 'zz'"):
        ours.io_binding().bind_output("zz")
    for mod in (onnxtrain, ort):
        v = mod.OrtValue.ortvalue_from_shape_and_type([3], TensorProto.FLOAT)
        assert v.shape() == [3] and v.data_type() == "tensor(float)"
        assert mod.OrtValue.ortvalue_from_shape_and_type([2], np.int64).data_type() == "tensor(int64)"


def test_model_version_unset_set_to_zero_and_set() -> None:
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    for version in (None, 0, 3):
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        if version is not None:
            m.model_version = version
        ours, theirs = _both(m.SerializeToString())
        assert ours.get_modelmeta().version == theirs.get_modelmeta().version, version


def test_a_negative_declared_dim_is_reported_unknown() -> None:
    """Some converters declare an unknown size as dim_value -1: get_inputs/get_outputs give None there, as
    onnxruntime does (a script that fills in the unknown dims would make a negative size of -1)."""
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [-1, 3])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    ours, theirs = _both(model.SerializeToString())
    for get in ("get_inputs", "get_outputs"):
        shapes = [a.shape for a in getattr(ours, get)()]
        assert shapes == [a.shape for a in getattr(theirs, get)()] == [[None, 3]]
