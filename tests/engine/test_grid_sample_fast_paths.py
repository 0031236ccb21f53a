"""GridSample's 2-D linear fast path (engine/kernels/sampling.py ``_bilinear``: a framed image, four taps a
point, the batch in parts over threads) against the general per-tap sampler of ``sample`` bit for bit, and
every mode against onnxruntime within 1e-5."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper as oh

import onnxtrain
from onnxtrain.engine.kernels import sampling

ELEM = {np.dtype(np.float32): 1, np.dtype(np.float64): 11}


def _model(x: np.ndarray, grid: np.ndarray, **attrs) -> bytes:
    g = oh.make_graph([oh.make_node("GridSample", ["X", "grid"], ["Y"], **attrs)], "g",
                      [oh.make_tensor_value_info("X", ELEM[x.dtype], x.shape),
                       oh.make_tensor_value_info("grid", ELEM[grid.dtype], grid.shape)],
                      [oh.make_tensor_value_info("Y", ELEM[x.dtype], None)])
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 20)]).SerializeToString()


def _ours(x: np.ndarray, grid: np.ndarray, **attrs) -> np.ndarray:
    return onnxtrain.InferenceSession(_model(x, grid, **attrs)).run(None, {"X": x, "grid": grid})[0]


def _inputs(seed: int, dtype: type, c: int, nan: bool) -> tuple[np.ndarray, np.ndarray]:
    """X (3, c, 5, 7) and a 4×6 grid reaching past the image on every side, with points on pixel centres
    and edges, and (``nan``) NaN and infinite coordinates."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3, c, 5, 7)).astype(dtype)
    grid = rng.uniform(-1.6, 1.6, (3, 4, 6, 2)).astype(dtype)
    grid[0, 0] = np.round(grid[0, 0] * 7) / 7  # on the pixel grid of either align_corners
    grid[1, 0, :4] = [[-1, -1], [1, 1], [-1, 1], [1, -1]]
    if nan:
        grid[2, 1, :4] = [[np.nan, 0.2], [0.1, np.nan], [np.inf, 0.3], [-0.4, -np.inf]]
    return x, grid


def _bits(a: np.ndarray) -> tuple:
    return a.dtype, a.shape, np.ascontiguousarray(a).tobytes()


def _same_bits_but_zero_signs(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bits, but that +0 and -0 may differ (where no tap of a point lies inside under zeros padding,
    the general sampler may sum -0 products; ``_bilinear``'s frame reads +0)."""
    if a.dtype != b.dtype or a.shape != b.shape or not np.array_equal(a, b, equal_nan=True):
        return False
    keep = a != 0
    return np.array_equal(a[keep].view(np.uint8), b[keep].view(np.uint8))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("c", [1, 17])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("nan", [False, True])
def test_bilinear_fast_path_matches_general_sampler(dtype, c, padding, align, nan, monkeypatch) -> None:
    x, grid = _inputs(c + align, dtype, c, nan)
    attrs = {"mode": "linear", "padding_mode": padding, "align_corners": align}
    fast = _ours(x, grid, **attrs)
    monkeypatch.setattr(sampling, "PART_POINTS", 20)  # parts of one image, shared out among threads
    parts = _ours(x, grid, **attrs)
    monkeypatch.setattr(sampling, "_bilinear_pads", lambda padding, align_corners: False)
    general = _ours(x, grid, **attrs)  # the per-tap loop of sample
    assert _bits(fast) == _bits(parts)
    assert _same_bits_but_zero_signs(fast, general)
    assert np.isnan(fast).any() == nan


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("c", [1, 17])
@pytest.mark.parametrize("mode", ["linear", "nearest", "cubic"])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [0, 1])
def test_grid_sample_matches_onnxruntime(dtype, c, mode, padding, align) -> None:
    x, grid = _inputs(7 * c + align, dtype, c, False)
    if mode == "nearest":  # away from rounding ties, where the engines may pick different pixels
        grid = grid + np.asarray(1e-3, dtype)
    attrs = {"mode": mode, "padding_mode": padding, "align_corners": align}
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    ref = ort.InferenceSession(_model(x, grid, **attrs), so, providers=["CPUExecutionProvider"]).run(
        None, {"X": x, "grid": grid})[0]
    np.testing.assert_allclose(_ours(x, grid, **attrs), ref, rtol=1e-5, atol=1e-5)


def test_volumetric_grid_sample_matches_onnxruntime() -> None:
    """5-D X (opset 20): the per-axis coordinates stacked for the general sampler."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 4, 5, 6)).astype(np.float32)
    grid = rng.uniform(-1.2, 1.2, (2, 3, 2, 4, 3)).astype(np.float32)
    for mode in ("linear", "nearest"):
        for padding in ("zeros", "border", "reflection"):
            attrs = {"mode": mode, "padding_mode": padding, "align_corners": 0}
            ref = ort.InferenceSession(_model(x, grid, **attrs), providers=["CPUExecutionProvider"]).run(
                None, {"X": x, "grid": grid})[0]
            np.testing.assert_allclose(_ours(x, grid, **attrs), ref, rtol=1e-5, atol=1e-5)
