"""Strided ConvTranspose by one GEMM per kernel shift (engine/kernels/conv_transpose_shifts.py) against
torch: its full transposed convolution (no pads) in float64, cropped or zero-extended to the ONNX output by
the node's begin pads, for every stride, dilation, group, pads, output_padding, output_shape and auto_pad
case below; then the path's choice by shape, and a one-node model with bias against onnxruntime."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import helper

from onnxtrain.engine import compile_model
from onnxtrain.engine.kernels import conv as conv_kernels
from onnxtrain.engine.kernels import conv_transpose_shifts as shifts
from onnxtrain.engine.registry import Attrs

torch = pytest.importorskip("torch")
F = torch.nn.functional

# name: (X shape, W shape, attributes)
CASES: dict[str, tuple[tuple[int, ...], tuple[int, ...], dict[str, Any]]] = {
    "2d-k4-s2-p1": ((2, 8, 4, 5), (8, 6, 4, 4), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "2d-k3-s2-output-padding": ((2, 5, 3, 4), (5, 4, 3, 3),
                                {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}),
    "2d-k2-s2": ((3, 4, 5, 3), (4, 3, 2, 2), {"strides": [2, 2]}),  # aligned: one copy out
    "2d-k4-s2-p2": ((2, 4, 4, 3), (4, 3, 4, 4), {"strides": [2, 2], "pads": [2, 2, 2, 2]}),  # aligned
    "3d-k2-s2": ((2, 3, 3, 2, 3), (3, 4, 2, 2, 2), {"strides": [2, 2, 2]}),  # aligned
    "2d-stride-above-kernel": ((2, 3, 3, 4), (3, 2, 2, 3), {"strides": [3, 4]}),  # phases without taps
    "2d-dilated": ((2, 4, 4, 3), (4, 3, 3, 2), {"strides": [2, 3], "dilations": [3, 2],
                                                "output_padding": [1, 2]}),
    "2d-dilation-equal-stride": ((2, 3, 4, 4), (3, 2, 3, 3), {"strides": [2, 2], "dilations": [2, 2]}),
    "2d-grouped": ((2, 6, 4, 4), (6, 2, 3, 3), {"strides": [2, 2], "pads": [1, 0, 0, 1], "group": 3}),
    "2d-one-axis-strided": ((2, 4, 5, 4), (4, 3, 3, 3), {"strides": [1, 2], "pads": [2, 0, 1, 1]}),
    "2d-first-axis-strided": ((2, 4, 5, 4), (4, 3, 3, 2), {"strides": [3, 1], "pads": [0, 1, 0, 0]}),
    "2d-output-shape-larger": ((2, 3, 3, 4), (3, 2, 3, 3), {"strides": [2, 2], "output_shape": [10, 12]}),
    "2d-output-shape-smaller": ((2, 3, 4, 4), (3, 2, 4, 4), {"strides": [2, 2], "output_shape": [5, 7]}),
    "2d-same-upper": ((2, 3, 3, 5), (3, 4, 3, 4), {"strides": [2, 3], "auto_pad": "SAME_UPPER"}),
    "2d-same-lower": ((2, 3, 3, 5), (3, 4, 3, 4), {"strides": [2, 3], "auto_pad": "SAME_LOWER"}),
    "2d-batch-1": ((1, 4, 3, 3), (4, 2, 4, 4), {"strides": [2, 2], "pads": [1, 2, 2, 1]}),
    "1d-k4-s2": ((3, 5, 9), (5, 4, 4), {"strides": [2], "pads": [1, 1], "output_padding": [1]}),
    "1d-s3-dilated": ((2, 4, 7), (4, 3, 3), {"strides": [3], "dilations": [2], "pads": [2, 0]}),
    "1d-grouped": ((2, 4, 6), (4, 3, 4), {"strides": [2], "group": 2}),
    "3d-k3-s2": ((2, 4, 3, 4, 3), (4, 3, 3, 3, 3),
                 {"strides": [2, 2, 2], "pads": [1] * 6, "output_padding": [1, 1, 1]}),
    "3d-strides-2-1-3": ((2, 3, 3, 4, 3), (3, 2, 3, 2, 2),
                         {"strides": [2, 1, 3], "dilations": [1, 2, 1], "output_padding": [1, 0, 2]}),
    "3d-grouped": ((2, 4, 3, 3, 4), (4, 2, 2, 3, 2), {"strides": [2, 1, 2], "group": 2}),
}


def _oracle(x: np.ndarray, w: np.ndarray, attrs: dict[str, Any]) -> np.ndarray:
    """torch's transposed convolution without pads, in float64, cropped to the ONNX output (begin pads and
    output size from the node's geometry), zeros where the output lies beyond it."""
    nd = x.ndim - 2
    g = conv_kernels._convt_geometry(Attrs(dict(attrs)), x.shape, w.shape)
    fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nd - 1]
    full = fn(torch.tensor(x, dtype=torch.float64), torch.tensor(w, dtype=torch.float64),
              stride=g["strides"], dilation=g["dil"], groups=g["group"]).numpy()
    y = np.zeros(x.shape[:1] + (g["m"],) + tuple(g["out"]))
    dst, src = [], []
    for o, pb, f in zip(g["out"], g["pb"], full.shape[2:], strict=True):
        lo, hi = max(0, -pb), min(o, f - pb)
        dst.append(slice(lo, max(lo, hi)))
        src.append(slice(lo + pb, max(lo, hi) + pb))
    y[(slice(None), slice(None)) + tuple(dst)] = full[(slice(None), slice(None)) + tuple(src)]
    return y


@pytest.fixture
def any_size(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every strided float ConvTranspose takes the shifted GEMMs; the list counts their calls."""
    for name in ("MIN_CHANNELS_PER_GROUP", "MIN_COLUMNS", "MIN_MACS", "MIN_OFFSETS"):
        monkeypatch.setattr(shifts, name, 0)
    calls: list[int] = []
    real = shifts.conv_transpose
    monkeypatch.setattr(shifts, "conv_transpose", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("case", list(CASES))
def test_float64_matches_torch(case: str, any_size: list[int]) -> None:
    xs, ws, attrs = CASES[case]
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    got = conv_kernels.conv_transpose([x, w], Attrs(dict(attrs)))[0]
    assert any_size == [1]
    want = _oracle(x, w, attrs)
    assert got.shape == want.shape and got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", list(CASES))
def test_float32_error_within_torch_float32s(case: str, any_size: list[int]) -> None:
    """float32 against torch's float64 values: within a few times torch's own float32 error."""
    xs, ws, attrs = CASES[case]
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
    got = conv_kernels.conv_transpose([x, w], Attrs(dict(attrs)))[0]
    assert any_size == [1] and got.dtype == np.float32
    want = _oracle(x.astype(np.float64), w.astype(np.float64), attrs)
    g = conv_kernels._convt_geometry(Attrs(dict(attrs)), xs, ws)
    nd = len(xs) - 2
    fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nd - 1]
    theirs = fn(torch.tensor(x), torch.tensor(w), stride=g["strides"], dilation=g["dil"], groups=g["group"])
    theirs_err = float(np.abs(theirs.numpy() - fn(torch.tensor(x, dtype=torch.float64),
                                                  torch.tensor(w, dtype=torch.float64), stride=g["strides"],
                                                  dilation=g["dil"], groups=g["group"]).numpy()).max())
    err = float(np.abs(got - want).max())
    assert err <= 4 * theirs_err + 1e-6 * float(np.abs(want).max())


def test_non_finite_inputs_reach_their_outputs_only(any_size: list[int]) -> None:
    """An inf in X makes ±inf/NaN only in the outputs its kernel offsets reach (the zero padding of the row
    layout multiplies only finite weights)."""
    xs, ws, attrs = CASES["2d-k4-s2-p1"]
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    x[1, 3, 2, 4] = np.inf
    got = conv_kernels.conv_transpose([x, w], Attrs(dict(attrs)))[0]
    with np.errstate(invalid="ignore"):
        want = _oracle(x, w, attrs)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-12, atol=1e-12)


# worked out by hand: begin pads (SAME_UPPER's 0) and output sizes multiples of the stride, the canvas rows
# enough (extent = input + ⌊(k − 1)·d / s⌋)
ALIGNED = {"2d-k2-s2", "2d-k4-s2-p2", "3d-k2-s2", "2d-first-axis-strided", "2d-one-axis-strided",
           "2d-same-upper", "3d-grouped"}


@pytest.mark.parametrize("case", list(CASES))
def test_aligned_outputs_take_one_copy(case: str, any_size: list[int], monkeypatch) -> None:
    """Begin pads and output sizes that are multiples of the stride on every axis but the last (with the
    last axis whole) write the output in one copy; the float64 test above checks its values."""
    calls: list[int] = []
    real = shifts._copy_aligned
    monkeypatch.setattr(shifts, "_copy_aligned", lambda *a: calls.append(1) or real(*a))
    xs, ws, attrs = CASES[case]
    rng = np.random.default_rng(0)
    conv_kernels.conv_transpose([rng.standard_normal(xs), rng.standard_normal(ws)], Attrs(dict(attrs)))
    assert calls == ([1] if case in ALIGNED else [])


# (X shape, W shape, attributes, whether the shifted GEMMs take it at the default limits)
CHOICE = [
    ((4, 64, 8, 8), (64, 32, 4, 4), {"strides": [2, 2], "pads": [1, 1, 1, 1]}, True),
    ((16, 64, 1000), (64, 32, 4), {"strides": [2], "pads": [1, 1]}, True),
    ((64, 64, 32, 32), (64, 3, 4, 4), {"strides": [2, 2], "pads": [1, 1, 1, 1]}, False),  # 6 columns
    ((16, 4, 16, 16), (4, 32, 4, 4), {"strides": [2, 2]}, False),  # 4 input channels
    ((2, 16, 64), (16, 16, 4), {"strides": [2], "pads": [1, 1]}, False),  # 131 K multiply-adds
    ((8, 32, 16, 16), (32, 32, 3, 3), {"pads": [1, 1, 1, 1]}, False),  # stride 1
]


@pytest.mark.parametrize("xs,ws,attrs,taken", CHOICE)
def test_path_by_shape(xs, ws, attrs, taken, monkeypatch) -> None:
    calls: list[int] = []
    real = shifts.conv_transpose
    monkeypatch.setattr(shifts, "conv_transpose", lambda *a: calls.append(1) or real(*a))
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal(xs, dtype=np.float32), rng.standard_normal(ws, dtype=np.float32)
    conv_kernels.conv_transpose([x, w], Attrs(dict(attrs)))
    assert calls == ([1] if taken else [])


@pytest.mark.parametrize("attrs", [{"strides": [2, 2]}, {"strides": [2, 3], "pads": [1, 0, 0, 2],
                                                       "output_padding": [1, 2]}], ids=["plain", "pads"])
def test_strided_one_by_one_kernel_takes_col2im(attrs: dict[str, Any]) -> None:
    """A 1×1 kernel (a strided 1×1 Conv's input gradient) has a single offset: col2im's one strided copy,
    not the shifted GEMMs, however large; the values against torch."""
    xs, ws = (8, 32, 16, 16), (32, 16, 1, 1)
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
    g = conv_kernels._convt_geometry(Attrs(dict(attrs)), xs, ws)
    assert x.size * g["mg"] >= shifts.MIN_MACS and not shifts.fits(x, g)
    got = conv_kernels.conv_transpose([x, w], Attrs(dict(attrs)))[0]
    want = _oracle(x.astype(np.float64), w.astype(np.float64), attrs)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_one_node_model_with_bias_matches_onnxruntime() -> None:
    ort = pytest.importorskip("onnxruntime")
    xs, ws = (4, 64, 8, 8), (64, 32, 4, 4)
    attrs = {"strides": [2, 2], "pads": [1, 0, 2, 1], "output_padding": [1, 0]}
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], **attrs)
    graph = helper.make_graph([node], "ct", [helper.make_tensor_value_info("x", 1, xs),
                                             helper.make_tensor_value_info("w", 1, ws),
                                             helper.make_tensor_value_info("b", 1, [32])],
                              [helper.make_tensor_value_info("y", 1, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    rng = np.random.default_rng(4)
    feeds = {"x": rng.standard_normal(xs, dtype=np.float32), "w": rng.standard_normal(ws, dtype=np.float32),
             "b": rng.standard_normal(32, dtype=np.float32)}
    g = conv_kernels._convt_geometry(Attrs(dict(attrs)), xs, ws)
    assert shifts.fits(feeds["x"], g)
    got = compile_model(model).run(feeds)[0]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, feeds)[0]
    assert got.shape == want.shape == (4, 32, 16, 17)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
