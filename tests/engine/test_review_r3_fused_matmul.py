"""Review R3 (of 7ba0b0a7, the float16 path of the fused MatMul + Add step): its fix answered a bias that
does not broadcast, but kernels/matmul.half_product_plus multiplies the operands itself first, and
np.matmul's ValueError for operands fed at run time that do not multiply escaped there: the run failed
naming 'FusedMatMulAdd(/lin/Add)', no node of the model, where the float32 path (the MatMul run as its own
step) and the unfused plan name node '/lin/MatMul'. Oracles: onnxruntime 1.32 refuses the feeds (its
fused Gemm made of '/lin/MatMul'), and the model's own node list."""

from __future__ import annotations

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")

from onnx import helper  # noqa: E402

import onnxtrain  # noqa: E402
from tests.engine.unfused_failures import fails_as_unfused  # noqa: E402


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_a_fused_matmul_of_operands_that_do_not_multiply_fails_naming_the_matmul(dtype) -> None:
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="/lin/MatMul"),
             helper.make_node("Add", ["m", "b"], ["y"], name="/lin/Add")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem, ["N", "K"]),
                                       helper.make_tensor_value_info("w", elem, ["K2", 3]),
                                       helper.make_tensor_value_info("b", elem, [3])],
                          [helper.make_tensor_value_info("y", elem, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    model = model.SerializeToString()
    feeds = {"x": np.ones((2, 5), dtype), "w": np.ones((4, 3), dtype), "b": np.ones(3, dtype)}
    sess = fails_as_unfused(model, feeds, "/lin/MatMul", "MatMul")
    assert len(sess._plan.steps) == 1  # (fused when optimizing)
    # operands that multiply still give onnxruntime's values
    feeds["x"] = np.arange(8, dtype=dtype).reshape(2, 4)
    want, = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    got, = onnxtrain.InferenceSession(model).run(None, feeds)
    np.testing.assert_array_equal(got, want)
