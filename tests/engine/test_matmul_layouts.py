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


@pytest.mark.parametrize(
    "a_shape,b_shape,transposed_b",
    [((1, 50, 3, 4), (1, 1, 4, 5), False), ((1, 50, 3, 4), (1, 1, 4, 5), True),
     ((2, 3, 4), (1, 1, 4, 5), False), ((6, 3, 4), (1, 4, 5), True), ((2, 6, 3, 4), (2, 1, 4, 5), False)],
    ids=["rnn-grad", "rnn-grad-transposed", "b-has-more-dims", "3d", "b-batch-not-one"],
)
def test_matmul_with_b_of_unit_batch_dims_is_one_gemm(a_shape, b_shape, transposed_b) -> None:
    """A B whose batch dims are all 1 multiplies every matrix of A: one 2-D GEMM over A's rows, with the
    broadcast output shape; a B with a real batch keeps numpy's batched path. Against float64 numpy."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((*a_shape[:-1], a_shape[-1] + 3)).astype(np.float32)[..., :a_shape[-1]]  # strided
    b = rng.standard_normal(b_shape).astype(np.float32)
    if transposed_b:  # the transpose of a C-contiguous weight, as an RNN gradient's W·ᵀ is
        b = np.ascontiguousarray(b.swapaxes(-1, -2)).swapaxes(-1, -2)
    (y,) = mm.matmul([a, b], None)
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    assert y.shape == want.shape and y.dtype == np.float32
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "equation,shapes",
    [
        ("dtbg,dtbi->dgi", [(1, 5, 3, 8), (1, 5, 3, 4)]),  # an RNN gradient's dW
        ("dtbg,dtbi->dgi", [(2, 5, 3, 8), (2, 5, 3, 4)]),  # both directions: a batch of 2
        ("bij,bjk->bik", [(4, 3, 5), (4, 5, 2)]),
        ("ij,jk->ki", [(3, 5), (5, 2)]),  # output transposed
        ("abc,cd->dba", [(2, 3, 4), (4, 5)]),
        ("ijk,jl->il", [(3, 4, 5), (4, 2)]),  # k only in A and not kept: summed first
        ("ij,jkl->ik", [(3, 4), (4, 2, 6)]),  # l only in B
        ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)]),  # attention scores
        ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),  # ellipsis: numpy's einsum
        ("ij,ij->ij", [(3, 4), (3, 4)]),  # nothing summed: numpy's einsum
        ("ii,ij->j", [(3, 3), (3, 4)]),  # repeated subscript: numpy's einsum
        ("ij,jk", [(3, 4), (4, 5)]),  # implicit output: numpy's einsum
    ],
)
def test_einsum_as_batched_matmul_matches_numpy(equation, shapes) -> None:
    """Two-operand contractions run as one (batched) BLAS product; the rest as np.einsum. Against float64
    np.einsum, with strided float32 operands, and twice (the plan is cached per shape)."""
    rng = np.random.default_rng(2)
    ops = [np.asfortranarray(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Einsum", ["a", "b"], ["y"], equation=equation)], "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("a", "b")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]),
        opset_imports=[helper.make_opsetid("", 17)])
    plan = Plan(model)
    want = np.einsum(equation, *(o.astype(np.float64) for o in ops))
    for _ in range(2):
        (y,) = plan.run({"a": ops[0], "b": ops[1]})
        assert y.shape == want.shape and y.dtype == np.float32
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    lowered = mm._Contraction.of(equation, *ops)
    assert (lowered is not None) == (equation.count(",") == 1 and "->" in equation and "." not in equation
                                     and equation not in ("ij,ij->ij", "ii,ij->j"))


def _split_kernel_run(a: np.ndarray, b: np.ndarray, threads: int) -> tuple[np.ndarray, list[int]]:
    """The MatMul kernel on (a, b) with ``threads`` threads, and the parts each of its splits made."""
    from onnxtrain.engine.parallel import recording_splits, running_with
    from onnxtrain.engine.registry import Attrs, find_kernel

    parts: list[int] = []
    with running_with(threads), recording_splits(parts):
        (y,) = find_kernel("MatMul", 17)([a, b], Attrs({}, op="MatMul", opset=17))
    return y, parts


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", ["contiguous", "views", "broadcast_a", "broadcast_b"])
def test_batched_matmul_split_over_threads_has_numpys_bits(dtype, layout) -> None:
    """Attention-score-shaped batches are split over the threads along the first batch axis (one part per
    thread, OpenBLAS on the calling thread): every layout gives numpy's own batched product to the bit."""
    rng = np.random.default_rng(1)
    batch, heads, s, d = 16, 8, 64, 32
    if layout == "views":  # q and k as the attention's transposes of (S, B, H, d) tensors
        a = rng.standard_normal((s, batch, heads, d)).astype(dtype).transpose(1, 2, 0, 3)
        b = rng.standard_normal((s, batch, heads, d)).astype(dtype).transpose(1, 2, 3, 0)
    else:
        a = rng.standard_normal((1 if layout == "broadcast_a" else batch, heads, s, d)).astype(dtype)
        b = rng.standard_normal((1 if layout == "broadcast_b" else batch, heads, d, s)).astype(dtype)
    assert s * d * s * batch * heads >= mm.SPLIT_BATCH_MIN_WORK
    y, parts = _split_kernel_run(a, b, 2)
    assert parts == [2]
    want = np.matmul(a, b)
    assert y.shape == want.shape and y.dtype == want.dtype
    np.testing.assert_array_equal(y, want)
    (ref,) = _split_kernel_run(a, b, 1)[:1]
    np.testing.assert_array_equal(y, ref)


@pytest.mark.parametrize("shapes", [
    ((16, 8, 64, 64), (16, 8, 64, 32)),  # narrow products (attention's P·V): numpy's loop is as fast
    ((16, 8, 64, 128), (16, 8, 128, 64)),  # deeper than wide
    ((2, 4, 64, 32), (2, 4, 32, 64)),  # too little work to wake a thread for
    ((16, 64, 32), (32, 64)),  # one matrix B: a single GEMM already
])
def test_batched_matmul_not_split_where_numpys_loop_wins(shapes) -> None:
    """No split where it does not pay, and the product within float32 rounding of float64's: not numpy's
    bits, since the one-GEMM case (16·64 rows) is large enough for OpenBLAS to split over its own threads,
    whose Haswell/Zen kernel then rounds some rows otherwise (AMD EPYC host: 11 % of the outputs, by up to
    5.7e-6)."""
    rng = np.random.default_rng(2)
    a, b = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    y, parts = _split_kernel_run(a, b, 2)
    assert parts == []
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    scale = np.matmul(np.abs(a64), np.abs(b64))  # the terms' magnitude of each output
    assert y.shape == scale.shape and y.dtype == np.float32
    assert np.all(np.abs(y - np.matmul(a64, b64)) <= 8 * np.finfo(np.float32).eps * scale)
