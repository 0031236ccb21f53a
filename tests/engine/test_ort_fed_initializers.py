"""The onnxruntime backend's rewrites take no fed initializer for a constant: an initializer also declared
as a graph input (IR ≥ 4) may be fed a value at each run, as onnxruntime lets it, so a Where's zero or
infinite fill, a ReduceSum's axes and a Pad's pads that are such initializers stay graph values (the
rewrites baked their stored values in: the fed ones were ignored). Nor do value types take a fed Reshape
shape's stored value for the reshaped dims (the leading sum after it was planned for them, and onnxruntime
failed on the fed ones). Oracle: plain onnxruntime on the model as it is; the numpy engine too."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from onnxtrain import InferenceSession, SessionOptions

VI = h.make_tensor_value_info
MASK = np.array([True, False, True, False])
X = np.array([1.0, 2.0, -3.0, 4.0], np.float32)


def _model(nodes, inputs, inits) -> onnx.ModelProto:
    g = h.make_graph(nodes, "g", inputs, [VI("y", T.FLOAT, None)], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)], ir_version=9)


def _where(fill_first: bool, stored: float) -> onnx.ModelProto:
    ins = ["m", "fill", "x"] if fill_first else ["m", "x", "fill"]
    return _model([h.make_node("Where", ins, ["y"])],
                  [VI("m", T.BOOL, [4]), VI("x", T.FLOAT, [4]), VI("fill", T.FLOAT, [])],
                  [nh.from_array(np.array(stored, np.float32), "fill")])


CASES = {
    "where zero fill": (_where(False, 0.0), {"m": MASK, "x": X, "fill": np.array(5.0, np.float32)}),
    "where infinite fill": (_where(True, -np.inf), {"m": MASK, "x": X, "fill": np.array(-1.0, np.float32)}),
    "leading sum axes": (
        _model([h.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=1)],
               [VI("x", T.FLOAT, [16, 64]), VI("axes", T.INT64, [1])],
               [nh.from_array(np.array([0], np.int64), "axes")]),
        {"x": np.arange(16 * 64, dtype=np.float32).reshape(16, 64) / 100, "axes": np.array([1], np.int64)}),
    "tiling pads": (
        _model([h.make_node("Pad", ["a", "pa"], ["A"]), h.make_node("Pad", ["b", "pb"], ["B"]),
                h.make_node("Sum", ["A", "B"], ["y"])],
               [VI("a", T.FLOAT, [1, 2]), VI("b", T.FLOAT, [1, 3]), VI("pa", T.INT64, [4])],
               [nh.from_array(np.array([0, 0, 0, 3], np.int64), "pa"),
                nh.from_array(np.array([0, 2, 0, 0], np.int64), "pb")]),
        {"a": np.array([[1, 2]], np.float32), "b": np.array([[10, 20, 30]], np.float32),
         "pa": np.array([0, 3, 0, 0], np.int64)}),
    "reshape to a fed shape, then a leading sum": (
        _model([h.make_node("Reshape", ["x", "shape"], ["r"]),
                h.make_node("ReduceSum", ["r", "axes"], ["y"], keepdims=0)],
               [VI("x", T.FLOAT, [1024]), VI("shape", T.INT64, [2])],
               [nh.from_array(np.array([16, 64], np.int64), "shape"),
                nh.from_array(np.array([0], np.int64), "axes")]),
        {"x": np.arange(1024, dtype=np.float32) / 100, "shape": np.array([8, 128], np.int64)}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_a_fed_initializer_is_no_constant_to_the_rewrites(case: str, backend: str) -> None:
    model, feeds = CASES[case]
    so = ort.SessionOptions()
    so.log_severity_level = 3  # (onnxruntime warns that such an initializer is not a constant)
    oracle = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    want = oracle.run(None, feeds)[0]
    stored = oracle.run(None, {k: v for k, v in feeds.items() if k in ("m", "x", "a", "b")})[0]
    assert want.shape != stored.shape or not np.allclose(want, stored)  # the fed value matters
    ours = SessionOptions()
    ours.add_session_config_entry("onnxtrain.backend", backend)
    got = InferenceSession(model.SerializeToString(), ours).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)
