"""Normalizations over long rows sum them pairwise: einsum's running sums drifted, and a LayerNorm over rows
of 2^18 values about 100 + U(0, 1) was 28 times less accurate than onnxruntime's (norm-wise error against
float64 2.2e-4 against 7.8e-6). Oracles: float64 formulas (the statistics within a few ulps), onnxruntime's
float32 error (the output within a few times it: what is left is the rounding of the mean to float32)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnxtrain


def _model(op: str, n: int, channels: int) -> bytes:
    shape = [2, channels, n]
    scale = [n] if op == "LayerNormalization" else [channels]
    layer = op == "LayerNormalization"
    outputs = ["Y", "Mean", "InvStd"] if layer else ["Y"]
    node = helper.make_node(op, ["X", "S", "B"], outputs, epsilon=1e-5, **({"axis": -1} if layer else {}))
    stats = [helper.make_tensor_value_info(o, TensorProto.FLOAT, [2, channels, 1]) for o in outputs[1:]]
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, shape),
                                        helper.make_tensor_value_info("S", TensorProto.FLOAT, scale),
                                        helper.make_tensor_value_info("B", TensorProto.FLOAT, scale)],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, shape), *stats])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("op", ["LayerNormalization", "InstanceNormalization"])
def test_long_rows_are_normalized_as_accurately_as_onnxruntime(op) -> None:
    n, channels = 1 << 18, 2
    x = (100 + np.random.default_rng(13).random((2, channels, n))).astype(np.float32)
    feeds = {"X": x, "S": np.ones(n if op == "LayerNormalization" else channels, np.float32)}
    feeds["B"] = np.zeros_like(feeds["S"])
    x64 = x.astype(np.float64)
    want = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + float(np.float32(1e-5)))
    model = _model(op, n, channels)
    ours = onnxtrain.InferenceSession(model).run(None, feeds)
    theirs = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]

    def error(y: np.ndarray) -> float:
        return float(np.linalg.norm(y - want) / np.linalg.norm(want))

    assert error(ours[0]) <= 3 * error(theirs), (error(ours[0]), error(theirs))
    if op == "LayerNormalization":  # the statistics: einsum's were 10 (mean) and 130 (1/std) ulps off
        mean = x64.mean(-1, keepdims=True)
        inv = 1 / np.sqrt(x64.var(-1, keepdims=True) + float(np.float32(1e-5)))
        assert np.all(np.abs(ours[1] - mean) <= 2 * np.spacing(mean.astype(np.float32)))
        assert np.all(np.abs(ours[2] - inv) <= 8 * np.spacing(inv.astype(np.float32)))
