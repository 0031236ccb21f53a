"""Quantization kernels on what the op table cannot check against onnx.reference: per-row vectors the
reference does not broadcast, long exact integer sums, torch's and onnxruntime's quantizers as second
oracles, and error messages."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxtrain.engine import compile_model
from onnxtrain.engine.plan import EngineError


def _model(op: str, inputs: list[Any], opset: int, n_outputs: int = 1, **attrs: Any) -> onnx.ModelProto:
    names = [f"x{i}" if v is not None else "" for i, v in enumerate(inputs)]
    outs = [f"y{i}" for i in range(n_outputs)]
    g_in = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for n, v in zip(names, inputs, strict=True) if n]
    g_out = [helper.make_empty_tensor_value_info(n) for n in outs]
    graph = helper.make_graph([helper.make_node(op, names, outs, name=f"{op}_0", **attrs)], op, g_in, g_out)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _feeds(inputs: list[Any]) -> dict[str, Any]:
    return {f"x{i}": v for i, v in enumerate(inputs) if v is not None}


def _ours(op: str, inputs: list[Any], opset: int, n_outputs: int = 1, **attrs: Any) -> list[np.ndarray]:
    return compile_model(_model(op, inputs, opset, n_outputs, **attrs)).run(_feeds(inputs))


def _reference(op: str, inputs: list[Any], opset: int, **attrs: Any) -> list[np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(_model(op, inputs, opset, **attrs)).run(None, _feeds(inputs))


def _onnxruntime(op: str, inputs: list[Any], opset: int, n_outputs: int = 1, **attrs: Any) -> list[Any]:
    ort = pytest.importorskip("onnxruntime")
    model = _model(op, inputs, opset, n_outputs, **attrs)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, _feeds(inputs))


RNG = np.random.default_rng(7)


def _u8(*shape: int) -> np.ndarray:
    return RNG.integers(0, 256, shape).astype(np.uint8)


def _i8(*shape: int) -> np.ndarray:
    return RNG.integers(-128, 128, shape).astype(np.int8)


# ---- per-row vectors: the spec's (M,) form equals the (M, 1) form onnx.reference broadcasts -------------

def test_matmul_integer_per_row_zero_point_vector() -> None:
    a, b, a_zp, b_zp = _i8(5, 7), _u8(7, 3), _i8(5), _u8(3)
    ours = _ours("MatMulInteger", [a, b, a_zp, b_zp], 10)[0]
    ref = _reference("MatMulInteger", [a, b, a_zp.reshape(5, 1), b_zp], 10)[0]
    assert ours.dtype == np.int32
    np.testing.assert_array_equal(ours, ref)


def test_qlinear_matmul_per_row_scale_vector() -> None:
    a, b = _u8(4, 6), _u8(6, 3)
    a_scale = RNG.uniform(0.005, 0.02, 4).astype(np.float32)
    b_scale = RNG.uniform(0.005, 0.02, 3).astype(np.float32)
    a_zp, b_zp = _u8(4), _u8(3)
    y_scale, y_zp = np.asarray(0.05, np.float32), np.asarray(120, np.uint8)
    ours = _ours("QLinearMatMul", [a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp], 21)[0]
    ref = _reference("QLinearMatMul", [a, a_scale.reshape(4, 1), a_zp.reshape(4, 1), b, b_scale, b_zp,
                                       y_scale, y_zp], 21)[0]
    np.testing.assert_array_equal(ours, ref)
    assert np.count_nonzero((ours != 0) & (ours != 255)) > 0  # not all saturated


# ---- exactness of long integer sums (float64 accumulation) against numpy's int64 matmul ----------------

def test_matmul_integer_long_sums_are_exact() -> None:
    k = 4096
    a = np.full((3, k), 255, np.uint8)
    a[1] = _u8(k)
    b = np.full((k, 2), 255, np.uint8)
    b[:, 1] = _u8(k)
    b_zp = np.asarray(1, np.uint8)
    want = a.astype(np.int64) @ (b.astype(np.int64) - 1)
    np.testing.assert_array_equal(_ours("MatMulInteger", [a, b, None, b_zp], 10)[0], want)


def test_conv_integer_many_channels_matches_reference() -> None:
    x, w = _u8(1, 64, 6, 6), _i8(8, 64, 3, 3)
    x_zp, w_zp = np.asarray(3, np.uint8), _i8(8)
    ours = _ours("ConvInteger", [x, w, x_zp, w_zp], 10, pads=[1, 1, 1, 1])[0]
    ref = _reference("ConvInteger", [x, w, x_zp, w_zp], 10, pads=[1, 1, 1, 1])[0]
    np.testing.assert_array_equal(ours, ref)


# ---- onnxruntime as a second oracle ----------------------------------------------------------------

def test_dynamic_quantize_linear_matches_onnxruntime() -> None:
    x = RNG.normal(0.3, 2.0, (4, 33)).astype(np.float32)
    ours = _ours("DynamicQuantizeLinear", [x], 11, n_outputs=3)
    theirs = _onnxruntime("DynamicQuantizeLinear", [x], 11, n_outputs=3)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("zp", [np.uint8(128), np.int8(0), np.int8(5), np.uint16(3), np.int16(-7)])
def test_quantize_linear_non_finite_matches_onnxruntime(zp) -> None:
    # NaN goes to the type's lowest value and the infinities saturate, as onnxruntime's quantizer gives
    x = np.array([np.nan, np.inf, -np.inf, 1e30, -2.5, 3.75, -np.nan], np.float32)
    args = [x, np.asarray(0.5, np.float32), np.asarray(zp)]
    ours = _ours("QuantizeLinear", args, 21)[0]
    theirs = _onnxruntime("QuantizeLinear", args, 21)[0]
    assert ours.dtype == theirs.dtype
    np.testing.assert_array_equal(ours, theirs)


def test_qlinear_conv_per_channel_matches_onnxruntime() -> None:
    # weights within [-64, 63]: on x86 without VNNI onnxruntime's u8 x s8 kernel adds products in pairs into
    # saturating 16-bit lanes (255 * 127 * 2 overflows them), so full-range weights test its saturation
    x, w = _u8(2, 4, 7, 7), RNG.integers(-64, 64, (6, 4, 3, 3)).astype(np.int8)
    x_scale, w_scale = np.asarray(0.02, np.float32), RNG.uniform(0.002, 0.01, 6).astype(np.float32)
    x_zp, w_zp = np.asarray(128, np.uint8), np.zeros(6, np.int8)
    y_scale, y_zp = np.asarray(0.15, np.float32), np.asarray(100, np.uint8)
    bias = RNG.integers(-3000, 3000, 6).astype(np.int32)
    ins = [x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp, bias]
    attrs = {"pads": [1, 0, 1, 0], "strides": [2, 1]}
    ours = _ours("QLinearConv", ins, 10, **attrs)[0]
    theirs = _onnxruntime("QLinearConv", ins, 10, **attrs)[0]
    assert ours.dtype == theirs.dtype == np.uint8
    np.testing.assert_array_equal(ours, theirs)


# ---- torch's fake quantizer: QuantizeLinear then DequantizeLinear ---------------------------------------

@pytest.mark.parametrize("qdt,zp", [(np.uint8, 128), (np.int8, -3)])
def test_quantize_dequantize_matches_torch_fake_quantize(qdt, zp) -> None:
    torch = pytest.importorskip("torch")
    scale = 0.5  # a power of two: torch multiplies by 1/scale, which is then exact
    x = np.concatenate([RNG.uniform(-200, 200, 200), np.arange(-20, 20) + 0.5]).astype(np.float32)
    zp_arr = np.asarray(zp, qdt)
    q = _ours("QuantizeLinear", [x, np.asarray(scale, np.float32), zp_arr], 13)[0]
    y = _ours("DequantizeLinear", [q, np.asarray(scale, np.float32), zp_arr], 13)[0]
    info = np.iinfo(qdt)
    want = torch.fake_quantize_per_tensor_affine(torch.from_numpy(x), scale, zp, int(info.min), int(info.max))
    assert q.dtype == qdt
    np.testing.assert_array_equal(y, want.numpy())


def test_per_axis_quantize_dequantize_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    x = RNG.uniform(-300, 300, (2, 3, 5)).astype(np.float32)
    scale = np.asarray([0.5, 1.0, 2.0], np.float32)
    zp = np.asarray([-4, 0, 9], np.int8)
    q = _ours("QuantizeLinear", [x, scale, zp], 13, axis=1)[0]
    y = _ours("DequantizeLinear", [q, scale, zp], 13, axis=1)[0]
    want = torch.fake_quantize_per_channel_affine(torch.from_numpy(x), torch.from_numpy(scale),
                                                  torch.from_numpy(zp.astype(np.int32)), 1, -128, 127)
    np.testing.assert_array_equal(y, want.numpy())


# ---- errors name the op and the bad input ------------------------------------------------------------

def test_bad_block_shape_is_named() -> None:
    x, s = np.ones((3, 4), np.float32), np.ones((3, 3), np.float32)
    with pytest.raises(EngineError, match=r"QuantizeLinear: y_scale shape \(3, 3\).*expected \(3, 2\)"):
        _ours("QuantizeLinear", [x, s], 21, axis=1, block_size=2)


def test_per_axis_length_mismatch_is_named() -> None:
    x, s, zp = np.ones((4, 3), np.uint8), np.ones(4, np.float32), np.zeros(4, np.uint8)
    with pytest.raises(EngineError, match="DequantizeLinear: per-axis x_scale has 4 values"):
        _ours("DequantizeLinear", [x, s, zp], 21, axis=1)


# ---- a 1-D b: the per-row scales of a meet the result's rows (the column axis is dropped) --------------

def test_qlinear_matmul_vector_b_with_per_row_scale() -> None:
    a, b = _u8(4, 6), _u8(6)
    a_scale = RNG.uniform(0.005, 0.02, 4).astype(np.float32)
    a_zp = _u8(4)
    rest = [np.asarray(0.01, np.float32), np.asarray(7, np.uint8), np.asarray(0.05, np.float32),
            np.asarray(120, np.uint8)]
    ours = _ours("QLinearMatMul", [a, a_scale, a_zp, b, *rest], 21)[0]
    # the same product with b as a (6, 1) matrix and the row vectors as (4, 1) columns
    ref = _reference("QLinearMatMul", [a, a_scale.reshape(4, 1), a_zp.reshape(4, 1), b.reshape(6, 1), *rest],
                     21)[0]
    assert ours.shape == (4,)
    np.testing.assert_array_equal(ours, ref[:, 0])


@pytest.mark.parametrize("out", [onnx.TensorProto.FLOAT8E4M3FN, onnx.TensorProto.FLOAT8E5M2])
def test_bfloat16_quantized_to_float8_saturates_as_onnx_reference(out: int) -> None:
    """QuantizeLinear of bfloat16 values and scale to a float8 type (saturate=1, no zero point): values past
    the range go to the largest finite one (they were NaN or ±inf: the bfloat16 source skipped the clamp)."""
    import ml_dtypes

    x = np.array([100, 1000, -1000, 1e5, -np.inf, 0.3], ml_dtypes.bfloat16)
    scale = np.array(0.5, ml_dtypes.bfloat16)
    got = _ours("QuantizeLinear", [x, scale], 21, output_dtype=out)[0]
    want = _reference("QuantizeLinear", [x, scale], 21, output_dtype=out)[0]
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
    assert np.isfinite(got.astype(np.float32)).all()
