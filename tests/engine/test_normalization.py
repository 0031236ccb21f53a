"""Matmul, reduction and normalization kernels on cases the op table cannot check against onnx.reference.

onnx.reference departs from the spec for opset<13 Softmax (no flatten-to-2D) and for p=1
LpNormalization (sums x, not |x|), and cannot run float64 MeanVarianceNormalization; onnxruntime
is the oracle there. Also: half precision, optional outputs, momentum, and inputs left untouched.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxtrain.engine import compile_model


def _model(op: str, inputs: list[Any], opset: int, outs: list[str] | None = None,
           **attrs: Any) -> onnx.ModelProto:
    names = [f"x{i}" if v is not None else "" for i, v in enumerate(inputs)]
    outs = outs or ["y0"]
    g_in = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for n, v in zip(names, inputs) if n]
    elem = helper.np_dtype_to_tensor_dtype(inputs[0].dtype)
    g_out = [helper.make_tensor_value_info(n, elem, None) for n in outs if n]
    graph = helper.make_graph([helper.make_node(op, names, outs, **attrs)], op, g_in, g_out)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _feeds(inputs: list[Any]) -> dict[str, Any]:
    return {f"x{i}": v for i, v in enumerate(inputs) if v is not None}


def _ours(op: str, inputs: list[Any], opset: int, outs: list[str] | None = None, **attrs: Any):
    return compile_model(_model(op, inputs, opset, outs, **attrs)).run(_feeds(inputs))


def _run_both(op: str, inputs: list[Any], opset: int, **attrs: Any):
    ort = pytest.importorskip("onnxruntime")
    model = _model(op, inputs, opset, **attrs)
    ours = compile_model(model).run(_feeds(inputs))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return ours, sess.run(None, _feeds(inputs))


_rng = np.random.default_rng(7)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("axis", [0, 1, -2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_before_13_flattens_to_2d(op: str, axis: int, dtype) -> None:
    x = _rng.uniform(-3, 3, (2, 3, 4)).astype(dtype)
    (ours,), (theirs,) = _run_both(op, [x], 11, axis=axis)
    assert ours.dtype == dtype
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)


def test_softmax_large_and_infinite_inputs_stay_finite() -> None:
    x = np.array([[1000.0, 1001.0, -np.inf], [-1e30, 0.0, 1e30]], dtype=np.float32)
    (y,) = _ours("Softmax", [x], 13)
    (ly,) = _ours("LogSoftmax", [x], 13)
    np.testing.assert_allclose(y, [[1 / (1 + np.e), np.e / (1 + np.e), 0], [0, 0, 1]], rtol=1e-6)
    assert np.isfinite(ly[:, :2]).all() and ly[0, 2] == -np.inf


def test_lp_normalization_l1_uses_absolute_values() -> None:
    x = _rng.uniform(-2, 2, (3, 4, 2)).astype(np.float32)
    x[1] = 0  # an all-zero slice stays zero
    (ours,), (theirs,) = _run_both("LpNormalization", [x], 13, axis=1, p=1)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)
    assert not ours[1].any()


@pytest.mark.parametrize("p", [1, 2])
def test_lp_normalization_of_a_slice_whose_norm_underflows_is_zero_as_onnxruntime(p: int) -> None:
    x = np.array([[0, 0, 0], [1e-30, -2e-30, 0], [3, 4, 0]], np.float32)  # 1e-60 underflows float32
    (ours,), (theirs,) = _run_both("LpNormalization", [x], 13, axis=1, p=p)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("axes", [[0, 2, 3], [1], [2, 3]])
def test_mean_variance_normalization_matches_onnxruntime(axes: list[int]) -> None:
    x = _rng.uniform(-2, 2, (2, 3, 2, 4)).astype(np.float32)
    (ours,), (theirs,) = _run_both("MeanVarianceNormalization", [x], 13, axes=axes)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axes", [[-1, 2, 3], [1, -3], [0, -4, 2]])
def test_mean_variance_normalization_with_an_axis_given_twice_matches_onnxruntime(axes: list[int]) -> None:
    """An axis named twice (-1 and 3) is normalised over once, as onnxruntime's ReduceMeans take it (numpy
    refused the repeated axis)."""
    x = _rng.uniform(-2, 2, (2, 3, 2, 4)).astype(np.float32)
    (ours,), (theirs,) = _run_both("MeanVarianceNormalization", [x], 13, axes=axes)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_layer_normalization_optional_outputs() -> None:
    x = _rng.uniform(-2, 2, (3, 5)).astype(np.float32)
    w, b = np.full(5, 2.0, np.float32), np.ones(5, np.float32)
    y, inv = _ours("LayerNormalization", [x, w, b], 17, outs=["y", "", "inv"], epsilon=1e-5)
    expect_inv = 1 / np.sqrt(x.var(axis=1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(inv, expect_inv, rtol=1e-6)
    np.testing.assert_allclose(y, (x - x.mean(1, keepdims=True)) * expect_inv * 2 + 1, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op, shapes, attrs", [
    ("MatMul", [(2, 3, 8), (8, 4)], {}),
    ("Gemm", [(3, 8), (4, 8), (4,)], {"transB": 1, "alpha": 0.5}),
    ("Einsum", [(3, 8), (8, 4)], {"equation": "ij,jk->ik"}),
    ("Softmax", [(3, 8)], {}),
    ("LayerNormalization", [(3, 8), (8,), (8,)], {}),
    ("ReduceSum", [(3, 8)], {"keepdims": 0}),
])
def test_float16_keeps_its_dtype_and_computes_in_float32(op: str, shapes, attrs) -> None:
    ins32 = [_rng.uniform(-1, 1, s).astype(np.float32) for s in shapes]
    ins16 = [a.astype(np.float16) for a in ins32]
    opset = 17
    (y16,) = _ours(op, ins16, opset, **attrs)
    (y32,) = _ours(op, [a.astype(np.float32) for a in ins16], opset, **attrs)
    assert y16.dtype == np.float16
    np.testing.assert_allclose(y16.astype(np.float32), y32, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("opset", [9, 15])
def test_float16_batch_norm_inference_matches_onnxruntime(opset: int) -> None:
    # the folded scale and shift are float32: folded in float16 (as before) the shift carried a half ulp
    # of error into every output (1,401 of 4,608 outputs off, near-zero ones by 10x)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 16, 12, 12)).astype(np.float16)
    scale, bias = rng.uniform(0.5, 2, 16), rng.standard_normal(16)
    mean, var = rng.standard_normal(16) * 3, rng.uniform(0.1, 4, 16)
    params = [v.astype(np.float16) for v in (scale, bias, mean, var)]
    ours, theirs = _run_both("BatchNormalization", [x, *params], opset, epsilon=1e-3)
    f64 = [v.astype(np.float64) for v in (x, *params)]
    exact = ((f64[0] - f64[3][:, None, None]) / np.sqrt(f64[4][:, None, None] + 1e-3) * f64[1][:, None, None]
             + f64[2][:, None, None]).astype(np.float16)
    assert ours[0].dtype == np.float16
    # float32 work rounded to float16: a few values round the other way (double rounding), by one ulp
    for want in (theirs[0], exact):
        assert np.count_nonzero(ours[0] != want) <= 5
        np.testing.assert_allclose(ours[0].astype(np.float64), want.astype(np.float64),
                                   rtol=2**-10, atol=1e-6)


@pytest.mark.parametrize("opset", [9, 15])
@pytest.mark.parametrize("momentum", [0.9, 0.7])
def test_float16_running_statistics_are_rounded_once_as_onnxruntimes(opset: int, momentum: float) -> None:
    """input_mean·momentum + batch_mean·(1 − momentum) of float16 statistics in float32, rounded once: the
    product in float16 (numpy rounds momentum to float16 too) put 1-ulp errors in about a third of the
    channels (75 of 256 here), where onnxruntime's are the correctly rounded values but for a rare one."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(11)
    c = 256
    x = rng.standard_normal((8, c, 5, 5)).astype(np.float16)
    params = [rng.uniform(0.5, 1.5, c), rng.uniform(-1, 1, c), rng.uniform(-1, 1, c),
              rng.uniform(0.5, 1.5, c)]
    inputs = [x, *(v.astype(np.float16) for v in params)]
    outs = ["y", "rm", "rv"] if opset == 15 else ["y", "rm", "rv", "bm", "bv"]
    attrs = {"momentum": momentum, "epsilon": 1e-5} | ({"training_mode": 1} if opset == 15 else {})
    model = _model("BatchNormalization", inputs, opset, outs, **attrs)
    ours = compile_model(model).run(_feeds(inputs))
    theirs = ort.InferenceSession(model.SerializeToString(),
                                  providers=["CPUExecutionProvider"]).run(None, _feeds(inputs))
    x64, m = x.astype(np.float64), float(np.float32(momentum))
    exact = [inputs[3].astype(np.float64) * m + x64.mean(axis=(0, 2, 3)) * (1 - m),
             inputs[4].astype(np.float64) * m + x64.var(axis=(0, 2, 3)) * (1 - m)]
    for k in (1, 2):
        assert ours[k].dtype == np.float16
        np.testing.assert_array_equal(ours[k], theirs[k])
        # float32 work rounded to float16 (as onnxruntime's): within an ulp of the exact value, and the
        # correctly rounded one but for a rare double rounding
        want = exact[k - 1].astype(np.float16)
        assert np.count_nonzero(ours[k] != want) <= 2
        np.testing.assert_allclose(ours[k].astype(np.float64), exact[k - 1], rtol=2**-10)


def test_batch_normalization_training_updates_running_stats() -> None:
    x = _rng.uniform(-2, 2, (4, 3, 5)).astype(np.float32)
    scale, bias = np.array([1.0, 2.0, 0.5], np.float32), np.array([0.0, 1.0, -1.0], np.float32)
    mean, var = np.array([0.1, 0.2, 0.3], np.float32), np.array([1.0, 2.0, 3.0], np.float32)
    y, rm, rv = _ours("BatchNormalization", [x, scale, bias, mean, var], 15, outs=["y", "rm", "rv"],
                      training_mode=1, momentum=0.9, epsilon=1e-5)
    bm, bv = x.mean(axis=(0, 2)), x.var(axis=(0, 2))
    np.testing.assert_allclose(rm, 0.9 * mean + 0.1 * bm, rtol=1e-6)
    np.testing.assert_allclose(rv, 0.9 * var + 0.1 * bv, rtol=1e-6)
    expect = (x - bm[:, None]) / np.sqrt(bv[:, None] + 1e-5) * scale[:, None] + bias[:, None]
    np.testing.assert_allclose(y, expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op, inputs, opset, attrs", [
    ("Gemm", [np.ones((2, 3), np.float32), np.ones((3, 4), np.float32), np.ones((2, 4), np.float32)], 13, {}),
    ("Gemm", [np.ones((2, 3), np.float32), np.ones((3, 4), np.float32), np.ones((4,), np.float32)], 13,
     {"alpha": 2.0, "beta": 3.0}),
    ("BatchNormalization", [np.ones((2, 3, 2), np.float32)] + [np.ones(3, np.float32)] * 4, 15,
     {"training_mode": 1}),
    ("LayerNormalization", [np.ones((2, 3), np.float32), np.ones(3, np.float32), np.ones(3, np.float32)],
     17, {}),
    ("ReduceLogSumExp", [np.ones((2, 3), np.float32), np.array([1], np.int64)], 18, {}),
    ("LpNormalization", [np.ones((2, 3), np.float32)], 13, {}),
])
def test_kernels_leave_inputs_untouched(op: str, inputs: list[Any], opset: int, attrs: dict) -> None:
    before = [a.copy() for a in inputs]
    _ours(op, inputs, opset, **attrs)
    for a, b in zip(inputs, before):
        np.testing.assert_array_equal(a, b)


def test_reduce_log_sum_exp_of_minus_inf_rows() -> None:
    x = np.array([[-np.inf, -np.inf], [0.0, -np.inf], [1e4, 1e4]], dtype=np.float32)
    (y,) = _ours("ReduceLogSumExp", [x, np.array([1], np.int64)], 18, keepdims=0)
    np.testing.assert_allclose(y, [-np.inf, 0.0, 1e4 + np.log(2)], rtol=1e-6)


@pytest.mark.parametrize("axes, keepdims", [([0, 1], 1), ([1, 0], 0), ([0], 0), ([-3, -2], 1), ([0, 2], 0),
                                            ([2], 1), ([-1], 0)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_reduce_sum_over_leading_or_last_axes_matches_float64_sums(axes, keepdims, dtype) -> None:
    """Bias gradients (a sum over the leading axes) and row sums (the last axis), BLAS products with ones,
    against exact sums, with the shapes of numpy's; other axes and small inputs go through numpy's
    reduction or einsum, as accurately."""
    x = (_rng.standard_normal((24, 64, 40)) + 0.5).astype(dtype)
    (y,) = _ours("ReduceSum", [x, np.array(axes, np.int64)], 13, keepdims=keepdims)
    exact = x.astype(np.float64).sum(axis=tuple(axes), keepdims=bool(keepdims))
    assert y.dtype == dtype and y.shape == exact.shape
    tol = 1e-6 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(y, exact, rtol=tol, atol=tol * np.abs(exact).max())
    small = x[:2, :3]
    (z,) = _ours("ReduceSum", [small, np.array(axes, np.int64)], 13, keepdims=keepdims)
    np.testing.assert_allclose(z, small.astype(np.float64).sum(axis=tuple(axes), keepdims=bool(keepdims)),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("shape", [(16, 24, 9, 10), (3, 5, 7), (2, 4, 3, 3, 2), (64, 6, 28, 28)])
@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean"])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_reduce_over_all_but_the_channel_axis_matches_float64(shape, op, keepdims, dtype) -> None:
    """BatchNorm's per-channel sums and means (every axis but 1; BLAS row sums, einsum when small), in
    any axis order, against exact ones."""
    x = (_rng.standard_normal(shape) + 0.5).astype(dtype)
    axes = [0, *range(2, len(shape))][::-1]
    (y,) = _ours(op, [x, np.array(axes, np.int64)], 18, keepdims=keepdims)
    exact = x.astype(np.float64)
    exact = (exact.sum if op == "ReduceSum" else exact.mean)(axis=tuple(axes), keepdims=bool(keepdims))
    assert y.dtype == dtype and y.shape == exact.shape
    tol = 1e-6 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(y, exact, rtol=tol, atol=tol * np.abs(exact).max())


@pytest.mark.parametrize("shape", [(512, 784), (300, 7, 11), (1000,), (5, 3)])
@pytest.mark.parametrize("op", ["ReduceSumSquare", "ReduceL2"])
@pytest.mark.parametrize("axes, keepdims", [(None, 0), (None, 1), ("all", 0)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sum_of_squares_over_every_axis_matches_float64(shape, op, axes, keepdims, dtype,
                                                        monkeypatch) -> None:
    """A gradient's squared norm (clipping) by BLAS dot products over rows, summed pairwise, as accurate
    as numpy's pairwise sum of the squares; the path is taken from BLAS_SUM_MIN values on."""
    from onnxtrain.engine.kernels import reduce

    taken: list[bool] = []
    real = reduce._all_sum_square
    monkeypatch.setattr(reduce, "_all_sum_square", lambda *a: taken.append(True) or real(*a))
    x = (np.random.default_rng(7).standard_normal(shape) * 1e-3).astype(dtype)
    ins = [x] if axes is None else [x, np.arange(len(shape), dtype=np.int64)[::-1].copy()]
    (y,) = _ours(op, ins, 18, keepdims=keepdims)
    exact = np.square(x.astype(np.float64)).sum(keepdims=bool(keepdims))
    if op == "ReduceL2":
        exact = np.sqrt(exact)
    assert y.dtype == dtype and y.shape == exact.shape
    np.testing.assert_allclose(y, exact, rtol=1e-6 if dtype == np.float32 else 1e-14)
    assert taken and (real(x, None, bool(keepdims)) is not None) == (x.size >= reduce.BLAS_SUM_MIN)


@pytest.mark.parametrize("op, expect", [("ReduceL1", [[1, 2]]), ("ReduceL2", [[1, 2]]),
                                        ("ReduceSumSquare", [[1, 4]]), ("ReduceSum", [[-1, 2]]),
                                        ("ReduceLogSumExp", [[-1, 2]])])
def test_noop_with_empty_axes_keeps_the_elementwise_part(op: str, expect) -> None:
    x = np.array([[-1.0, 2.0]], dtype=np.float32)
    (y,) = _ours(op, [x, np.array([], np.int64)], 18, noop_with_empty_axes=1)
    np.testing.assert_allclose(y, expect, rtol=1e-6)


def test_row_max_is_numpy_max_for_every_width() -> None:
    from onnxtrain.engine.kernels.normalization import row_max

    rng = np.random.default_rng(0)
    for n in range(1, 131):
        x = rng.standard_normal((37, n)).astype(np.float32)
        if n > 3:
            x[5, 2] = np.nan  # NaN propagates as in np.max
        got, want = row_max(x), x.max(axis=1, keepdims=True)
        assert got.shape == want.shape
        assert np.array_equal(got, want, equal_nan=True), n
    wide, strided = rng.standard_normal((9, 1000)), rng.standard_normal((9, 300))[:, ::2]
    for x in (wide, strided, np.full((3, 70), -np.inf)):
        assert np.array_equal(row_max(x), x.max(axis=1, keepdims=True))


def _softmax64(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_softmax_without_shift_is_within_a_few_ulp_and_falls_back_when_exp_could_overflow() -> None:
    from onnxtrain.engine.kernels.normalization import softmax_along

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((512, 64)) * 5).astype(np.float32)  # |x| < 80: exp(x) without a shift
    ref = _softmax64(x)
    ulp = np.abs(softmax_along(x, -1) - ref) / np.spacing(ref.astype(np.float32))
    assert ulp.max() <= 8
    # one row past exp's range, a masked row, a NaN row: the shifted path, as numpy would compute it
    x[3, :4] = 200.0
    x[4, 10:] = -np.inf
    x[5, 7] = np.nan
    y = softmax_along(x, -1)
    np.testing.assert_allclose(y[np.r_[:5, 6:512]], _softmax64(x)[np.r_[:5, 6:512]], rtol=2e-6, atol=1e-30)
    assert np.isnan(y[5]).all() and (y[4, 10:] == 0).all() and np.isclose(y[3, :4], 0.25).all()
    for axis in (0, 1):  # a non-last axis takes the general path
        np.testing.assert_allclose(softmax_along(x[6:, :], axis), np.moveaxis(_softmax64(np.moveaxis(
            x[6:, :], axis, -1)), -1, axis), rtol=2e-6, atol=1e-30)


def test_softmax_of_masked_scores_skips_the_shift_and_keeps_masked_entries_at_zero(monkeypatch) -> None:
    """-inf entries (a causal mask) have exp exactly 0, so they do not force the shifted path; finite but
    very low entries (-90, whose exp would be subnormal) still do, as does a row with every entry masked."""
    from onnxtrain.engine.kernels import normalization as nz

    rng = np.random.default_rng(1)
    x = (rng.standard_normal((8, 64, 64)) * 3).astype(np.float32)
    masked = np.triu(np.ones((64, 64), bool), 1)
    x[:, masked] = -np.inf
    assert nz.exp_is_safe(x, 64)
    shifted, original = [], nz._exp_shifted
    monkeypatch.setattr(nz, "_exp_shifted", lambda *a, **k: shifted.append(1) or original(*a, **k))
    y = nz.softmax_along(x, -1)
    assert not shifted
    assert (y[:, masked] == 0).all()
    ulp = np.abs(y - _softmax64(x)) / np.spacing(_softmax64(x).astype(np.float32))
    assert ulp[:, ~masked].max() <= 8
    low = x.copy()
    low[2, 5, 0] = -90.0
    assert not nz.exp_is_safe(low, 64)
    all_masked = x.copy()
    all_masked[0, 0, :] = -np.inf
    with np.errstate(invalid="ignore"):
        assert np.isnan(nz.softmax_along(all_masked, -1)[0, 0]).all()



@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_layer_norm_statistics_are_of_the_stash_type_and_match_onnxruntime(dtype) -> None:
    """Mean and InvStdDev come out in stash_type (float32 by default) whatever the input's type, as the spec
    and onnxruntime have them (a float64 input is still normalized in float64)."""
    ort = pytest.importorskip("onnxruntime")
    x = (_rng.standard_normal((7, 45, 24)) * 3 + 1).astype(dtype)
    scale, bias = _rng.standard_normal(24).astype(dtype), _rng.standard_normal(24).astype(dtype)
    model = _model("LayerNormalization", [x, scale, bias], 17, ["y0", "mean", "inv"], axis=-1)
    for o in model.graph.output[1:]:
        o.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    feeds = _feeds([x, scale, bias])
    ours = compile_model(model).run(feeds)
    assert ours[0].dtype == dtype and ours[1].dtype == ours[2].dtype == np.float32
    if dtype != np.float16:  # onnxruntime's CPU LayerNormalization takes float and double
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        for a, b in zip(ours, sess.run(None, feeds)):
            assert a.dtype == b.dtype
            tol = 1e-12 if a.dtype == np.float64 else 1e-5
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
@pytest.mark.parametrize("opset", [11, 13])
def test_softmax_family_refuses_a_scalar_input_as_onnxruntime(op: str, opset: int) -> None:
    ort = pytest.importorskip("onnxruntime")
    x = np.array(1.5, np.float32)
    model = _model(op, [x], opset)
    with pytest.raises(Exception, match="rank must be >= 1"):
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match=f"{op}.*rank >= 1"):
        compile_model(model).run(_feeds([x]))


def test_layer_normalization_over_no_element_is_refused_naming_the_axis_as_onnxruntime() -> None:
    ort = pytest.importorskip("onnxruntime")
    x, scale = np.zeros((2, 0), np.float32), np.ones(0, np.float32)
    model = _model("LayerNormalization", [x, scale], 18, axis=-1)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="must be at least 1"):
        sess.run(None, _feeds([x, scale]))
    with pytest.raises(Exception, match=r"normalizes X.shape\[1:\] = \(0,\), of no element"):
        _ours("LayerNormalization", [x, scale], 18, axis=-1)
    empty_batch = [np.zeros((0, 3), np.float32), np.ones(3, np.float32)]
    (y,), (want,) = _run_both("LayerNormalization", empty_batch, 18)
    assert y.shape == want.shape == (0, 3)


@pytest.mark.parametrize("rows", [8, 64, 512])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bias_gradient_sum_by_rows(rows: int, dtype) -> None:
    """A sum over the leading axis (a bias's gradient): BLAS's product with ones from BLAS_SUM_MIN values,
    numpy's own sum below (np.sum's bits, without its wrapper); both as accurate as float64 allows."""
    from onnxtrain.engine.kernels import reduce

    for width in (640, 10):
        x = np.random.default_rng(rows).standard_normal((rows, width)).astype(dtype)
        for keep in (0, 1):
            (y,) = _ours("ReduceSum", [x, np.array([0], np.int64)], 18, keepdims=keep)
            exact = x.astype(np.float64).sum(axis=0, keepdims=bool(keep))
            assert y.dtype == dtype and y.shape == exact.shape
            np.testing.assert_allclose(y, exact, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5)
            if x.size >= reduce.BLAS_SUM_MIN:
                assert np.array_equal(y.reshape(-1), np.ones(rows, dtype) @ x)
            else:
                assert np.array_equal(y, np.sum(x, axis=0, keepdims=bool(keep)))


@pytest.mark.parametrize("shape", [(2, 16), (64, 10), (64, 512), (256, 512), (1, 1), (3, 1)])
@pytest.mark.parametrize("axis", [0, -2])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bias_gradient_fast_path_matches_the_general_path(shape, axis, keepdims, dtype) -> None:
    """ReduceSum over axis 0 of a 2-D float array with an int64 axes input (a bias's gradient) takes the fast
    path, with the bits of the general path (the axes attribute of opset 11) and float64's values; NaN, ±inf
    and -0.0 included."""
    from onnxtrain.engine.kernels import reduce

    x = (np.random.default_rng(sum(shape)).standard_normal(shape) * 1e3).astype(dtype)
    if x.size > 4:
        x.reshape(-1)[:4] = [np.nan, np.inf, -0.0, -np.inf]
    axes = np.array([axis], np.int64)
    assert reduce._bias_sum(x, axes, keepdims) is not None
    (fast,) = _ours("ReduceSum", [x, axes], 13, keepdims=keepdims)
    (general,) = _ours("ReduceSum", [x], 11, axes=[axis], keepdims=keepdims)
    assert fast.dtype == general.dtype == dtype and fast.shape == general.shape
    assert fast.tobytes() == general.tobytes()
    finite = np.isfinite(x).all(axis=0)
    exact = x.astype(np.float64).sum(axis=0, keepdims=bool(keepdims))
    np.testing.assert_allclose(fast.reshape(-1)[finite], exact.reshape(-1)[finite],
                               rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-2)


@pytest.mark.parametrize("x, axes", [
    (np.ones((4, 3), np.float32)[:, ::2], [0]),  # not contiguous
    (np.ones((4, 3), np.int64), [0]),  # integers
    (np.ones((4, 3, 2), np.float32), [0]),  # rank 3
    (np.ones((4, 3), np.float32), [1]),  # another axis
    (np.ones((4, 3), np.float32), [0, 1]),  # two axes
    (np.ones((0, 3), np.float32), [0]),  # empty
    (np.ones((4, 3), np.float16), [0]),  # half
])
def test_bias_gradient_fast_path_leaves_other_sums_to_the_general_path(x, axes) -> None:
    from onnxtrain.engine.kernels import reduce

    a = np.array(axes, np.int64)
    assert reduce._bias_sum(x, a, 0) is None
    (y,) = _ours("ReduceSum", [x, a], 13, keepdims=0)
    np.testing.assert_array_equal(y, x.astype(np.float64).sum(axis=tuple(axes)).astype(x.dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(64, 10), (3, 1), (5, 129), (2, 1000)])
def test_row_sums_are_einsums_bits(dtype, shape) -> None:
    """row_sum and row_dot call einsum's C function directly: np.einsum's bits (its own summation order, not
    numpy's pairwise one), checked against float64 sums."""
    from onnxtrain.engine.kernels.normalization import row_dot, row_sum

    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    a.reshape(-1)[:1] = -0.0
    got = row_sum(a)
    assert got.shape == (shape[0], 1) and got.tobytes() == np.einsum("ij->i", a)[:, None].tobytes()
    assert row_dot(a, b).tobytes() == np.einsum("ij,ij->i", a, b).tobytes()
    np.testing.assert_allclose(got[:, 0], a.astype(np.float64).sum(1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(64,), (3, 5), (2, 3, 4), (), (1,), (300, 70)])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sum_over_every_axis_without_axes_input(shape, keepdims: int, dtype) -> None:
    """ReduceSum with no axes input (an ignore mask's count) takes the whole-sum route: the general path's
    bits (the opset-11 form with every axis listed; a scalar's own value), float64's values, NaN, ±inf and
    -0.0 among them; an empty input, half precision and noop_with_empty_axes go the general way."""
    from onnxtrain.engine.kernels import reduce

    x = np.asarray(np.random.default_rng(len(shape)).standard_normal(shape) * 1e3, dtype)
    if x.size > 4:
        x.reshape(-1)[:4] = [np.nan, -0.0, 1e30, -1e30]
    attrs = {"keepdims": keepdims, "noop_with_empty_axes": 0}
    assert reduce._whole_sum(x, attrs) is not None
    (got,) = _ours("ReduceSum", [x], 13, keepdims=keepdims)
    (general,) = _ours("ReduceSum", [x], 11, keepdims=keepdims,
                       **({"axes": list(range(x.ndim))} if x.ndim else {}))
    assert got.dtype == general.dtype == dtype and got.shape == general.shape
    assert got.tobytes() == general.tobytes()
    if x.size <= 4:
        np.testing.assert_allclose(got.reshape(-1), x.astype(np.float64).sum(), rtol=1e-6)
    for other, a in ((np.ones((0, 3), dtype), attrs), (np.ones(4, np.float16), attrs),
                     (x, {"keepdims": keepdims, "noop_with_empty_axes": 1})):
        assert reduce._whole_sum(other, a) is None
    (noop,) = _ours("ReduceSum", [x], 13, keepdims=keepdims, noop_with_empty_axes=1)
    assert noop.tobytes() == x.tobytes()
