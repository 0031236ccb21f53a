"""Batched MatMul on the strided views attention makes (Transpose of a seq-first tensor), against
onnx.reference: the kernel copies B first when its rows lie a page or more apart and leaves other
layouts (nearer rows, transposed B) as they are; the values must not depend on the path."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnxtrain.engine.kernels import matmul as mm
from onnxtrain.engine.plan import Plan


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("perm_b", [(1, 2, 0, 3), (1, 2, 3, 0)], ids=["rows-strided", "transposed"])
@pytest.mark.parametrize("batch,heads", [(3, 2), (8, 16)], ids=["near", "far"])
def test_batched_matmul_on_transposed_views(batch, heads, perm_b, dtype) -> None:
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
    s, d = 16, 8
    a = rng.standard_normal((s, batch, heads, d)).astype(dtype)
    b_shape = (s, batch, heads, d) if perm_b == (1, 2, 3, 0) else (d, batch, heads, s)
    b = rng.standard_normal(b_shape).astype(dtype)
    row_bytes = b.strides[0] if perm_b == (1, 2, 0, 3) else b.itemsize
    assert (row_bytes >= mm._FAR_ROWS) == (perm_b == (1, 2, 0, 3) and batch == 8)  # both paths are covered
    (ours,) = Plan(m).run({"a": a, "b": b})
    (ref,) = ReferenceEvaluator(m).run(None, {"a": a, "b": b})
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows", [1, 32, 128, 129, 256])  # up to mm._FEW_ROWS = 128: as (B·Aᵀ)ᵀ
@pytest.mark.parametrize("bias_shape", [None, (64,), (1, 64), "full", ()])
def test_gemm_with_transposed_b_over_few_rows(rows: int, bias_shape, dtype) -> None:
    """A·Bᵀ with few rows is computed as (B·Aᵀ)ᵀ (``mm._FEW_ROWS``); the output is C-contiguous and agrees
    with onnx.reference, whatever the bias, alpha and beta."""
    et = TensorProto.FLOAT if dtype == np.float32 else TensorProto.DOUBLE
    inputs = ["a", "b"] + ([] if bias_shape is None else ["c"])
    g = helper.make_graph(
        [helper.make_node("Gemm", inputs, ["y"], transB=1, alpha=0.5, beta=2.0)], "g",
        [helper.make_tensor_value_info(n, et, None) for n in inputs],
        [helper.make_tensor_value_info("y", et, None)],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(rows)
    feeds = {k: rng.standard_normal(shape).astype(dtype) for k, shape in (("a", (rows, 96)), ("b", (64, 96)))}
    if bias_shape is not None:
        feeds["c"] = rng.standard_normal((rows, 64) if bias_shape == "full" else bias_shape).astype(dtype)
    (ours,) = Plan(m).run(feeds)
    (ref,) = ReferenceEvaluator(m).run(None, feeds)
    assert ours.shape == (rows, 64) and ours.dtype == dtype and ours.flags.c_contiguous
    np.testing.assert_allclose(ours, ref, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5)
