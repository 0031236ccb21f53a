"""Kernel arguments an outside review of the engine found mishandled, against onnxruntime, onnx.reference and
ONNX's own test data: reduction axes out of range or repeated (wrapped onto another axis, silently, on the
BLAS and empty-input paths), Split sizes, Tile repeats, Reshape dims below -1 and softmax axes out of range
(accepted or wrapped), integer Gemm with float alpha/beta (a numpy casting error), Resize-10's nearest
rounding when downsampling (down, where onnxruntime and ONNX's test data round up) and half_pixel_symmetric
positions that onnxruntime rounds to float32."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxtrain import InferenceSession
from onnxtrain.errors import Fail

ort = pytest.importorskip("onnxruntime")


def _model(op: str, feeds: dict[str, np.ndarray], opset: int, consts: dict[str, np.ndarray] | None = None,
           n_out: int = 1, **attrs: Any) -> bytes:
    consts = consts or {}
    node = helper.make_node(op, [*feeds, *consts], [f"y{i}" for i in range(n_out)], **attrs)
    g = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for k, v in feeds.items()],
        [helper.make_value_info(f"y{i}", onnx.TypeProto()) for i in range(n_out)],
        [numpy_helper.from_array(v, k) for k, v in consts.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)
    return m.SerializeToString()


def _ort(m: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 4
    return ort.InferenceSession(m, so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _both_refuse(m: bytes, feeds: dict[str, np.ndarray], match: str) -> None:
    with pytest.raises(Exception):  # noqa: B017 - onnxruntime's class differs by check
        _ort(m, feeds)
    with pytest.raises(Fail, match=match):
        InferenceSession(m).run(None, feeds)


SMALL = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
BIG = np.ones((64, 16, 32), np.float32)  # ≥ 16 K values: the BLAS sum paths
EMPTY = np.zeros((2, 0, 3), np.float32)  # the empty-set fill


@pytest.mark.parametrize("x, axes, why", [
    (SMALL, [-4], "axis -4 is out of range"),
    (BIG, [3], "axis 3 is out of range"),
    (BIG, [0, 5], "axis 5 is out of range"),
    (EMPTY, [7], "axis 7 is out of range"),
])
@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceLogSum"])
def test_reduction_axes_out_of_range_or_repeated_are_refused(x: np.ndarray, axes: list[int], why: str,
                                                            op: str) -> None:
    for opset, form in ((18, "input"), (13, "attribute")):
        if op == "ReduceSum" and opset == 13:
            opset = 11  # ReduceSum's axes became an input at 13
        if form == "input":
            m = _model(op, {"x": x}, opset, {"axes": np.array(axes, np.int64)})
        else:
            m = _model(op, {"x": x}, opset, axes=axes)
        _both_refuse(m, {"x": x}, why)


def test_reduction_axes_in_range_still_agree_with_onnxruntime() -> None:
    """In range, negative and (as onnxruntime takes them) repeated axes."""
    for x in (SMALL, BIG):
        for axes in ([-1], [0], [-3, 2], [1, 0], [2, -1], [0, 0, 1]):
            m = _model("ReduceSum", {"x": x}, 18, {"axes": np.array(axes, np.int64)})
            np.testing.assert_allclose(InferenceSession(m).run(None, {"x": x})[0], _ort(m, {"x": x})[0],
                                       rtol=1e-6)


@pytest.mark.parametrize("op, consts, attrs, n_out, why", [
    ("Split", {"s": np.array([1, -1, 3], np.int64)}, {}, 2, "one size per output"),
    ("Split", {"s": np.array([2, 1], np.int64)}, {}, 3, "one size per output"),
    ("Tile", {"r": np.array([1, 2], np.int64)}, {}, 1, "one per input dimension"),
    ("Reshape", {"s": np.array([-2, 12], np.int64)}, {}, 1, "below -1"),
    ("Softmax", {}, {"axis": 3}, 1, "axis 3 is out of range for an input of rank 3"),
    ("LogSoftmax", {}, {"axis": -4}, 1, "axis -4 is out of range"),
])
def test_invalid_shape_arguments_are_refused(op: str, consts: dict, attrs: dict, n_out: int,
                                             why: str) -> None:
    x = SMALL[:, :, :3]
    _both_refuse(_model(op, {"x": x}, 18, consts, n_out=n_out, **attrs), {"x": x}, why)


def test_an_opset_11_softmax_axis_out_of_range_is_refused() -> None:
    """Before opset 13 the axis was wrapped (axis 4 of a rank-3 input normalized over axis 1's rows)."""
    _both_refuse(_model("Softmax", {"x": SMALL}, 11, axis=4), {"x": SMALL}, "axis 4 is out of range")


@pytest.mark.parametrize("dt", [np.int32, np.int64, np.uint32, np.uint64])
@pytest.mark.parametrize("attrs", [{"alpha": 2.0}, {"beta": 3.0}, {"alpha": 0.5, "beta": -0.25},
                                   {"alpha": 1.0, "beta": 1.0}])
def test_integer_gemm_with_float_scales(dt: type, attrs: dict) -> None:
    """Gemm-13 allows integer types; alpha ≠ 1 or beta ∉ {0, 1} failed with a numpy casting error. The
    oracle is onnx.reference (onnxruntime has no integer Gemm kernel): scaled, then truncated to the type."""
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 5, (3, 4)).astype(dt), rng.integers(0, 5, (4, 2)).astype(dt)
    c = rng.integers(0, 5, (1, 2)).astype(dt)
    if "beta" in attrs and attrs["beta"] < 0 and np.dtype(dt).kind == "u":
        pytest.skip("a negative term of an unsigned type is undefined")
    m = _model("Gemm", {"a": a, "b": b, "c": c}, 13, **attrs)
    got = InferenceSession(m).run(None, {"a": a, "b": b, "c": c})[0]
    want = ReferenceEvaluator(onnx.load_from_string(m)).run(None, {"a": a, "b": b, "c": c})[0]
    assert got.dtype == want.dtype == dt
    np.testing.assert_array_equal(got, want)


def test_resize_10_nearest_rounds_up_when_downsampling() -> None:
    """ONNX's opset-10 test case test_resize_downsample_nearest: [[1, 2, 3, 4], [5, 6, 7, 8]] at scales
    (1, 1, 0.6, 0.6) gives [[1, 3]] (onnxtrain gave [[1, 2]]); upsampling still rounds down."""
    x = np.array([[[[1, 2, 3, 4], [5, 6, 7, 8]]]], np.float32)
    m = _model("Resize", {"x": x}, 10, {"sc": np.array([1, 1, 0.6, 0.6], np.float32)}, mode="nearest")
    got = InferenceSession(m).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, [[[[1, 3]]]])
    x = np.arange(60, dtype=np.float32).reshape(1, 3, 4, 5)
    for sc in ([1, 1, 0.5, 0.7], [1, 1, 1.5, 0.7], [1, 1, 0.75, 2.5], [1, 0.5, 1, 1]):
        m = _model("Resize", {"x": x}, 10, {"sc": np.array(sc, np.float32)}, mode="nearest")
        np.testing.assert_array_equal(InferenceSession(m).run(None, {"x": x})[0], _ort(m, {"x": x})[0])


@pytest.mark.parametrize("width, scale", [(5, 2.5), (7, 0.5), (5, 0.3)])
def test_half_pixel_symmetric_positions_as_onnxruntime_rounds_them(width: int, scale: float) -> None:
    """Output 3 of 5 pixels at scale 2.5 sits at exactly 1.0 (offset 0.1): float64 arithmetic put it two
    ulps above and a nearest "ceil" took pixel 2; onnxruntime and onnx.reference take pixel 1."""
    x = np.arange(4 * width, dtype=np.float32).reshape(1, 1, 4, width)
    m = _model("Resize", {"x": x}, 19, {"roi": np.zeros(0, np.float32),
                                        "sc": np.array([1, 1, 1, scale], np.float32)},
               mode="nearest", coordinate_transformation_mode="half_pixel_symmetric", nearest_mode="ceil")
    got = InferenceSession(m).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, _ort(m, {"x": x})[0])
    np.testing.assert_array_equal(got, ReferenceEvaluator(onnx.load_from_string(m)).run(None, {"x": x})[0])
