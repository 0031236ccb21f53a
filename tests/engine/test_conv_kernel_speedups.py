"""Faster paths of the Conv and ConvTranspose kernels against onnxruntime and torch.

- a stride-1 2-D depthwise Conv with narrow rows runs as banded GEMMs, one per kernel row and channel
  (engine/kernels/depthwise.py ``_depthwise_rows``);
- a stride-1 ConvTranspose with groups runs as the equivalent grouped Conv: a depthwise one by the depthwise
  Conv's routes (banded GEMMs, few-outputs dot products) or im2col, others by shifted GEMMs per group where
  each group has enough work (engine/kernels/conv.py ``_conv_transpose_as_conv``);
- a stride-1 grouped Conv, and a 5×5 kernel with 16 or more channels a side, run by shifted GEMMs; a grouped
  one with little work per group (a depthwise weight gradient, ResNeXt's groups of 8) by im2col.

Each case checks which path ran, and the values against onnxruntime (and torch's input gradient for the
ConvTransposes).

Two layouts of the same products (shared or plain padding, pitched or per-image canvases, im2col in chunks
or whole) are not compared bit for bit: OpenBLAS's sgemm rounds an output by where it falls in the
product's tiles (its Haswell/Zen kernel, sgemm_kernel_8x4_haswell_2.c, sums a 16-row tile's dot products in
one chain over k but an 8-row edge tile's in two, even and odd k, added at the end), and a layout moves
outputs between tiles. On an AMD EPYC (OpenBLAS 0.3.31, Haswell kernels) they differ in up to 39 % of the
outputs by up to 1.1 float32 epsilons of the sum of the terms' magnitudes, where the Sapphire Rapids host's
kernels gave the same bits. Each layout is checked instead against torch in float64, within a few epsilons
of that magnitude (:func:`_within_rounding`), which a missing tap or a shifted offset misses by orders of
magnitude.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxtrain.engine.blas import can_pin_blas_threads, single_threaded_blas
from onnxtrain.engine.kernels import conv as conv_kernels
from onnxtrain.engine.kernels import depthwise
from onnxtrain.engine.parallel import recording_splits, running_with
from onnxtrain.engine.registry import Attrs

ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")
F = torch.nn.functional


def _model(op: str, xs: tuple[int, ...], ws: tuple[int, ...], attrs: dict[str, Any]) -> onnx.ModelProto:
    node = helper.make_node(op, ["x", "w"], ["y"], **attrs)
    graph = helper.make_graph([node], op, [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, xs),
                                           helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, ws)],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT,
                                                             ["n", "m", "h", "w"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def _ort(op: str, x: np.ndarray, w: np.ndarray, attrs: dict[str, Any]) -> np.ndarray:
    sess = ort.InferenceSession(_model(op, x.shape, w.shape, attrs).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x, "w": w})[0]


def _ours(op: str, x: np.ndarray, w: np.ndarray, attrs: dict[str, Any], threads: int = 1) -> np.ndarray:
    kernel = conv_kernels.conv if op == "Conv" else conv_kernels.conv_transpose
    with running_with(threads):
        return kernel([x, w], Attrs(dict(attrs), op=op))[0]


def _spy(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, small: bool = True) -> list[dict[str, Any]]:
    """The geometries that ``module.name`` (a kernel path taking x, w, g) is called with from now on (with
    ``small``, small depthwise cases too)."""
    if small:
        monkeypatch.setattr(depthwise, "MIN_DEPTHWISE", 0)
        monkeypatch.setattr(depthwise, "MIN_BANDED", 0)
        monkeypatch.setattr(depthwise, "MIN_BANDED_WIDE", 0)
    seen: list[dict[str, Any]] = []
    real = getattr(module, name)

    def spy(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray:
        seen.append(g)
        return real(x, w, g)

    monkeypatch.setattr(module, name, spy)
    return seen


def _close(y: np.ndarray, want: np.ndarray) -> None:
    assert y.shape == want.shape and y.dtype == want.dtype
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def _data(seed: int, xs: tuple[int, ...], ws: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)


EPS32 = float(np.finfo(np.float32).eps)


def _within_rounding(y: np.ndarray, want: np.ndarray, scale: np.ndarray, eps: float = 8.0) -> None:
    """float32 ``y`` within ``eps`` float32 epsilons of each output's sum of its terms' magnitudes
    (``scale``, float64) of the float64 ``want``: a bound that holds whatever order the BLAS adds in (measured
    up to 1.4 here), where a missing tap or a shifted offset is off by about a tap's share of that sum."""
    assert y.shape == want.shape and y.dtype == np.float32
    err = np.abs(y.astype(np.float64) - want)
    bad = err > eps * EPS32 * scale
    worst = float(np.max(err / np.maximum(scale, np.finfo(np.float64).tiny)) / EPS32)
    assert not bad.any(), f"{int(bad.sum())} of {y.size} outputs past {eps} eps of their terms: {worst:.3g}"


def _torch_conv64(x: np.ndarray, w: np.ndarray, attrs: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """torch's float64 Conv of ``x`` by ``w`` (ONNX pads, strides, dilations, group) and the same Conv of
    |x| by |w|: each output's sum of its terms' magnitudes."""
    nd = x.ndim - 2
    p = attrs.get("pads", [0] * 2 * nd)
    pads = [v for i in reversed(range(nd)) for v in (p[i], p[nd + i])]
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd]
    kw = {"stride": attrs.get("strides", 1), "dilation": attrs.get("dilations", 1),
          "groups": attrs.get("group", 1)}
    xt, wt = torch.tensor(x, dtype=torch.float64), torch.tensor(w, dtype=torch.float64)
    return (conv(F.pad(xt, pads), wt, **kw).numpy(), conv(F.pad(xt.abs(), pads), wt.abs(), **kw).numpy())


def _split_keeps_the_bits(op: str, x: np.ndarray, w: np.ndarray, attrs: dict[str, Any]) -> list[int]:
    """The kernel on two threads gives the bits of one thread making the same BLAS calls; returns the splits.

    Where the kernel splits its GEMMs over the threads, each runs at one OpenBLAS thread
    (``blas.single_threaded_blas``), so the one-thread run is made at one OpenBLAS thread too: unpinned,
    OpenBLAS splits a large enough GEMM over its own threads, and its Haswell/Zen kernel rounds the rows it
    then puts in other tiles differently (a depthwise 7×7 of 2 × 16 × 64²: 12 % of the outputs, by up to 1.2
    float32 epsilons of their terms' magnitude). That is OpenBLAS's thread count, not the engine's split."""
    parts: list[int] = []
    with recording_splits(parts):
        two = _ours(op, x, w, attrs, threads=2)
    if any(n > 1 for n in parts) and can_pin_blas_threads():
        with single_threaded_blas():
            one = _ours(op, x, w, attrs)
    else:
        one = _ours(op, x, w, attrs)
    np.testing.assert_array_equal(two, one)
    return parts


# x shape, channel multiplier, kernel, dilations, pads (begin + end)
BANDED = [
    ((16, 64, 16, 16), 1, (3, 3), (1, 1), (1, 1, 1, 1)),
    ((4, 16, 20, 24), 1, (7, 7), (1, 1), (3, 3, 3, 3)),
    ((3, 12, 17, 15), 2, (5, 3), (1, 2), (2, 0, 1, 3)),
    ((2, 10, 30, 13), 1, (3, 5), (2, 1), (0, 2, 2, 1)),
    ((5, 40, 7, 7), 3, (3, 3), (1, 1), (1, 1, 1, 1)),
]


@pytest.mark.parametrize("case", BANDED, ids=str)
def test_depthwise_banded_conv_matches_onnxruntime(case, monkeypatch) -> None:
    xs, mult, k, d, p = case
    c = xs[1]
    seen = _spy(monkeypatch, depthwise, "_depthwise_rows")
    x, w = _data(1, xs, (c * mult, 1, *k))
    attrs = {"group": c, "dilations": list(d), "pads": list(p)}
    y = _ours("Conv", x, w, attrs)
    assert len(seen) == 1
    _close(y, _ort("Conv", x, w, attrs))
    _within_rounding(y, *_torch_conv64(x, w, attrs))
    _split_keeps_the_bits("Conv", x, w, attrs)


def test_depthwise_banded_float64_matches_torch(monkeypatch) -> None:
    seen = _spy(monkeypatch, depthwise, "_depthwise_rows")
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((6, 24, 18, 22)), rng.standard_normal((24, 1, 5, 5))
    y = _ours("Conv", x, w, {"group": 24, "pads": [2, 2, 2, 2]})
    want = F.conv2d(torch.tensor(x), torch.tensor(w), padding=2, groups=24).numpy()
    assert len(seen) == 1
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


# x shape, kernel, route at the real thresholds: a kernel of 25+ taps goes banded from 8 K outputs (ConvNeXt's
# 7×7 over 8² planes), a 3×3 from 32 K; below, im2col
WIDE_KERNELS = [
    ((8, 64, 8, 8), 7, True),
    ((2, 64, 8, 8), 7, True),
    ((8, 32, 8, 8), 5, True),
    ((1, 64, 8, 8), 7, False),
    ((4, 64, 8, 8), 3, False),
    ((8, 64, 8, 8), 3, True),
]


@pytest.mark.parametrize("case", WIDE_KERNELS, ids=str)
def test_depthwise_wide_kernels_go_banded_from_fewer_outputs(case, monkeypatch) -> None:
    xs, k, banded = case
    seen = _spy(monkeypatch, depthwise, "_depthwise_rows", small=False)
    x, w = _data(5, xs, (xs[1], 1, k, k))
    attrs = {"group": xs[1], "pads": [k // 2] * 4}
    y = _ours("Conv", x, w, attrs)
    assert len(seen) == int(banded)
    _close(y, _ort("Conv", x, w, attrs))
    want = F.conv2d(torch.tensor(x), torch.tensor(w), padding=k // 2, groups=xs[1]).numpy()
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


# x shape, kernel, stride, banded: padded rows of at most kw + 3 values a kernel column at stride 1, 6 a
# kernel column and stride at stride 2, go banded; wider ones keep the shifted adds
ROW_WIDTHS = [
    ((2, 32, 16, 16), 3, 1, True),  # Wp 18
    ((2, 32, 17, 17), 3, 1, False),  # Wp 19
    ((2, 16, 36, 36), 5, 1, True),  # Wp 40
    ((2, 16, 37, 37), 5, 1, False),
    ((2, 16, 64, 64), 7, 1, True),  # Wp 70
    ((4, 32, 34, 34), 3, 2, True),  # Wp 35
    ((4, 32, 36, 36), 3, 2, False),  # Wp 37
    ((2, 32, 60, 60), 3, 1, False),
]


@pytest.mark.parametrize("case", ROW_WIDTHS, ids=str)
def test_depthwise_rows_up_to_their_width(case, monkeypatch) -> None:
    """The route by row width; onnxruntime's values, torch's float64 within rounding, and on two threads the
    bits of one thread making the same GEMM calls (:func:`_split_keeps_the_bits`: on OpenBLAS's Haswell/Zen
    kernels the 7×7 over 2 × 16 × 64², whose 140 × 70 × 64 channel GEMMs OpenBLAS threads when left to
    itself, differs there from the unpinned one-thread run in 12 % of the outputs, by up to 1.2 epsilons of
    their terms' magnitude; each run within 1.0 of torch)."""
    xs, k, s, banded = case
    seen = _spy(monkeypatch, depthwise, "_depthwise_rows")
    x, w = _data(2, xs, (xs[1], 1, k, k))
    attrs = {"group": xs[1], "pads": [k // 2] * 4, "strides": [s, s]}
    y = _ours("Conv", x, w, attrs)
    assert len(seen) == int(banded)
    _close(y, _ort("Conv", x, w, attrs))
    _within_rounding(y, *_torch_conv64(x, w, attrs))
    _split_keeps_the_bits("Conv", x, w, attrs)


def _torch_input_grad(x_shape: tuple[int, ...], w: np.ndarray, dy: np.ndarray, attrs: dict[str, Any],
                      group: int) -> np.ndarray:
    """dX of torch's conv2d (weights ``w`` as a Conv's) for output gradient ``dy``."""
    p = attrs.get("pads", [0, 0, 0, 0])
    xt = torch.zeros(x_shape, dtype=torch.float32, requires_grad=True)
    xp = F.pad(xt, [p[1], p[3], p[0], p[2]])
    y = F.conv2d(xp, torch.tensor(w), dilation=attrs.get("dilations", [1, 1]), groups=group)
    (dx,) = torch.autograd.grad(y, xt, torch.tensor(dy))
    return dx.numpy()


# dY shape (N, C, ...), W shape (C, M/group, kh, kw), group, dilations, pads: a stride-1 Conv's input
# gradient, so the ConvTranspose's output is that Conv's input
TRANSPOSED = [
    ((16, 64, 32, 32), (64, 1, 7, 7), 64, (1, 1), (3, 3, 3, 3), "_depthwise_rows"),
    ((3, 20, 14, 15), (20, 1, 3, 5), 20, (2, 1), (1, 2, 2, 1), "_depthwise_rows"),
    ((16, 64, 16, 16), (64, 16, 3, 3), 4, (1, 1), (1, 1, 1, 1), "_shifted_conv"),
    ((8, 64, 11, 9), (64, 32, 3, 2), 2, (1, 2), (0, 1, 2, 1), "_shifted_conv"),
    ((20, 48, 10, 12), (48, 16, 5, 5), 3, (1, 1), (2, 2, 2, 2), "_shifted_conv"),
    # too little work per group for a GEMM call each: the ConvTranspose's own col2im
    ((2, 32, 11, 9), (32, 8, 3, 2), 2, (1, 2), (0, 1, 2, 1), "_col2im_conv_transpose"),
    # depthwise, 7×7 over tiny planes (ConvNeXt's last stages): the Conv's few-outputs dot products or banded
    # GEMMs, not shifted adds on a canvas 6-12× the input (4.4 → 0.9 ms, 3.0 → 0.65 ms; im2col's 0.65 → 0.35)
    ((8, 128, 4, 4), (128, 1, 7, 7), 128, (1, 1), (3, 3, 3, 3), "_few_outputs"),
    ((8, 64, 8, 8), (64, 1, 7, 7), 64, (1, 1), (3, 3, 3, 3), "_depthwise_rows"),
]
AT_REAL_THRESHOLDS = {"_im2col_conv", "_col2im_conv_transpose"}  # routes taken where the sizes say so
REAL_SIZES = {(8, 64, 8, 8)}  # ... and cases of other routes checked at the real thresholds


@pytest.mark.parametrize("case", TRANSPOSED, ids=str)
def test_grouped_conv_transpose_as_conv(case, monkeypatch) -> None:
    ys, ws, group, d, p, path = case
    module = depthwise if path.startswith("_depthwise") or path == "_few_outputs" else conv_kernels
    small = path not in AT_REAL_THRESHOLDS and ys not in REAL_SIZES
    seen = _spy(monkeypatch, module, path, small=small)
    dy, w = _data(4, ys, ws)
    attrs = {"group": group, "dilations": list(d), "pads": list(p)}
    y = _ours("ConvTranspose", dy, w, attrs)
    assert len(seen) == 1 and (path == "_col2im_conv_transpose" or seen[0]["group"] == group)
    _close(y, _ort("ConvTranspose", dy, w, attrs))
    kd = [(ws[2 + i] - 1) * d[i] + 1 for i in range(2)]
    x_shape = (ys[0], ws[1] * group) + tuple(ys[2 + i] + kd[i] - 1 - p[i] - p[2 + i] for i in range(2))
    _close(y, _torch_input_grad(x_shape, w, dy, attrs, group))  # the Conv's weights are W as they are


# x shape, W shape, group, dilations, pads
SHIFTED = [
    ((16, 64, 16, 16), (64, 16, 3, 3), 4, (1, 1), (1, 1, 1, 1)),
    ((4, 96, 13, 10), (144, 32, 3, 2), 3, (2, 1), (1, 0, 2, 1)),
    ((16, 32, 32, 32), (32, 32, 5, 5), 1, (1, 1), (2, 2, 2, 2)),
    ((2, 16, 15, 12), (24, 16, 5, 3), 1, (1, 2), (2, 1, 0, 3)),
]


@pytest.mark.parametrize("case", SHIFTED, ids=str)
def test_grouped_and_wide_conv_by_shifted_gemms(case, monkeypatch) -> None:
    xs, ws, group, d, p = case
    seen = _spy(monkeypatch, conv_kernels, "_shifted_conv")
    x, w = _data(5, xs, ws)
    attrs = {"group": group, "dilations": list(d), "pads": list(p)}
    y = _ours("Conv", x, w, attrs)
    assert len(seen) == 1
    _close(y, _ort("Conv", x, w, attrs))


# x shape, W shape, group, dilations, pads, whether the padding is shared (else the plain layout)
SHARED_PADS = [
    ((8, 32, 8, 8), (32, 32, 3, 3), 1, (1, 1), (1, 1, 1, 1), True),
    ((3, 16, 9, 7), (8, 16, 3, 3), 1, (1, 1), (2, 1, 1, 1), True),  # uneven
    ((3, 16, 9, 7), (8, 16, 3, 3), 1, (1, 1), (2, 0, 0, 1), False),  # each axis padded on one side only
    ((2, 16, 11, 10), (16, 16, 3, 3), 1, (2, 2), (2, 1, 1, 2), True),  # dilated
    ((16, 64, 16, 15), (64, 16, 3, 3), 4, (1, 1), (1, 1, 1, 1), True),  # grouped
    ((2, 16, 5, 6, 4), (16, 16, 3, 3, 3), 1, (1, 1, 1), (1, 1, 0, 1, 1, 2), True),  # 3-D
    ((2, 16, 8, 8), (16, 16, 3, 3), 1, (1, 1), (0, 0, 0, 0), False),  # no pads to share
    # pads past the kernel: the output rows that read only padding are cropped off first (kernels/conv.py's
    # _conv_live_part), then the rest shares (the layout's rows-too-long case: test_conv_transpose_dead_taps)
    ((2, 16, 8, 8), (16, 16, 3, 3), 1, (1, 1), (3, 1, 3, 1), True),
]


@pytest.mark.parametrize("case", SHARED_PADS, ids=str)
def test_shifted_gemms_share_the_padding(case, monkeypatch) -> None:
    """Neighbouring rows and images share their zero padding in the shifted GEMMs' layout: the same products
    as the plain layout, each layout within rounding of torch's float64 Conv, and onnxruntime's values (2-D).
    Not bit for bit with each other: the layouts' GEMMs have other column counts, so an output may fall in
    another of OpenBLAS's tiles (on the Haswell/Zen kernel 2-30 % of the outputs of the 3×3 cases differ,
    by up to 0.7 epsilons of their terms' magnitude; both layouts within 0.7 of torch)."""
    xs, ws, group, d, p, shared = case
    seen = _spy(monkeypatch, conv_kernels, "_shifted_conv")
    x, w = _data(6, xs, ws)
    attrs = {"group": group, "dilations": list(d), "pads": list(p)}
    y = _ours("Conv", x, w, attrs)
    assert len(seen) == 1 and (seen[0]["shared"] is not None) == shared
    if shared:  # fewer positions than the plain layout's padded planes
        assert np.prod(seen[0]["shared"]["pitch"]) < np.prod(seen[0]["sizes"])
    want, scale = _torch_conv64(x, w, attrs)
    _within_rounding(y, want, scale)
    monkeypatch.setattr(conv_kernels, "_shared_pads", lambda *a: None)
    plain = _ours("Conv", x, w, attrs)
    assert len(seen) == 2 and seen[1]["shared"] is None
    _within_rounding(plain, want, scale)
    if len(xs) == 4:  # (the onnxruntime model here is 2-D)
        _close(y, _ort("Conv", x, w, attrs))


# x shape, W shape, group, pads: grouped Convs with too little work per group and kernel offset for one GEMM
# call each (engine/kernels/conv.py SHIFTED_MIN_GROUP_WORK): im2col and one batched matmul
FEW_PER_GROUP = [
    ((1, 2048, 2, 2), (256, 8, 2, 2), 256, (3, 3, 3, 3)),  # a depthwise 7×7's weight gradient: 12.5 → 0.19 ms
    ((16, 256, 8, 8), (256, 8, 3, 3), 32, (1, 1, 1, 1)),  # ResNeXt's 32 groups of 8: 4.8 → 1.7 ms
    ((8, 64, 16, 16), (64, 8, 3, 3), 8, (1, 1, 1, 1)),
]


@pytest.mark.parametrize("case", FEW_PER_GROUP, ids=str)
def test_grouped_conv_with_little_work_per_group_goes_by_im2col(case, monkeypatch) -> None:
    xs, ws, group, p = case
    shifted = _spy(monkeypatch, conv_kernels, "_shifted_conv", small=False)
    im2col = _spy(monkeypatch, conv_kernels, "_im2col_conv", small=False)
    x, w = _data(6, xs, ws)
    attrs = {"group": group, "pads": list(p)}
    y = _ours("Conv", x, w, attrs)
    assert shifted == [] and len(im2col) == 1
    _close(y, _ort("Conv", x, w, attrs))
    want = F.conv2d(F.pad(torch.tensor(x), [p[1], p[3], p[0], p[2]]), torch.tensor(w), groups=group)
    _close(y, want.numpy())


# x shape, W shape, group, pads of a grouped Conv with several input channels per group, whose weight
# gradient the gradient graph writes as a Conv with the images as channels and the output gradient as its
# kernel: fewer output positions than taps, so the few-outputs dot products run, one GEMM per position over
# all of the Conv's batch (its cg planes) at once (wav2vec2's positional Conv1d, 16 taps in 4 groups: 1.9 →
# 0.9 ms; ResNeXt's 32 groups of 8 at 16 × 8²: 2.4 → 1.3 ms)
GROUPED_WEIGHT_GRADS = [
    ((8, 64, 199), (64, 16, 16), 4, (8, 8)),
    ((16, 256, 8, 8), (256, 8, 3, 3), 32, (1, 1, 1, 1)),
    ((4, 24, 9, 7), (36, 6, 3, 2), 4, (1, 0, 1, 0)),
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", GROUPED_WEIGHT_GRADS, ids=str)
def test_grouped_weight_gradient_by_few_outputs(case, threads, monkeypatch) -> None:
    xs, ws, group, p = case
    nd = len(xs) - 2
    x, w = _data(6, xs, ws)
    dy_shape = (xs[0], ws[0]) + tuple(xs[2 + i] + p[i] + p[nd + i] - ws[2 + i] + 1 for i in range(nd))
    dy = np.random.default_rng(7).standard_normal(dy_shape).astype(np.float32)
    # the weight gradient as the gradient graph has it: X's channels per group as the batch, (group, image)
    # as the channels, dY laid (M, N, *out) as the kernel; the output (C/group, M, *k) holds dW transposed
    cg = xs[1] // group
    images_last = x.reshape((xs[0], group, cg) + xs[2:]).transpose((2, 1, 0) + tuple(range(3, nd + 3)))
    a = np.ascontiguousarray(images_last).reshape((cg, group * xs[0]) + xs[2:])
    b = np.ascontiguousarray(dy.swapaxes(0, 1))
    seen = _spy(monkeypatch, depthwise, "_few_outputs", small=False)
    parts: list[int] = []
    with recording_splits(parts):
        got = _ours("Conv", a, b, {"group": group, "pads": list(p)}, threads=threads)
    assert len(seen) == 1 and seen[0]["n"] == cg > 1
    # GEMMs, which OpenBLAS threads itself: none split over the engine's threads (two at once stalled each
    # other for 16-25 ms in SqueezeBERT's step)
    assert parts == []
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    conv = F.conv1d if nd == 1 else F.conv2d
    conv(tx, tw, padding=list(p[:nd]), groups=group).backward(torch.tensor(dy))
    _close(np.ascontiguousarray(got.swapaxes(0, 1)), tw.grad.numpy())


def test_depthwise_weight_gradient_still_splits_over_threads(monkeypatch) -> None:
    """One image a group (a depthwise weight gradient whose padded rows are too wide for the row products):
    matrix-vector products, split over two threads, the bits of one thread making the same calls
    (:func:`_split_keeps_the_bits`), onnxruntime's values and torch's float64 within rounding."""
    xs, ws, group = (1, 2048, 17, 17), (256, 8, 16, 16), 256  # 17 values a row for 2 columns
    attrs = {"group": group, "pads": [0, 0, 0, 0]}
    x, w = _data(8, xs, ws)
    seen = _spy(monkeypatch, depthwise, "_few_outputs", small=False)
    parts: list[int] = []
    with recording_splits(parts):
        two = _ours("Conv", x, w, attrs, threads=2)
    assert len(seen) == 1 and seen[0]["n"] == 1 and parts == [2]
    assert _split_keeps_the_bits("Conv", x, w, attrs) == [2]
    _close(two, _ort("Conv", x, w, attrs))
    _within_rounding(two, *_torch_conv64(x, w, attrs))


# a depthwise Conv's weight gradient as the gradient graph writes it: a Conv of one image whose group c holds
# channel c of every image, with the output gradients as weights (dilated by the Conv's strides). X shape,
# kernel, pads, strides, dtype, whether the row products take it (padded rows of at most 8 values per kernel
# column)
WEIGHT_GRADS = [
    ((8, 64, 8, 8), (7, 7), (3, 3, 3, 3), (1, 1), np.float32, True),  # ConvNeXt's 7×7 over 8²
    ((8, 32, 16, 16), (7, 7), (3, 3, 3, 3), (1, 1), np.float32, True),
    ((8, 128, 4, 4), (7, 7), (3, 3, 3, 3), (1, 1), np.float32, True),  # 49 outputs of 16 taps: not few
    ((16, 64, 4, 4), (3, 3), (1, 1, 1, 1), (1, 1), np.float32, True),  # MobileNet's last 3×3s
    ((16, 64, 2, 2), (3, 3), (1, 1, 1, 1), (1, 1), np.float32, False),  # 4 taps (2² gradient planes)
    ((16, 24, 16, 16), (3, 3), (1, 1, 1, 1), (1, 1), np.float32, True),  # MobileNet's 3×3
    ((16, 24, 16, 16), (3, 3), (1, 1, 1, 1), (2, 2), np.float32, True),  # ... and its strided ones
    ((4, 12, 15, 13), (3, 3), (1, 0, 1, 1), (2, 3), np.float32, True),  # odd sizes, uneven strides
    ((3, 10, 9, 11), (3, 5), (0, 2, 1, 1), (1, 1), np.float64, True),  # uneven pads, a non-square kernel
    ((4, 16, 32, 32), (3, 3), (1, 1, 1, 1), (1, 1), np.float32, False),  # 34 values a row for 3 columns
]


@pytest.mark.parametrize("case", WEIGHT_GRADS, ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_depthwise_weight_gradient_by_row_products(case, threads, monkeypatch) -> None:
    xs, k, p, s, dtype, rows = case
    n, c, h, w_ = xs
    seen = _spy(monkeypatch, depthwise, "_rows_weight_grad", small=False)
    rng = np.random.default_rng(sum(xs))
    x = rng.standard_normal(xs).astype(dtype)
    xt = torch.tensor(x, requires_grad=True)
    wt = torch.tensor(rng.standard_normal((c, 1) + k).astype(dtype), requires_grad=True)
    y = F.conv2d(F.pad(xt, [p[1], p[3], p[0], p[2]]), wt, groups=c, stride=s)
    dy = rng.standard_normal(tuple(y.shape)).astype(dtype)
    y.backward(torch.tensor(dy))
    images_as_channels = np.ascontiguousarray(x.transpose(1, 0, 2, 3)).reshape(1, c * n, h, w_)
    grads_as_weights = np.ascontiguousarray(dy.transpose(1, 0, 2, 3))
    attrs = {"group": c, "pads": list(p), "dilations": list(s)}
    got = _ours("Conv", images_as_channels, grads_as_weights, attrs, threads)
    assert len(seen) == int(rows)
    want = wt.grad.numpy()
    got = got[:, :, :k[0], :k[1]]  # (the gradient graph drops the taps past a strided Conv's last window)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=tol, atol=tol * np.abs(want).max())


# x shape, W shape, attributes: im2col Convs whose columns pass conv.IM2COL_CHUNK_BYTES (made a few images at
# a time: by rows, or one image at a time where an image's columns alone fill a chunk)
IM2COL_CHUNKS = [
    ((64, 1, 28, 28), (6, 1, 5, 5), {"pads": [2, 2, 2, 2]}),  # LeNet's conv1, by rows
    ((9, 3, 20, 21), (8, 3, 3, 3), {"pads": [1, 0, 2, 1]}),  # by rows, uneven pads, a last short chunk
    ((3, 3, 70, 66), (8, 3, 7, 7), {"pads": [3] * 4, "strides": [2, 2]}),  # windows, an image a chunk
]


@pytest.mark.parametrize("case", IM2COL_CHUNKS, ids=str)
def test_im2col_in_chunks_of_images(case, monkeypatch) -> None:
    """Large im2col columns are made a few images at a time: the same products as all at once (each within
    rounding of torch's float64 Conv; not compared bit for bit, as the chunks' GEMMs have fewer columns, which
    OpenBLAS's kernels may tile and round otherwise), onnxruntime's values, and less memory at the peak."""
    import tracemalloc

    xs, ws, attrs = case
    x, w = _data(7, xs, ws)
    monkeypatch.setattr(conv_kernels, "IM2COL_CHUNK_BYTES", 16 << 10)
    calls = []
    real = conv_kernels._im2col_conv
    monkeypatch.setattr(conv_kernels, "_im2col_conv", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    tracemalloc.start()
    y = _ours("Conv", x, w, attrs)
    chunked_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert calls[0] == xs[0] and len(calls) > 1 and max(calls[1:]) < xs[0]  # the whole batch, then chunks
    monkeypatch.setattr(conv_kernels, "IM2COL_CHUNK_BYTES", 1 << 60)
    tracemalloc.start()
    whole = _ours("Conv", x, w, attrs)
    whole_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    want, scale = _torch_conv64(x, w, attrs)
    _within_rounding(y, want, scale)
    _within_rounding(whole, want, scale)
    assert chunked_peak < whole_peak
    _close(y, _ort("Conv", x, w, attrs))


# dY shape (N, C, ...), W shape (C, M, 1, ...), dtype, attributes, whether it goes pointwise: 1×1
# ConvTransposes (a pointwise Conv's input gradient), by one batched product over planes of more than
# conv.POINTWISE_MIN_PLANE positions
POINTWISE = [
    ((16, 144, 16, 16), (144, 24, 1, 1), np.float32, {}, True),  # MobileNetV2's projection
    ((3, 20, 7, 5), (20, 36, 1, 1), np.float32, {"dilations": [2, 3]}, True),  # dilation: no effect at 1×1
    ((2, 8, 3, 4, 5), (8, 6, 1, 1, 1), np.float64, {}, True),  # 3-D, float64
    ((16, 96, 4, 4), (96, 40, 1, 1), np.float32, {}, False),  # a small plane: the shifted GEMMs
    ((4, 16, 6, 6), (16, 8, 1, 1), np.float32, {"pads": [0, 0, 0, 0]}, True),
    # pads or a group keep the other routes
    ((4, 16, 6, 6), (16, 8, 1, 1), np.float32, {"pads": [1, 0, 1, 0]}, False),
    ((4, 16, 6, 6), (16, 4, 1, 1), np.float32, {"group": 2}, False),
]


@pytest.mark.parametrize("case", POINTWISE, ids=str)
def test_pointwise_conv_transpose_as_one_batched_product(case, monkeypatch) -> None:
    """The batched product runs only where it should (no other route is called), and gives torch's input
    gradient of the 1×1 Conv in float64 (and onnxruntime's values in float32)."""
    ys, ws, dtype, attrs, pointwise = case
    others = [_spy(monkeypatch, conv_kernels, name, small=False)
              for name in ("_shifted_conv", "_conv_transpose_flat", "_col2im_conv_transpose", "_im2col_conv")]
    rng = np.random.default_rng(8)
    dy, w = rng.standard_normal(ys).astype(dtype), rng.standard_normal(ws).astype(dtype)
    y = _ours("ConvTranspose", dy, w, attrs)
    assert (sum(map(len, others)) == 0) == pointwise
    group = attrs.get("group", 1)
    p = attrs.get("pads", [0] * (2 * (len(ys) - 2)))
    nd = len(ys) - 2
    x_shape = (ys[0], ws[1] * group) + tuple(ys[2 + i] - p[i] - p[nd + i] for i in range(nd))
    conv = {2: F.conv2d, 3: F.conv3d}[nd]
    xt = torch.zeros(x_shape, dtype=torch.float64, requires_grad=True)
    pad = [v for i in reversed(range(nd)) for v in (p[i], p[nd + i])]
    out = conv(F.pad(xt, pad), torch.tensor(w.astype(np.float64)), dilation=attrs.get("dilations", 1),
               groups=group)
    (want,) = torch.autograd.grad(out, xt, torch.tensor(dy.astype(np.float64)))
    assert y.shape == x_shape and y.dtype == dtype
    np.testing.assert_allclose(y, want.numpy(), rtol=1e-5 if dtype == np.float32 else 1e-12,
                               atol=1e-5 if dtype == np.float32 else 1e-12)
    if dtype == np.float32:
        _close(y, _ort("ConvTranspose", dy, w, attrs))


def _input_grad64(x_shape: tuple[int, ...], w: np.ndarray, dy: np.ndarray, p: list[int], dil: list[int],
                  op: list[int]) -> np.ndarray:
    """torch's float64 input gradient of a stride-1 2-D Conv (ONNX pads ``p``) for output gradient ``dy``,
    extended by the output padding ``op`` (rows no window reaches)."""
    xt = torch.zeros(x_shape, dtype=torch.float64, requires_grad=True)
    out = F.conv2d(F.pad(xt, [p[1], p[3], p[0], p[2]]), torch.tensor(w, dtype=torch.float64), dilation=dil)
    dyt = F.pad(torch.tensor(dy, dtype=torch.float64), [0, op[1], 0, op[0]])
    return torch.autograd.grad(out, xt, dyt)[0].numpy()


# stride-1 2-D ConvTransposes by col2im over flattened rows (``_conv_transpose_flat``): with few input
# channels each image of X laid on its canvas's positions (one add per kernel offset for every image),
# otherwise per image; (dY shape, W shape, attributes)
FLAT = [
    ((64, 16, 10, 10), (16, 6, 5, 5), {}),  # LeNet's conv2 input gradient
    ((3, 8, 7, 9), (8, 5, 3, 4), {"pads": [1, 0, 2, 1]}),
    ((2, 12, 6, 8), (12, 3, 3, 5), {"dilations": [2, 1], "pads": [1, 2, 0, 1]}),
    ((2, 6, 5, 4), (6, 4, 2, 3), {"dilations": [2, 2], "output_padding": [1, 0]}),
    ((2, 40, 5, 6), (40, 6, 5, 5), {"pads": [2, 1, 2, 1]}),  # more channels: per image
]


@pytest.mark.parametrize("case", FLAT, ids=str)
def test_flat_conv_transpose_layouts(case, monkeypatch) -> None:
    """Both layouts of the flattened-rows col2im give torch's input gradient of the Conv in float64, and in
    float32 each is within rounding of it (:func:`_within_rounding`). The layouts make the same products and
    adds in the same order (zeros added past an image's canvas change nothing), but not the same bits on
    every BLAS: their GEMMs have other column counts (and past FLAT_WEIGHT_VIEW_MAX_COLUMNS other row orders),
    which OpenBLAS's Haswell/Zen kernel tiles and rounds otherwise (0-39 % of the outputs differ, by up to
    1.1 epsilons of their terms' magnitude; each layout within 1.4 of torch)."""
    ys, ws, attrs = case
    seen = _spy(monkeypatch, conv_kernels, "_conv_transpose_flat", small=False)
    rng = np.random.default_rng(11)
    dy, w = rng.standard_normal(ys), rng.standard_normal(ws)
    y64 = _ours("ConvTranspose", dy, w, attrs)
    assert len(seen) == 1
    p = attrs.get("pads", [0, 0, 0, 0])
    op = attrs.get("output_padding", [0, 0])
    dil = attrs.get("dilations", [1, 1])
    x_shape = (ys[0], ws[1]) + tuple(ys[2 + i] + (ws[2 + i] - 1) * dil[i] - p[i] - p[2 + i] + op[i]
                                     for i in range(2))
    # output_padding: rows and columns past dY that no window reaches, whose gradients are zero
    assert y64.shape == x_shape
    np.testing.assert_allclose(y64, _input_grad64(x_shape, w, dy, p, dil, op), rtol=1e-12, atol=1e-12)
    d32, w32 = dy.astype(np.float32), w.astype(np.float32)
    # the float32 inputs' float64 gradient, and that of their magnitudes: each output's sum of |terms|
    want, scale = (_input_grad64(x_shape, f(w32), f(d32), p, dil, op) for f in (np.asarray, np.abs))
    layouts = []
    for cap in (0, 1 << 10):  # every image per image, then every one on its canvas's positions
        monkeypatch.setattr(conv_kernels, "PITCHED_MAX_CHANNELS", cap)
        layouts.append(_ours("ConvTranspose", d32, w32, attrs))
        _within_rounding(layouts[-1], want, scale)
    if not any(op):  # (onnxruntime refuses an output_padding not under the stride)
        _close(layouts[1], _ort("ConvTranspose", d32, w32, attrs))


# stride-1 ConvTransposes too wide for the shifted GEMMs (input × output channels past 4,096), group 1: as the
# flipped Conv's im2col where there are no more input than output channels, 256 or more output positions over
# the batch, and at most 64 an image or 2,048 column rows (conv.py ``FLIPPED_IM2COL_MAX_ROWS``); else by
# flattened rows. (X shape, W shape, attributes, im2col)
FLIPPED = [
    ((8, 72, 8, 8), (72, 72, 3, 3), {"pads": [1, 1, 1, 1]}, True),
    ((4, 64, 10, 12), (64, 96, 3, 5), {"pads": [1, 2, 0, 3], "dilations": [1, 2]}, True),  # 160 an image
    ((3, 66, 7, 9), (66, 70, 3, 3), {"dilations": [2, 2], "output_padding": [1, 0]}, True),
    ((8, 96, 8, 8), (96, 64, 3, 3), {"pads": [1, 1, 1, 1]}, False),  # more input channels
    ((1, 80, 8, 8), (80, 80, 3, 3), {"pads": [1, 1, 1, 1]}, False),  # 64 positions: W's flip costs more
    ((2, 96, 16, 16), (96, 96, 5, 5), {"pads": [2, 2, 2, 2]}, False),  # 2,400 column rows over 256 positions
]


@pytest.mark.parametrize("case", FLIPPED, ids=str)
def test_wide_conv_transpose_as_flipped_im2col(case, monkeypatch) -> None:
    """The im2col of the flipped Conv runs where it should (the flattened rows elsewhere), decided once per
    shape; torch's transposed convolution in float64, onnxruntime's in float32, and float32 within rounding of
    the flattened rows' result."""
    xs, ws, attrs, flipped = case
    attrs = {"dilations": [1, 1], **attrs}
    decided = []
    pays = conv_kernels._flipped_im2col_pays
    monkeypatch.setattr(conv_kernels, "_flipped_im2col_pays", lambda x, cg: decided.append(1) or pays(x, cg))
    im2col = _spy(monkeypatch, conv_kernels, "_im2col_conv", small=False)
    flat = _spy(monkeypatch, conv_kernels, "_conv_transpose_flat", small=False)
    rng = np.random.default_rng(12)
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    node = Attrs(dict(attrs), op="ConvTranspose")
    for _ in range(2):  # the same node twice: one decision
        y64 = conv_kernels.conv_transpose([x, w], node)[0]
    assert len(decided) == 1
    assert bool(im2col) == flipped and len(flat) == (0 if flipped else 2)  # (im2col may go in chunks)
    np.testing.assert_allclose(y64, _torch_conv_transpose(x, w, attrs), rtol=1e-12, atol=1e-12)
    x32, w32 = x.astype(np.float32), w.astype(np.float32)
    y32 = _ours("ConvTranspose", x32, w32, attrs)
    if not any(attrs.get("output_padding", [])):  # (onnxruntime refuses an output_padding under the dilation)
        _close(y32, _ort("ConvTranspose", x32, w32, attrs))
    monkeypatch.setattr(conv_kernels, "FLIPPED_IM2COL_MIN_COLUMNS", 1 << 40)  # the flattened rows always
    _close(y32, _ours("ConvTranspose", x32, w32, attrs))


def _torch_conv_transpose(x: np.ndarray, w: np.ndarray, attrs: dict[str, Any]) -> np.ndarray:
    """torch's float64 transposed convolution of ``x`` by ``w`` (stride 1), cropped by the ONNX pads and
    extended by the output_padding (rows no input reaches: zeros)."""
    full = F.conv_transpose2d(torch.tensor(x), torch.tensor(w), dilation=attrs["dilations"]).numpy()
    p = attrs.get("pads", [0, 0, 0, 0])
    op = attrs.get("output_padding", [0, 0])
    full = np.pad(full, [(0, 0), (0, 0), (0, op[0]), (0, op[1])])
    return full[:, :, p[0]:full.shape[2] - p[2], p[1]:full.shape[3] - p[3]]
