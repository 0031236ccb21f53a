"""Op table rows for the quantization kernels (onnxtrain/engine/kernels/quantize.py).

Every input is integer or float32 whatever dtype the table asks for (the schemas allow no float64 x or
scale), and no row has a gradient: the ops are marked no_gradient.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx import TensorProto, helper

from tests.op_cases import OpCase

Make = Any
F32 = np.float32


def _np(elem: int) -> np.dtype:
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem))


def _codes(rng: np.random.Generator, shape: tuple[int, ...], dt: Any, lo: int | None = None,
           hi: int | None = None) -> np.ndarray:
    """Random integers spanning an integer dtype's range (or [lo, hi]), as that dtype."""
    dt = np.dtype(dt)
    if lo is None:
        info = np.iinfo(dt) if dt.kind in "iu" else None
        lo, hi = (int(info.min), int(info.max)) if info else (-8, 7)
    return rng.integers(lo, hi + 1, shape).astype(dt)


def _quantize(shape: tuple[int, ...], scale_shape: tuple[int, ...], zp: Any | None, zp_range=(0, 10),
              x_range: float = 300.0, x_dt: Any = F32, scale_dt: Any = F32) -> Make:
    """x spanning past the target's range (saturation); a scalar scale is a power of two and a third of x
    lies on exact ties x / scale = k + 1/2 (rounded half to even)."""

    def make(rng: np.random.Generator, dt: Any) -> list[Any]:
        x = rng.uniform(-x_range, x_range, shape)
        if scale_shape == ():
            scale = np.asarray(rng.choice([0.5, 1.0, 2.0]))
            x = np.where(rng.random(shape) < 0.3, (rng.integers(-40, 40, shape) + 0.5) * scale, x)
        else:
            scale = rng.uniform(0.5, 3.0, scale_shape)
        ins = [x.astype(x_dt), scale.astype(scale_dt)]
        if zp is not None:
            ins.append(_codes(rng, scale_shape, zp, *zp_range))
        return ins

    return make


def _quantize_f8(elem: int) -> Make:
    def make(rng: np.random.Generator, dt: Any) -> list[Any]:
        x = rng.uniform(-400.0, 400.0, (3, 5)).astype(F32)
        x[0, :3] = [1e6, -1e6, np.inf]  # past the largest finite value: saturated or not
        x[1, :2] = [0.0, -0.0]
        return [x, np.asarray(0.75, F32), np.zeros((), _np(elem))]

    return make


def _quantize_4bit(elem: int, x_range: float = 40.0) -> Make:
    def make(rng: np.random.Generator, dt: Any) -> list[Any]:
        x = rng.uniform(-x_range, x_range, (3, 4)).astype(F32)
        scale = rng.uniform(1.0, 4.0, (3,)).astype(F32)
        return [x, scale, np.asarray([1, 0, 2]).astype(_np(elem))]

    return make


def _dequantize(shape: tuple[int, ...], scale_shape: tuple[int, ...], x_dt: Any, zp: bool = True,
                scale_dt: Any = F32, lo: int | None = None, hi: int | None = None) -> Make:
    def make(rng: np.random.Generator, dt: Any) -> list[Any]:
        ins = [_codes(rng, shape, x_dt, lo, hi), rng.uniform(0.01, 2.0, scale_shape).astype(scale_dt)]
        if zp:
            ins.append(_codes(rng, scale_shape, x_dt, lo, hi))
        return ins

    return make


def _dequantize_float(elem: int) -> Make:
    def make(rng: np.random.Generator, dt: Any) -> list[Any]:
        x = rng.uniform(-6.0, 6.0, (2, 5)).astype(F32).astype(_np(elem))
        return [x, rng.uniform(0.5, 2.0, (5,)).astype(F32), np.zeros((5,), _np(elem))]

    return make


def _dynamic(low: float, high: float, shape: tuple[int, ...] = (3, 5)) -> Make:
    return lambda rng, dt: [rng.uniform(low, high, shape).astype(F32)]


def _matmul_integer(a_shape: tuple[int, ...], b_shape: tuple[int, ...], a_dt: Any, b_dt: Any,
                    a_zp: tuple[int, ...] | None, b_zp: tuple[int, ...] | None) -> Make:
    def make(rng: np.random.Generator, dt: Any) -> list[Any]:
        ins: list[Any] = [_codes(rng, a_shape, a_dt), _codes(rng, b_shape, b_dt)]
        ins.append(None if a_zp is None else _codes(rng, a_zp, a_dt))
        ins.append(None if b_zp is None else _codes(rng, b_zp, b_dt))
        while ins and ins[-1] is None:
            ins.pop()
        return ins

    return make


def _qlinear_matmul(a_shape: tuple[int, ...], b_shape: tuple[int, ...], qdt: Any,
                    b_cols: int | None = None) -> Make:
    def make(rng: np.random.Generator, dt: Any) -> list[Any]:
        per_col = (b_cols,) if b_cols else ()
        return [_codes(rng, a_shape, qdt), np.asarray(rng.uniform(0.005, 0.02), F32), _codes(rng, (), qdt),
                _codes(rng, b_shape, qdt), rng.uniform(0.005, 0.02, per_col).astype(F32),
                _codes(rng, per_col, qdt), np.asarray(rng.uniform(0.02, 0.1), F32), _codes(rng, (), qdt)]

    return make


def _conv_integer(x_shape: tuple[int, ...], w_shape: tuple[int, ...], x_dt: Any, w_dt: Any,
                  per_channel: bool) -> Make:
    def make(rng: np.random.Generator, dt: Any) -> list[Any]:
        wzp = (w_shape[0],) if per_channel else ()
        return [_codes(rng, x_shape, x_dt), _codes(rng, w_shape, w_dt), _codes(rng, (), x_dt),
                _codes(rng, wzp, w_dt)]

    return make


def _qlinear_conv(x_shape: tuple[int, ...], w_shape: tuple[int, ...], qdt: Any, per_channel: bool,
                  bias: bool) -> Make:
    def make(rng: np.random.Generator, dt: Any) -> list[Any]:
        m = (w_shape[0],) if per_channel else ()
        ins = [_codes(rng, x_shape, qdt), np.asarray(rng.uniform(0.005, 0.02), F32), _codes(rng, (), qdt),
               _codes(rng, w_shape, qdt), rng.uniform(0.005, 0.02, m).astype(F32), _codes(rng, m, qdt, -3, 3)
               if np.dtype(qdt).kind == "i" else _codes(rng, m, qdt, 120, 135),
               np.asarray(rng.uniform(0.05, 0.2), F32), _codes(rng, (), qdt)]
        if bias:
            ins.append(rng.integers(-2000, 2000, (w_shape[0],)).astype(np.int32))
        return ins

    return make


U8, I8 = np.uint8, np.int8
_NG = {"grad": False}

CASES = [
    # ---- QuantizeLinear
    OpCase("QuantizeLinear", make_inputs=_quantize((3, 4), (), U8, (100, 150)), opset=10, **_NG,
           variant="v10"),
    OpCase("QuantizeLinear", make_inputs=_quantize((2, 3, 4), (3,), I8, (-5, 5)), **_NG, variant="axis1"),
    OpCase("QuantizeLinear", make_inputs=_quantize((2, 3, 4), (4,), I8, (-5, 5)), attrs={"axis": -1},
           **_NG, variant="axis_neg"),
    OpCase("QuantizeLinear", make_inputs=_quantize((3, 4), (), None), opset=13, **_NG, variant="no_zp"),
    OpCase("QuantizeLinear", make_inputs=_quantize((3, 7), (3, 3), U8, (0, 20)),
           attrs={"axis": 1, "block_size": 3}, opset=21, **_NG, variant="blocked_ragged"),
    OpCase("QuantizeLinear", make_inputs=_quantize((4, 3), (2, 3), None),
           attrs={"axis": 0, "block_size": 2, "output_dtype": TensorProto.INT8}, opset=21, **_NG,
           variant="blocked_output_dtype"),
    OpCase("QuantizeLinear", make_inputs=_quantize((3, 4), (), np.uint16, (30000, 33000), x_range=1e5),
           opset=21, **_NG, variant="uint16"),
    OpCase("QuantizeLinear", make_inputs=_quantize((3, 4), (), np.int16, (-100, 100), x_range=1e5),
           opset=21, **_NG, variant="int16"),
    OpCase("QuantizeLinear", make_inputs=_quantize((3, 4), (), U8, (100, 150), x_dt=np.float16,
                                                   scale_dt=np.float16),
           opset=19, **_NG, variant="float16"),
    # an int32 x with a float scale: opset 23 (before it, the scale is of x's type)
    OpCase("QuantizeLinear", make_inputs=_quantize((3, 4), (), I8, (-5, 5), x_dt=np.int32), opset=23, **_NG,
           variant="int32_x"),
    OpCase("QuantizeLinear", make_inputs=_quantize_f8(TensorProto.FLOAT8E4M3FN), opset=19, **_NG,
           variant="e4m3fn"),
    OpCase("QuantizeLinear", make_inputs=_quantize_f8(TensorProto.FLOAT8E4M3FN), attrs={"saturate": 0},
           opset=19, **_NG, variant="e4m3fn_nosat"),
    OpCase("QuantizeLinear", make_inputs=_quantize_f8(TensorProto.FLOAT8E5M2), attrs={"saturate": 0},
           opset=19, **_NG, variant="e5m2_nosat"),
    OpCase("QuantizeLinear", make_inputs=_quantize_f8(TensorProto.FLOAT8E4M3FNUZ), opset=19, **_NG,
           variant="e4m3fnuz"),
    OpCase("QuantizeLinear", make_inputs=_quantize_4bit(TensorProto.INT4), attrs={"axis": 0}, opset=21,
           **_NG, variant="int4"),
    OpCase("QuantizeLinear", make_inputs=_quantize_4bit(TensorProto.UINT4), attrs={"axis": 0}, opset=21,
           **_NG, variant="uint4"),
    OpCase("QuantizeLinear", make_inputs=_quantize_4bit(TensorProto.FLOAT4E2M1, 20.0), attrs={"axis": 0},
           opset=23, **_NG, variant="float4e2m1"),
    # ---- DequantizeLinear
    # (onnx.reference implements DequantizeLinear from opset 19 on)
    OpCase("DequantizeLinear", make_inputs=_dequantize((3, 4), (), U8), opset=19, **_NG),
    OpCase("DequantizeLinear", make_inputs=_dequantize((2, 3, 4), (3,), I8), opset=19, **_NG,
           variant="axis1"),
    OpCase("DequantizeLinear", make_inputs=_dequantize((2, 3, 4), (4,), I8), attrs={"axis": -1}, opset=19,
           **_NG, variant="axis_neg"),
    OpCase("DequantizeLinear", make_inputs=_dequantize((3, 4), (), np.int32, zp=False, lo=-10**6, hi=10**6),
           opset=19, **_NG, variant="int32"),
    OpCase("DequantizeLinear", make_inputs=_dequantize((5, 4), (2, 4), U8),
           attrs={"axis": 0, "block_size": 3}, opset=21, **_NG, variant="blocked_ragged"),
    OpCase("DequantizeLinear",
           make_inputs=_dequantize((3, 4), (), np.int16, scale_dt=np.float16, lo=-9000, hi=9000), opset=21,
           **_NG, variant="int16_float16"),
    OpCase("DequantizeLinear", make_inputs=_dequantize((3, 4), (), np.uint16, lo=0, hi=20000), opset=23,
           attrs={"output_dtype": TensorProto.FLOAT16}, **_NG, variant="output_dtype"),
    OpCase("DequantizeLinear", make_inputs=_dequantize((3, 4), (4,), _np(TensorProto.INT4), lo=-8, hi=7),
           attrs={"axis": 1}, opset=21, **_NG, variant="int4"),
    OpCase("DequantizeLinear", make_inputs=_dequantize((3, 4), (), _np(TensorProto.UINT4), lo=0, hi=15),
           opset=21, **_NG, variant="uint4"),
    OpCase("DequantizeLinear", make_inputs=_dequantize_float(TensorProto.FLOAT8E5M2), opset=19, **_NG,
           variant="e5m2", attrs={"axis": 1}),
    OpCase("DequantizeLinear", make_inputs=_dequantize_float(TensorProto.FLOAT4E2M1), opset=23, **_NG,
           variant="float4e2m1", attrs={"axis": 1}),
    # ---- DynamicQuantizeLinear
    OpCase("DynamicQuantizeLinear", make_inputs=_dynamic(-3.0, 5.0), n_outputs=3, opset=11, **_NG),
    OpCase("DynamicQuantizeLinear", make_inputs=_dynamic(-4.0, -1.0), n_outputs=3, opset=11, **_NG,
           variant="negative"),
    OpCase("DynamicQuantizeLinear", make_inputs=_dynamic(0.5, 9.0, (2, 3, 4)), n_outputs=3, opset=11, **_NG,
           variant="positive"),
    OpCase("DynamicQuantizeLinear", make_inputs=_dynamic(0.0, 0.0), n_outputs=3, opset=11, **_NG,
           variant="zeros"),
    # ---- MatMulInteger
    OpCase("MatMulInteger", make_inputs=_matmul_integer((4, 5), (5, 3), U8, U8, (), ()), opset=10, **_NG),
    OpCase("MatMulInteger", make_inputs=_matmul_integer((4, 5), (5, 3), I8, U8, (4, 1), (3,)), opset=10,
           **_NG, variant="per_row_col"),
    OpCase("MatMulInteger", make_inputs=_matmul_integer((2, 4, 5), (5, 3), U8, I8, None, None), opset=10,
           **_NG, variant="batched_no_zp"),
    OpCase("MatMulInteger", make_inputs=_matmul_integer((2, 3, 4, 6), (2, 1, 6, 2), I8, I8, (2, 3, 4, 1),
                                                       (2, 1, 1, 2)),
           opset=10, **_NG, variant="nd_zp"),
    # ---- QLinearMatMul
    OpCase("QLinearMatMul", make_inputs=_qlinear_matmul((3, 6), (6, 4), U8), opset=10, **_NG),
    OpCase("QLinearMatMul", make_inputs=_qlinear_matmul((2, 3, 6), (6, 4), I8, b_cols=4), opset=21, **_NG,
           variant="int8_per_col"),
    # ---- ConvInteger
    OpCase("ConvInteger", make_inputs=_conv_integer((1, 2, 5, 5), (3, 2, 3, 3), U8, U8, False),
           attrs={"pads": [1, 1, 1, 1]}, opset=10, **_NG),
    OpCase("ConvInteger", make_inputs=_conv_integer((2, 4, 6, 5), (4, 2, 2, 3), I8, U8, True),
           attrs={"group": 2, "strides": [2, 1], "dilations": [1, 2]}, opset=10, **_NG,
           variant="group_per_channel"),
    # ---- QLinearConv
    OpCase("QLinearConv", make_inputs=_qlinear_conv((1, 2, 5, 5), (3, 2, 3, 3), U8, False, False),
           attrs={"pads": [1, 1, 1, 1]}, opset=10, **_NG),
    OpCase("QLinearConv", make_inputs=_qlinear_conv((2, 4, 6, 6), (4, 2, 3, 3), I8, True, True),
           attrs={"group": 2, "strides": [2, 2], "auto_pad": "SAME_UPPER"}, opset=10, **_NG,
           variant="int8_per_channel_bias"),
]
