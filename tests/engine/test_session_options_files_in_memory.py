"""SessionOptions.add_external_initializers_from_files_in_memory refused part-way leaves the options as
they were: a list whose second entry is refused (a length past its buffer) registered the first file
before raising, so a session made later read that tensor from the half-applied call, not from its file."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnxtrain
from onnxtrain.errors import FailValueError


def _model_with_data_file(folder) -> str:
    """Y = X + W, W's four floats kept in ``w.bin`` beside the model."""
    w = np.array([1, 2, 3, 4], np.float32)
    (folder / "w.bin").write_bytes(w.tobytes())
    init = onnx.TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[4])
    init.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "w.bin"), ("offset", "0"), ("length", str(w.nbytes))):
        init.external_data.add(key=key, value=value)
    g = helper.make_graph([helper.make_node("Add", ["X", "W"], ["Y"])], "g",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [4])], [init])
    path = folder / "m.onnx"
    onnx.save_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


def test_a_refused_call_registers_no_file(tmp_path) -> None:
    path = _model_with_data_file(tmp_path)
    x = np.array([10, 20, 30, 40], np.float32)
    expected = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]
    other = np.full(4, 100, np.float32).tobytes()  # what w.bin would read as, had the call been taken
    so = onnxtrain.SessionOptions()
    with pytest.raises(FailValueError, match="'second.bin'"):
        so.add_external_initializers_from_files_in_memory(["w.bin", "second.bin"], [other, b"1234"],
                                                          [len(other), 5])
    got = onnxtrain.InferenceSession(path, so).run(None, {"X": x})[0]
    np.testing.assert_array_equal(got, expected)


def test_a_buffer_that_is_not_one_is_refused_naming_its_file(tmp_path) -> None:
    """A buffer without the buffer protocol is a FailValueError naming its file (not a bare TypeError),
    and the files before it are not registered either."""
    path = _model_with_data_file(tmp_path)
    x = np.ones(4, np.float32)
    expected = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]
    so = onnxtrain.SessionOptions()
    with pytest.raises(FailValueError, match="'second.bin'"):
        so.add_external_initializers_from_files_in_memory(["w.bin", "second.bin"],
                                                          [np.zeros(4, np.float32), "text"], [16, 4])
    np.testing.assert_array_equal(onnxtrain.InferenceSession(path, so).run(None, {"X": x})[0], expected)
