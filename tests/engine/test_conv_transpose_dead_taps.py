"""Convolutions with kernel offsets that read only padding: a dilation wider than X, as DeepLabV3's ASPP
(3×3 at dilations 12, 24, 36, padded by the dilation, over 4² planes: only the centre reads X). The
ConvTranspose (the input gradient: engine/kernels/conv.py's ``_live_taps``), the Conv (``_conv_live_part``,
which also drops outputs that read only padding) and the fused weight gradient (fusion/gemm.py's
``_live_taps_grad``) compute only the rest. Checked against torch (float64 convolutions and transposed
convolutions cropped to the ONNX output by pads computed here, autograd for the gradient graphs),
onnxruntime for a one-node model, and the routes' arguments against the live part."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine import compile_model
from onnxtrain.engine.kernels import conv as conv_kernels
from onnxtrain.engine.registry import Attrs
from onnxtrain.testing import random_loss_model

torch = pytest.importorskip("torch")
F = torch.nn.functional

# name: (X shape, W shape, attributes)
CASES: dict[str, tuple[tuple[int, ...], tuple[int, ...], dict[str, Any]]] = {
    # ASPP's input gradients, fewer channels: only the centre tap reaches the output
    "aspp-d12": ((2, 16, 4, 4), (16, 24, 3, 3), {"dilations": [12, 12], "pads": [12] * 4}),
    "aspp-d24-batch-1": ((1, 16, 4, 4), (16, 24, 3, 3), {"dilations": [24, 24], "pads": [24] * 4}),
    "aspp-d36": ((2, 16, 4, 4), (16, 24, 3, 3), {"dilations": [36, 36], "pads": [36] * 4}),
    "aspp-d36-wide": ((2, 40, 4, 4), (40, 48, 3, 3), {"dilations": [36, 36], "pads": [36] * 4}),
    # taps partly in the padding (every tap reaches some output): nothing to crop
    "partly-d3": ((2, 16, 4, 4), (16, 8, 3, 3), {"dilations": [3, 3], "pads": [3] * 4}),
    "partly-d5-asymmetric": ((2, 8, 4, 5), (8, 6, 3, 3), {"dilations": [5, 5], "pads": [2, 4, 3, 1]}),
    # one axis cropped, the other whole
    "rows-only": ((2, 8, 4, 6), (8, 6, 3, 3), {"dilations": [12, 1], "pads": [12, 1, 12, 1]}),
    # first tap dead with pads below the dilation: the cropped node's begin pads are negative (output rows
    # before X's first product are zeros)
    "negative-begin": ((2, 8, 4, 4), (8, 5, 3, 3), {"dilations": [8, 8], "pads": [5, 5, 5, 5]}),
    "last-taps-dead": ((2, 8, 4, 4), (8, 5, 4, 4), {"dilations": [6, 6], "pads": [0, 0, 12, 12]}),
    "grouped": ((2, 8, 4, 4), (8, 3, 3, 3), {"dilations": [12, 12], "pads": [12] * 4, "group": 2}),
    "depthwise": ((2, 8, 4, 4), (8, 1, 3, 3), {"dilations": [12, 12], "pads": [12] * 4, "group": 8}),
    "strided": ((2, 8, 3, 3), (8, 16, 3, 3), {"strides": [2, 2], "dilations": [12, 12], "pads": [12] * 4}),
    "strided-output-padding": ((2, 8, 3, 3), (8, 16, 3, 3), {"strides": [2, 2], "dilations": [12, 12],
                                                             "pads": [12] * 4, "output_padding": [1, 1]}),
    "1d": ((2, 8, 4), (8, 12, 3), {"dilations": [12], "pads": [12, 12]}),
    "3d": ((1, 4, 2, 3, 3), (4, 6, 3, 3, 3), {"dilations": [1, 9, 9], "pads": [1, 9, 9, 1, 9, 9]}),
}


def _out_and_begin(xs: tuple[int, ...], ws: tuple[int, ...],
                   attrs: dict[str, Any]) -> tuple[list[int], list[int]]:
    """The ONNX output size and begin pads of an explicitly padded ConvTranspose (the spec's formula)."""
    nd = len(xs) - 2
    s = attrs.get("strides", [1] * nd)
    d = attrs.get("dilations", [1] * nd)
    op = attrs.get("output_padding", [0] * nd)
    p = attrs.get("pads", [0] * 2 * nd)
    out = [s[i] * (xs[2 + i] - 1) + op[i] + (ws[2 + i] - 1) * d[i] + 1 - p[i] - p[nd + i] for i in range(nd)]
    return out, list(p[:nd])


def _oracle(x: np.ndarray, w: np.ndarray, attrs: dict[str, Any]) -> np.ndarray:
    """torch's full transposed convolution in float64, cropped (or zero-extended) to the ONNX output."""
    nd = x.ndim - 2
    out, begin = _out_and_begin(x.shape, w.shape, attrs)
    group = attrs.get("group", 1)
    fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nd - 1]
    full = fn(torch.tensor(x, dtype=torch.float64), torch.tensor(w, dtype=torch.float64),
              stride=attrs.get("strides", [1] * nd), dilation=attrs["dilations"], groups=group).numpy()
    y = np.zeros((x.shape[0], w.shape[1] * group, *out))
    dst, src = [], []
    for o, b, f in zip(out, begin, full.shape[2:], strict=True):
        lo, hi = max(0, -b), min(o, f - b)
        dst.append(slice(lo, max(lo, hi)))
        src.append(slice(lo + b, max(lo, hi) + b))
    y[(slice(None), slice(None), *dst)] = full[(slice(None), slice(None), *src)]
    return y


@pytest.mark.parametrize("case", list(CASES))
def test_float64_matches_torch(case: str) -> None:
    xs, ws, attrs = CASES[case]
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    got = conv_kernels.conv_transpose([x, w], Attrs(dict(attrs)))[0]
    want = _oracle(x, w, attrs)
    assert got.shape == want.shape and got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", list(CASES))
def test_float32_equals_the_uncropped_col2im(case: str) -> None:
    """float32: within a few float32 roundings of torch's float64 values, and equal to col2im's result (every
    offset multiplied, the dead ones' products dropped) within float32 rounding."""
    xs, ws, attrs = CASES[case]
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal(xs, dtype=np.float32), rng.standard_normal(ws, dtype=np.float32)
    a = Attrs(dict(attrs))
    got = conv_kernels.conv_transpose([x, w], a)[0]
    g = a.cache[(xs, ws)]
    full = conv_kernels._col2im_conv_transpose(x, w, g)
    want = _oracle(x.astype(np.float64), w.astype(np.float64), attrs)
    scale = float(np.abs(want).max())
    taps = xs[1] // attrs.get("group", 1) * int(np.prod(ws[2:]))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=taps * 2e-7 * scale)
    np.testing.assert_allclose(got, full, rtol=0, atol=taps * 2e-7 * scale)


LIVE = {  # case: the W index the cropped ConvTranspose runs with (None: nothing cropped)
    "aspp-d12": (slice(1, 2), slice(1, 2)), "aspp-d36": (slice(1, 2), slice(1, 2)),
    "rows-only": (slice(1, 2), slice(0, 3)), "negative-begin": (slice(1, 2), slice(1, 2)),
    "last-taps-dead": (slice(0, 2), slice(0, 2)), "strided": (slice(1, 2), slice(1, 2)),
    "3d": (slice(0, 3), slice(1, 2), slice(1, 2)), "partly-d3": None, "partly-d5-asymmetric": None,
}


@pytest.mark.parametrize("case", list(LIVE))
def test_routes_see_only_the_live_taps(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel offsets whose products all fall in the pads are never multiplied: the routes get W
    without them (ASPP's 3×3 at dilation 36 on a 4² plane runs as a 1×1)."""
    xs, ws, attrs = CASES[case]
    seen: list[tuple[int, ...]] = []
    for name in ("_conv_transpose_as_conv", "_conv_transpose_flat", "_col2im_conv_transpose"):
        real = getattr(conv_kernels, name)

        def spy(x, w, *rest, _real=real):  # noqa: ANN001, ANN202 - a pass-through
            seen.append(w.shape)
            return _real(x, w, *rest)
        monkeypatch.setattr(conv_kernels, name, spy)
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal(xs, dtype=np.float32), rng.standard_normal(ws, dtype=np.float32)
    conv_kernels.conv_transpose([x, w], Attrs(dict(attrs)))
    want = ws if LIVE[case] is None else ws[:2] + tuple(s.stop - s.start for s in LIVE[case])
    assert seen and all(s == want for s in seen), (seen, want)


def test_non_finite_weights_in_dead_taps_reach_nothing() -> None:
    """An inf or NaN on an offset that reaches no output leaves the output finite, as col2im's (which never
    forms those products); one on the live centre spreads as torch's does."""
    xs, ws, attrs = CASES["aspp-d12"]
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal(xs, dtype=np.float32), rng.standard_normal(ws, dtype=np.float32)
    w[:, :, 0, 0] = np.inf
    w[:, :, 2, 1] = np.nan
    got = conv_kernels.conv_transpose([x, w], Attrs(dict(attrs)))[0]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, _oracle(x.astype(np.float64), w.astype(np.float64), attrs), atol=1e-4)
    w[3, 5, 1, 1] = np.inf
    got = conv_kernels.conv_transpose([x, w], Attrs(dict(attrs)))[0]
    assert not np.isfinite(got[:, 5]).any() and np.isfinite(np.delete(got, 5, axis=1)).all()


# Convs (X shape, W shape, attributes) with kernel offsets or outputs that read only padding
CONVS: dict[str, tuple[tuple[int, ...], tuple[int, ...], dict[str, Any]]] = {
    "aspp-d12": ((2, 24, 4, 4), (16, 24, 3, 3), {"dilations": [12, 12], "pads": [12] * 4}),
    "aspp-d36-batch-1": ((1, 24, 4, 4), (16, 24, 3, 3), {"dilations": [36, 36], "pads": [36] * 4}),
    # a weight gradient's shape (the forward's dilation as stride): only the centre output reads X
    "dead-outputs": ((6, 2, 4, 4), (5, 2, 4, 4), {"strides": [12, 12], "pads": [12] * 4}),
    "pads-past-the-kernel": ((2, 16, 8, 8), (16, 16, 3, 3), {"pads": [3, 1, 3, 1]}),
    # the first offset dead, pads below the dilation: X's first rows are never read
    "unread-first-rows": ((2, 4, 8, 8), (3, 4, 3, 3), {"dilations": [10, 10], "pads": [7, 7, 11, 11]}),
    "grouped": ((2, 8, 4, 4), (6, 4, 3, 3), {"dilations": [24, 24], "pads": [24] * 4, "group": 2}),
    "depthwise": ((2, 8, 4, 4), (8, 1, 3, 3), {"dilations": [12, 12], "pads": [12] * 4, "group": 8}),
    "strided": ((2, 8, 9, 9), (4, 8, 3, 3), {"strides": [2, 2], "dilations": [12, 12], "pads": [12] * 4}),
    "rows-only": ((2, 8, 4, 6), (4, 8, 3, 3), {"dilations": [12, 1], "pads": [12, 1, 12, 1]}),
    "1d": ((2, 8, 5), (4, 8, 3), {"dilations": [12], "pads": [12, 12]}),
    "3d": ((1, 4, 2, 3, 3), (6, 4, 3, 3, 3), {"dilations": [1, 9, 9], "pads": [1, 9, 9, 1, 9, 9]}),
    "partly-d3": ((2, 8, 5, 4), (8, 8, 3, 3), {"dilations": [3, 3], "pads": [3] * 4}),  # nothing to crop
}


def _torch_conv(x: Any, w: Any, attrs: dict[str, Any]) -> Any:
    """torch's Conv of the ONNX attributes (explicit pads by F.pad)."""
    nd = x.ndim - 2
    p = attrs.get("pads", [0] * 2 * nd)
    fn = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
    pads = [v for i in reversed(range(nd)) for v in (p[i], p[nd + i])]
    return fn(F.pad(x, pads), w, stride=attrs.get("strides", 1), dilation=attrs.get("dilations", 1),
              groups=attrs.get("group", 1))


@pytest.mark.parametrize("case", list(CONVS))
def test_conv_matches_torch(case: str) -> None:
    """float64 against torch; float32 against the routes on the whole W within float32 rounding."""
    xs, ws, attrs = CONVS[case]
    rng = np.random.default_rng(8)
    x, w, b = rng.standard_normal(xs), rng.standard_normal(ws), rng.standard_normal(ws[0])
    got = conv_kernels.conv([x, w, b], Attrs(dict(attrs)))[0]
    want = _torch_conv(torch.tensor(x), torch.tensor(w), attrs).numpy()
    want += b.reshape((-1,) + (1,) * (len(xs) - 2))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    x32, w32 = x.astype(np.float32), w.astype(np.float32)
    a = Attrs(dict(attrs))
    got32 = conv_kernels.conv([x32, w32], a)[0]
    whole = conv_kernels._conv_gemms(x32, w32, a.cache[(xs, ws)])
    scale = float(np.abs(whole).max()) * xs[1] * int(np.prod(ws[2:])) * 2e-7
    np.testing.assert_allclose(got32, whole, rtol=0, atol=scale)


CONV_LIVE = {  # case: (X shape, W shape) the smaller Conv runs with (None: nothing cropped)
    "aspp-d12": ((2, 24, 4, 4), (16, 24, 1, 1)), "dead-outputs": ((6, 2, 4, 4), (5, 2, 4, 4)),
    "unread-first-rows": ((2, 4, 5, 5), (3, 4, 1, 1)), "strided": ((2, 8, 9, 9), (4, 8, 1, 1)),
    "rows-only": ((2, 8, 4, 6), (4, 8, 1, 3)), "partly-d3": None,
}


@pytest.mark.parametrize("case", list(CONV_LIVE))
def test_conv_routes_see_only_what_reads_x(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    xs, ws, attrs = CONVS[case]
    seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    real = conv_kernels._conv_gemms

    def spy(x, w, g):  # noqa: ANN001, ANN202 - a pass-through
        seen.append((x.shape, w.shape))
        return real(x, w, g)
    monkeypatch.setattr(conv_kernels, "_conv_gemms", spy)
    rng = np.random.default_rng(9)
    conv_kernels.conv([rng.standard_normal(xs, dtype=np.float32), rng.standard_normal(ws, dtype=np.float32)],
                      Attrs(dict(attrs)))
    assert seen == [CONV_LIVE[case] or (xs, ws)]


def test_layout_of_rows_longer_than_their_pitch_is_refused() -> None:
    """The shifted GEMMs' shared padding refuses output rows longer than a row's pitch (pads past the kernel
    on both sides; such a Conv now reaches it only through its cropped part, which fits)."""
    g = conv_kernels.conv_geometry(Attrs({"pads": [3, 1, 3, 1]}), (2, 16, 8, 8), (16, 16, 3, 3))
    assert conv_kernels._shared_pads([8, 8], g) is None
    sub = g["crop"]["attrs"]
    assert sub["pads"] == [2, 1, 2, 1] and g["crop"]["keep"] == [10, 8]


# Conv gradient graphs (X shape, W shape, attributes): dX is such a ConvTranspose, dW (group 1) the fused
# weight gradient (fusion/gemm.py) over the offsets that read X
CONV_GRAD = {
    "aspp-d12": ((2, 24, 4, 4), (16, 24, 3, 3), {"dilations": [12, 12], "pads": [12] * 4}),
    "aspp-d36-batch-1": ((1, 24, 4, 4), (16, 24, 3, 3), {"dilations": [36, 36], "pads": [36] * 4}),
    "grouped-d24": ((2, 8, 4, 4), (6, 4, 3, 3), {"dilations": [24, 24], "pads": [24] * 4, "group": 2}),
    "partly-d3": ((2, 8, 5, 4), (8, 8, 3, 3), {"dilations": [3, 3], "pads": [3] * 4}),
    "unread-first-rows": CONVS["unread-first-rows"],
    "strided": CONVS["strided"],
    "rows-only": CONVS["rows-only"],
    "1d": CONVS["1d"],
    "3d": CONVS["3d"],
}


@pytest.mark.parametrize("case", list(CONV_GRAD))
def test_conv_gradients_vs_torch_autograd(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gradient graph of such a Conv against torch autograd in float64."""
    from onnxtrain.engine.fusion import gemm

    xs, ws, attrs = CONV_GRAD[case]
    fused: list[int] = []
    real = gemm._live_taps_grad

    def spy(*args):  # noqa: ANN002, ANN202 - a pass-through
        fused.append(1)
        return real(*args)
    monkeypatch.setattr(gemm, "_live_taps_grad", spy)
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    node = helper.make_node("Conv", ["x", "w"], ["y"], **attrs)
    graph = helper.make_graph([node], "c", [helper.make_tensor_value_info("x", 11, xs),
                                            helper.make_tensor_value_info("w", 11, ws)],
                              [helper.make_empty_tensor_value_info("y")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    y = _torch_conv(tx, tw, attrs)
    lmodel = random_loss_model(model, [tuple(y.shape)], [0], dtype=np.float64)
    u = numpy_helper.to_array(next(t for t in lmodel.graph.initializer if t.name == "u0"))
    gmodel = build_gradient_model(lmodel, "loss", ["x", "w"])
    assert any(n.op_type == "ConvTranspose" for n in gmodel.graph.node)
    outs = dict(zip([o.name for o in gmodel.graph.output], compile_model(gmodel).run({"x": x, "w": w}),
                    strict=True))
    (y * torch.tensor(u)).sum().backward()
    np.testing.assert_allclose(outs["x_grad"], tx.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(outs["w_grad"], tw.grad.numpy(), rtol=1e-10, atol=1e-12)
    assert bool(fused) == (attrs.get("group", 1) == 1)


def test_one_node_model_with_bias_matches_onnxruntime() -> None:
    ort = pytest.importorskip("onnxruntime")
    xs, ws = (2, 64, 4, 4), (64, 96, 3, 3)
    attrs = {"dilations": [36, 36], "pads": [36] * 4}
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], **attrs)
    graph = helper.make_graph([node], "ct", [helper.make_tensor_value_info("x", 1, xs),
                                             helper.make_tensor_value_info("w", 1, ws),
                                             helper.make_tensor_value_info("b", 1, [96])],
                              [helper.make_tensor_value_info("y", 1, [2, 96, 4, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    rng = np.random.default_rng(6)
    feeds = {"x": rng.standard_normal(xs, dtype=np.float32), "w": rng.standard_normal(ws, dtype=np.float32),
             "b": rng.standard_normal(96, dtype=np.float32)}
    got = compile_model(model).run(feeds)[0]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, feeds)[0]
    assert got.shape == want.shape == (2, 96, 4, 4)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


# stride-1 ConvTransposes by flattened rows (``_conv_transpose_flat``) on small planes with many channels
# (the ASPP head's 3×3 at 4²): its GEMM reads Wᵀ as a view up to FLAT_WEIGHT_VIEW_MAX_COLUMNS columns, else
# W copied
FLAT = {
    "head-3x3": ((2, 40, 4, 4), (40, 120, 3, 3), {"pads": [1] * 4}),
    "dilated-2": ((2, 40, 4, 4), (40, 120, 3, 3), {"dilations": [2, 2], "pads": [2] * 4}),
    "batch-1-asymmetric": ((1, 36, 5, 3), (36, 120, 3, 2), {"pads": [1, 0, 2, 1]}),
    "pitched": ((4, 16, 6, 6), (16, 6, 5, 5), {}),  # few channels: each image on its canvas's positions
}


@pytest.mark.parametrize("case", list(FLAT))
def test_flat_weight_layouts_match_torch(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both layouts of W give torch's float64 values, and agree in float32 within its rounding."""
    xs, ws, attrs = FLAT[case]
    seen: list[int] = []
    real = conv_kernels._conv_transpose_flat

    def spy(x, w, g):  # noqa: ANN001, ANN202 - a pass-through
        seen.append(1)
        return real(x, w, g)
    monkeypatch.setattr(conv_kernels, "_conv_transpose_flat", spy)
    rng = np.random.default_rng(7)
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    want = _oracle(x, w, {"dilations": [1, 1], **attrs})
    x32, w32 = x.astype(np.float32), w.astype(np.float32)
    got32 = []
    for cap in (0, 1 << 30):  # W copied, then W as a view
        monkeypatch.setattr(conv_kernels, "FLAT_WEIGHT_VIEW_MAX_COLUMNS", cap)
        got = conv_kernels.conv_transpose([x, w], Attrs(dict(attrs)))[0]
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        got32.append(conv_kernels.conv_transpose([x32, w32], Attrs(dict(attrs)))[0])
    assert len(seen) == 4
    scale = float(np.abs(want).max()) * xs[1] * int(np.prod(ws[2:])) * 2e-7
    np.testing.assert_allclose(got32[0], got32[1], rtol=0, atol=scale)
    np.testing.assert_allclose(got32[1], want, rtol=0, atol=scale)
