"""Batched MatMul on the strided views attention makes (Transpose of a seq-first tensor), against
onnx.reference: the kernel copies row-strided B operands and leaves transposed ones as they are."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnxtrain.engine.plan import Plan


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("perm_b", [(1, 2, 0, 3), (1, 2, 3, 0)], ids=["rows-strided", "transposed"])
def test_batched_matmul_on_transposed_views(perm_b, dtype) -> None:
    et = TensorProto.FLOAT if dtype == np.float32 else TensorProto.DOUBLE
    nodes = [
        helper.make_node("Transpose", ["a"], ["at"], perm=[1, 2, 0, 3]),  # (S, B, H, d) -> (B, H, S, d)
        helper.make_node("Transpose", ["b"], ["bt"], perm=list(perm_b)),
        helper.make_node("MatMul", ["at", "bt"], ["y"]),
    ]
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, et, None) for n in ("a", "b")],
        [helper.make_tensor_value_info("y", et, None)],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(0)
    a = rng.standard_normal((16, 3, 2, 8)).astype(dtype)
    b = rng.standard_normal((16, 3, 2, 8) if perm_b == (1, 2, 3, 0) else (8, 3, 2, 16)).astype(dtype)
    (ours,) = Plan(m).run({"a": a, "b": b})
    (ref,) = ReferenceEvaluator(m).run(None, {"a": a, "b": b})
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-6)
