"""onnxtrain's ONNX backend (``onnxtrain.backend``) against onnxruntime's on the same feeds."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxtrain.backend import OnnxtrainBackend


def _model():
    node = helper.make_node("DequantizeLinear", ["x", "scale", "zero"], ["y"])
    g = helper.make_graph(
        [node], "dq",
        [helper.make_tensor_value_info("x", TensorProto.UINT8, [4]),
         helper.make_tensor_value_info("scale", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("zero", TensorProto.UINT8, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("as_list", [True, False])
def test_numpy_scalar_inputs_run_as_in_onnxruntimes_backend(as_list: bool) -> None:
    ort_backend = pytest.importorskip("onnxruntime.backend")
    x = np.array([0, 3, 200, 255], np.uint8)
    inputs = [x, np.float32(0.5), np.uint8(3)]
    want = ort_backend.prepare(_model()).run(inputs)
    feeds = inputs if as_list else dict(zip(["x", "scale", "zero"], inputs))
    got = OnnxtrainBackend.prepare(_model()).run(feeds)
    assert len(got) == len(want) == 1
    np.testing.assert_array_equal(got[0], want[0])
    assert got[0].dtype == want[0].dtype
