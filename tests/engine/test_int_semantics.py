"""Integer, bool and string semantics of the kernels against onnxruntime 1.32's InferenceSession.

A seeded sample of one-node models over every integer type, bool and strings (wrapping arithmetic, C
division and both Mods, bitwise ops, comparisons, Where, ArgMax/ArgMin and TopK with ties, Unique, NonZero,
CumSum, the reductions, Range, OneHot, the Gathers and Scatters with negative indices, Cast from NaN, ±inf,
-0, out-of-range and .5 values, string casts and the string ops) is run in onnxtrain's InferenceSession and
onnxruntime's and compared value for value (onnxruntime's graph optimizations off, as they fold Cast pairs).

Where onnxruntime departs from the ONNX spec the spec is kept (onnx.reference or the spec's text is the
oracle there): Cast to FLOAT8E5M2 with saturate=0 of a value that rounds past 57344 is ±inf (onnxruntime:
NaN), a float8 -0 cast to bool is False (onnxruntime: True), NonZero of a scalar has shape (0, N)
(onnxruntime: (1, N)), StringSplit without a delimiter splits at every whitespace character (onnxruntime:
only at U+0020). Where the spec leaves the result open (integer overflow in Pow and the reductions, float to
integer out of range, float to 4-bit integer) the sample stays within range.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h

import onnxtrain

ort = pytest.importorskip("onnxruntime")

_INTS = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]


def _info(t: type) -> int:
    return h.np_dtype_to_tensor_dtype(np.dtype(t)) if np.dtype(t).kind not in "OU" else T.STRING


def _model(nodes: list[onnx.NodeProto], feeds: dict[str, np.ndarray], outs: list[str],
           opset: int = 21) -> bytes:
    ins = [h.make_tensor_value_info(k, _info(v.dtype), None) for k, v in feeds.items()]
    g = h.make_graph(nodes, "g", ins, [h.make_empty_tensor_value_info(o) for o in outs])
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset)], ir_version=10).SerializeToString()


def _ort_run(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _ours(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return onnxtrain.InferenceSession(model).run(None, feeds)


def _assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.dtype,
                                                                 want.shape)
    if want.dtype.kind in "OU":
        assert got.tolist() == want.tolist(), what
    elif want.dtype.kind == "f":
        np.testing.assert_array_equal(got, want, err_msg=what)  # (NaN equals NaN here)
    else:
        assert np.array_equal(got, want), (what, got, want)


# ------------------------------------------------------------------------------ ReduceL2 of integers


def _floor_l2(x: np.ndarray, axis: int) -> np.ndarray:
    """⌊√Σx²⌋ along ``axis`` in exact integer arithmetic."""
    rows = np.moveaxis(x, axis, -1).reshape(-1, x.shape[axis]).tolist()
    out = [math.isqrt(sum(v * v for v in row)) for row in rows]
    return np.array(out, dtype=x.dtype).reshape(np.delete(x.shape, axis))


@pytest.mark.parametrize("dt", [np.int32, np.uint32, np.int64, np.uint64])
def test_reduce_l2_of_integers_does_not_overflow_in_its_squares(dt: type) -> None:
    """The L2 norm of integers whose norm fits the type but whose squares do not (int32 from 46,341): the
    integer square root of the exact sum of squares, as onnxruntime gives it (it sums in float64). The
    squares were summed in the input's type, wrapping: int32 [50000, 46341] gave 18775 instead of 68172."""
    rng = np.random.default_rng(11)
    # (the norms of three such values fit the type)
    top = {np.int32: 1_200_000_000, np.uint32: 2_400_000_000, np.int64: 1 << 40, np.uint64: 1 << 41}[dt]
    lo = -top if np.dtype(dt).kind == "i" else 0
    x = rng.integers(lo, top, (3, 5), dtype=np.int64).astype(dt)
    x[:, 0] = np.array([50000, 46341, 65536], dtype=dt)
    axes = np.array([0], np.int64)
    model = _model([h.make_node("ReduceL2", ["x", "axes"], ["y"], keepdims=0)], {"x": x, "axes": axes}, ["y"])
    (got,) = _ours(model, {"x": x, "axes": axes})
    want = _floor_l2(x.astype(object), 0).astype(dt)
    _assert_same(got, want, f"ReduceL2 {np.dtype(dt).name}")
    if dt in (np.int32, np.int64):  # the types onnxruntime's ReduceL2 takes
        _assert_same(got, _ort_run(model, {"x": x, "axes": axes})[0], "ReduceL2 onnxruntime")
