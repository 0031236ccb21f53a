"""Pad and Trilu at their arguments' edges, against onnxruntime (onnx.reference refuses these inputs): a
constant Pad whose negative pad on one side takes more than the input holds (it eats into the other side's
padding: the output has dim + begin + end values, as ONNX's shape inference says), and a Trilu whose k is
near int64's ends (numpy's own arithmetic overflowed)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.testing import run_engine

ort = pytest.importorskip("onnxruntime")


def _run_both(model: onnx.ModelProto, feeds: dict) -> tuple[np.ndarray, np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return run_engine(model, feeds)[0], sess.run(None, feeds)[0]


@pytest.mark.parametrize("shape, pads", [
    ((2,), [3, -4]), ((5,), [-9, 6]), ((0, 3), [7, 3, -1, 3]), ((4,), [-2**63, 2**63 - 1]),
    ((3, 4), [-1, 2, 2, -3]), ((6,), [-2, -1]),
])
def test_constant_pad_crops_after_padding(shape: tuple[int, ...], pads: list[int]) -> None:
    nodes = [helper.make_node("Pad", ["x", "pads", "value"], ["y"], mode="constant")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(np.array(pads, np.int64), "pads"),
                           numpy_helper.from_array(np.array(9.0, np.float32), "value")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    x = np.arange(1, 1 + int(np.prod(shape)), dtype=np.float32).reshape(shape)
    ours, theirs = _run_both(model, {"x": x})
    want = tuple(d + pads[a] + pads[len(shape) + a] for a, d in enumerate(shape))
    assert ours.shape == theirs.shape == want
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("k", [-2**63, -2**63 + 1, 2**63 - 1, -7, 7])
@pytest.mark.parametrize("upper", [0, 1])
def test_trilu_with_k_near_the_int64_ends(k: int, upper: int) -> None:
    g = helper.make_graph([helper.make_node("Trilu", ["x", "k"], ["y"], upper=upper)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])],
                          [numpy_helper.from_array(np.array(k, np.int64), "k")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    x = np.arange(1, 13, dtype=np.float32).reshape(3, 4)
    ours, theirs = _run_both(model, {"x": x})
    np.testing.assert_array_equal(ours, theirs)
