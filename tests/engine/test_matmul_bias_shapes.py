"""The fused MatMul + bias Add's shape check, remembered per pair of shapes: the unfused graph's bits and
float64's values, whatever the bias and batch shapes from run to run, and the same error each time for a
bias that does not broadcast."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.engine.plan import EngineError, Plan


def test_matmul_bias_add_right_when_the_shapes_change_between_runs() -> None:
    """The fused MatMul + bias Add, whose bias check is remembered per pair of shapes, run on biases and
    batches that fit, grow the product (the unfused Add's result) or do not broadcast (the error every
    time), in turn: the unfused graph's bits, and float64's values."""
    rng = np.random.default_rng(11)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "b"], ["y"])]
    g = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    fused, plain = Plan(m), Plan(m, fuse=False)
    assert [st.node.op_type for st in fused.steps] == ["FusedMatMulAdd"]
    cases = [((5, 16), (8,)), ((3, 16), (3, 8)), ((1, 16), (4, 8)), ((2, 5, 16), (5, 1)), ((5, 16), (8,)),
             ((1, 16), (4, 8)), ((3, 16), (1, 1, 8))]
    for x_shape, b_shape in cases + cases[::-1]:
        feeds = {"x": rng.standard_normal(x_shape).astype(np.float32),
                 "b": rng.standard_normal(b_shape).astype(np.float32)}
        (got,) = fused.run(feeds)
        (want,) = plain.run(feeds)
        assert got.shape == want.shape and got.tobytes() == want.tobytes()
        np.testing.assert_allclose(got, feeds["x"].astype(np.float64) @ w + feeds["b"], rtol=1e-5, atol=1e-5)
    bad = {"x": np.ones((5, 16), np.float32), "b": np.ones(3, np.float32)}
    errors = []
    for _ in range(2):
        with pytest.raises(EngineError) as e:
            fused.run(bad)
        errors.append(str(e.value))
    # the unfused Add's error, naming its node (as onnxruntime's does)
    assert errors[0] == errors[1] and "could not be broadcast" in errors[0] and "(Add)" in errors[0]
