"""Conv, pooling and Resize kernels on cases the op table cannot check against onnx.reference.

onnx.reference mishandles grouped ConvTranspose (bias and M/group > 1), has no GlobalLpPool, reduces
GlobalMaxPool over two axes only and computes cubic weights in float32; torch and onnxruntime are the
oracles here. Random geometries (strides, pads, dilations, groups, ceil_mode) are drawn with a fixed
seed.
"""

from __future__ import annotations

import warnings
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
    elem = helper.np_dtype_to_tensor_dtype(inputs[0].dtype)
    g_out = [helper.make_tensor_value_info(n, elem if i == 0 else onnx.TensorProto.INT64, None)
             for i, n in enumerate(outs)]
    graph = helper.make_graph([helper.make_node(op, names, outs, **attrs)], op, g_in, g_out)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _ours(op: str, inputs: list[Any], opset: int = 17, n_outputs: int = 1, **attrs: Any) -> list[np.ndarray]:
    feeds = {f"x{i}": v for i, v in enumerate(inputs) if v is not None}
    return compile_model(_model(op, inputs, opset, n_outputs, **attrs)).run(feeds)


def _ort(op: str, inputs: list[Any], opset: int = 17, n_outputs: int = 1, **attrs: Any) -> list[np.ndarray]:
    ort = pytest.importorskip("onnxruntime")
    model = _model(op, inputs, opset, n_outputs, **attrs)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {f"x{i}": v for i, v in enumerate(inputs) if v is not None})


def _conv_geometries(seed: int, n: int):
    rng = np.random.default_rng(seed)
    for t in range(n):
        nd = 1 + t % 3
        g = int(rng.choice([1, 2, 3]))
        cg = 1 if t % 4 == 0 else int(rng.integers(1, 3))
        mg = int(rng.integers(1, 3))
        yield (rng, nd, g, cg, mg, [int(rng.integers(1, 4)) for _ in range(nd)],
               [int(rng.integers(1, 3)) for _ in range(nd)], [int(rng.integers(1, 3)) for _ in range(nd)],
               [int(rng.integers(0, 3)) for _ in range(nd)], [int(rng.integers(5, 8)) for _ in range(nd)])


@pytest.mark.parametrize("seed", range(4))
def test_conv_and_conv_transpose_match_torch(seed: int) -> None:
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    for rng, nd, g, cg, mg, k, s, d, p, sp in _conv_geometries(seed, 9):
        x = rng.standard_normal([2, cg * g] + sp)
        w = rng.standard_normal([mg * g, cg] + k)
        b = rng.standard_normal(mg * g)
        attrs = {"group": g, "strides": s, "dilations": d, "pads": p + p}
        (y,) = _ours("Conv", [x, w, b], **attrs)
        conv = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
        ref = conv(torch.tensor(x), torch.tensor(w), torch.tensor(b), stride=s, padding=p, dilation=d,
                   groups=g)
        np.testing.assert_allclose(y, ref.numpy(), rtol=1e-9, atol=1e-9, err_msg=str(attrs))
        wt = rng.standard_normal([cg * g, mg] + k)
        op = [int(rng.integers(0, max(s[i], d[i]))) for i in range(nd)]
        (y,) = _ours("ConvTranspose", [x, wt, b], output_padding=op, **attrs)
        convt = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nd - 1]
        ref = convt(torch.tensor(x), torch.tensor(wt), torch.tensor(b), stride=s, padding=p, dilation=d,
                    groups=g, output_padding=op)
        np.testing.assert_allclose(y, ref.numpy(), rtol=1e-9, atol=1e-9, err_msg=f"T {attrs} {op}")


def test_conv_float32_lenet_shapes_match_onnxruntime() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 12, 12)).astype(np.float32)
    w = rng.standard_normal((5, 3, 5, 5)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    for attrs in ({"pads": [2, 2, 2, 2]}, {"strides": [2, 2]}, {"auto_pad": "SAME_LOWER", "strides": [2, 3]}):
        (a,) = _ours("Conv", [x, w, b], **attrs)
        (r,) = _ort("Conv", [x, w, b], **attrs)
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-4)


def test_conv_does_not_mutate_inputs() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 2, 5, 5))
    w = rng.standard_normal((2, 1, 3, 3))
    b = rng.standard_normal(2)
    keep = [v.copy() for v in (x, w, b)]
    _ours("Conv", [x, w, b], group=2, pads=[1, 1, 1, 1])
    _ours("ConvTranspose", [x, w.reshape(2, 1, 3, 3), b], group=2, strides=[2, 2])
    for v, k in zip((x, w, b), keep, strict=True):
        np.testing.assert_array_equal(v, k)


@pytest.mark.parametrize("seed", range(3))
def test_pools_match_torch(seed: int) -> None:
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(seed)
    for t in range(12):
        nd = 1 + t % 3
        k = [int(rng.integers(1, 4)) for _ in range(nd)]
        s = [int(rng.integers(1, 4)) for _ in range(nd)]
        d = [int(rng.integers(1, 3)) for _ in range(nd)]
        p = [int(rng.integers(0, k[i] // 2 + 1)) for i in range(nd)]
        cm = int(rng.integers(0, 2))
        x = rng.standard_normal([2, 3] + [int(rng.integers(5, 9)) for _ in range(nd)])
        attrs = {"kernel_shape": k, "strides": s, "pads": p + p, "ceil_mode": cm}
        y, idx = _ours("MaxPool", [x], n_outputs=2, dilations=d, **attrs)
        pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[nd - 1]
        ry, ri = pool(torch.tensor(x), k, s, p, d, ceil_mode=bool(cm), return_indices=True)
        # torch's indices are per (n, c) plane; ONNX's run over N*C*spatial
        plane = int(np.prod(x.shape[2:]))
        ri = ri.numpy() + (np.arange(6) * plane).reshape((2, 3) + (1,) * nd)
        np.testing.assert_array_equal(y, ry.numpy(), err_msg=str(attrs))
        np.testing.assert_array_equal(idx, ri, err_msg=str(attrs))
        for cip in (0, 1):
            (y,) = _ours("AveragePool", [x], count_include_pad=cip, **attrs)
            avg = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[nd - 1]
            ref = avg(torch.tensor(x), k, s, p, ceil_mode=bool(cm), count_include_pad=bool(cip))
            np.testing.assert_allclose(y, ref.numpy(), rtol=1e-12, err_msg=f"{attrs} {cip}")


def test_maxpool_indices_column_major() -> None:
    x = np.random.default_rng(2).standard_normal((2, 3, 5, 4))
    _, row = _ours("MaxPool", [x], n_outputs=2, kernel_shape=[2, 2])
    _, col = _ours("MaxPool", [x], n_outputs=2, kernel_shape=[2, 2], storage_order=1)
    nc, rest = np.divmod(row, 20)
    h, w = np.divmod(rest, 4)
    np.testing.assert_array_equal(col, nc * 20 + h + w * 5)


def test_maxpool_integer_input_with_padding() -> None:
    x = np.random.default_rng(3).integers(0, 255, (1, 2, 5, 5)).astype(np.uint8)
    attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
    np.testing.assert_array_equal(_ours("MaxPool", [x], **attrs)[0], _ort("MaxPool", [x], **attrs)[0])


def test_maxpool_indices_of_windows_of_lowest_values_point_inside_the_input() -> None:
    """A padded window whose real values are all -inf (the padding's own value) or tie with it: the index
    is a real position, as onnxruntime's (it pointed into the padding: -3, -1 for a 2×2 input); random data
    with -inf patches and padding matches onnxruntime's values and indices."""
    attrs = {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 1, 1, 1]}
    x = np.full((1, 1, 2, 2), -np.inf, np.float32)
    _, idx = _ours("MaxPool", [x], n_outputs=2, **attrs)
    np.testing.assert_array_equal(idx, _ort("MaxPool", [x], n_outputs=2, **attrs)[1])
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 7, 6)).astype(np.float32)
    x[rng.random(x.shape) < 0.3] = -np.inf
    attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
    for a, b in zip(_ours("MaxPool", [x], n_outputs=2, **attrs), _ort("MaxPool", [x], n_outputs=2, **attrs)):
        np.testing.assert_array_equal(a, b)


def test_maxpool_window_with_a_nan_points_at_it_as_torch() -> None:
    """A window holding a NaN: its maximum is NaN and its index that of its last NaN, as torch's max_pool
    (the index stayed at the maximum before the NaN); the gradient goes to the NaN, as torch's. With
    padding too, a padded window of -inf still points inside (it was skipped when a NaN was present)."""
    torch = pytest.importorskip("torch")
    from onnxtrain.autodiff import build_gradient_model

    # windows: one NaN last, one NaN first, two NaNs (torch takes the last), none
    x = np.array([[[[1.0, 5.0, 2.0, 3.0, np.nan, 0.5, 1.0, 2.0], [np.nan, 4.0, 9.0, np.nan, 1.0, np.nan, 3.0,
                                                                  4.0]]]], np.float32)
    y, idx = _ours("MaxPool", [x], n_outputs=2, kernel_shape=[2, 2], strides=[2, 2])
    ty, tidx = torch.nn.functional.max_pool2d(torch.tensor(x), 2, 2, return_indices=True)
    np.testing.assert_array_equal(y, ty.numpy())
    np.testing.assert_array_equal(idx, tidx.numpy())
    nodes = [helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    f = onnx.TensorProto.FLOAT
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, [1, 1, 2, 8])],
                          [helper.make_tensor_value_info("loss", f, [])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    grads = build_gradient_model(model, "loss", ["x"])
    got = dict(zip([o.name for o in grads.graph.output], compile_model(grads).run({"x": x})))["x_grad"]
    t = torch.tensor(x, requires_grad=True)
    torch.nn.functional.max_pool2d(t, 2, 2).sum().backward()
    np.testing.assert_array_equal(got, t.grad.numpy())
    z = np.array([[[-np.inf, np.nan, 1.0, 2.0]]], np.float32)  # 1-D, pads 1: windows [pad, -inf], ...
    _, idx = _ours("MaxPool", [z], n_outputs=2, kernel_shape=[2], strides=[2], pads=[1, 1])
    _, tidx = torch.nn.functional.max_pool1d(torch.tensor(z), 2, 2, padding=1, return_indices=True)
    np.testing.assert_array_equal(idx, tidx.numpy())


@pytest.mark.parametrize("p", [1, 2, 3])
def test_lp_pools_match_onnxruntime(p: int) -> None:
    x = np.random.default_rng(4).standard_normal((2, 3, 6, 5)).astype(np.float32)
    np.testing.assert_allclose(_ours("GlobalLpPool", [x], p=p)[0], _ort("GlobalLpPool", [x], p=p)[0],
                               rtol=1e-5)
    attrs = {"kernel_shape": [3, 2], "strides": [2, 1], "p": p}
    np.testing.assert_allclose(_ours("LpPool", [x], **attrs)[0], _ort("LpPool", [x], **attrs)[0], rtol=1e-5)


def test_global_max_pool_3d() -> None:
    x = np.random.default_rng(5).standard_normal((2, 3, 2, 3, 4))
    (y,) = _ours("GlobalMaxPool", [x])
    np.testing.assert_array_equal(y, x.max(axis=(2, 3, 4), keepdims=True))


@pytest.mark.parametrize(("mode", "torch_mode", "ctm"), [
    ("nearest", "nearest", "asymmetric"),
    ("linear", "bilinear", "half_pixel"),
    ("linear", "bilinear", "align_corners"),
    ("cubic", "bicubic", "half_pixel"),
    ("cubic", "bicubic", "align_corners"),
])
@pytest.mark.parametrize("size", [(7, 5), (3, 2), (9, 13)])
def test_resize_matches_torch_interpolate(mode: str, torch_mode: str, ctm: str,
                                          size: tuple[int, int]) -> None:
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(6).standard_normal((2, 3, 4, 6))
    attrs: dict[str, Any] = {"mode": mode, "coordinate_transformation_mode": ctm}
    if mode == "nearest":
        attrs["nearest_mode"] = "floor"
    sizes = np.array([2, 3, *size], dtype=np.int64)
    (y,) = _ours("Resize", [x, None, None, sizes], opset=19, **attrs)
    kw = {} if mode == "nearest" else {"align_corners": ctm == "align_corners"}
    ref = torch.nn.functional.interpolate(torch.tensor(x), size=size, mode=torch_mode, **kw).numpy()
    np.testing.assert_allclose(y, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(("mode", "torch_mode"), [("linear", "bilinear"), ("cubic", "bicubic")])
def test_resize_antialias_matches_torch(mode: str, torch_mode: str) -> None:
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(7).standard_normal((1, 2, 12, 10))
    sizes = np.array([1, 2, 5, 3], dtype=np.int64)
    # torch's antialiased filters skip taps outside the image; its bicubic uses a = -0.5
    attrs = {"cubic_coeff_a": -0.5} if mode == "cubic" else {}
    (y,) = _ours("Resize", [x, None, None, sizes], opset=18, mode=mode, antialias=1,
                  exclude_outside=1, **attrs)
    ref = torch.nn.functional.interpolate(torch.tensor(x), size=(5, 3), mode=torch_mode, antialias=True)
    np.testing.assert_allclose(y, ref.numpy(), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("attrs", [
    {"mode": "linear", "antialias": 1},
    {"mode": "cubic", "antialias": 1},
    {"mode": "cubic", "coordinate_transformation_mode": "pytorch_half_pixel"},
    {"mode": "nearest", "axes": [-1, -2]},
    {"mode": "linear", "axes": [-2], "coordinate_transformation_mode": "half_pixel_symmetric"},
])
def test_resize_scales_match_onnxruntime(attrs: dict[str, Any]) -> None:
    x = np.random.default_rng(8).standard_normal((1, 2, 8, 9)).astype(np.float32)
    n_axes = len(attrs.get("axes", [0, 1, 2, 3]))
    scales = np.array([0.6, 0.45, 1, 1][:n_axes] if n_axes < 4 else [1, 1, 0.6, 0.45], dtype=np.float32)
    a = _ours("Resize", [x, None, scales], opset=19, **attrs)[0]
    b = _ort("Resize", [x, None, scales], opset=19, **attrs)[0]
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_resize_integer_image() -> None:
    x = np.random.default_rng(9).integers(0, 256, (1, 3, 4, 5)).astype(np.uint8)
    scales = np.array([1, 1, 2, 1.5], dtype=np.float32)
    for mode in ("nearest", "linear"):
        a = _ours("Resize", [x, None, scales], opset=19, mode=mode)[0]
        b = _ort("Resize", [x, None, scales], opset=19, mode=mode)[0]
        assert a.dtype == np.uint8
        assert np.abs(a.astype(int) - b.astype(int)).max() <= 1


def test_resize_align_corners_with_unrounded_scales_warns() -> None:
    """ONNX's test data (test_resize_downsample_scales_linear_align_corners) spaces align_corners positions by
    the unrounded scaled length, onnxruntime and torch by the output length: the engine follows ONNX and
    warns when the two differ, and is quiet when the scaled length is whole (they all agree then)."""
    x = np.arange(1, 9, dtype=np.float32).reshape(1, 1, 2, 4)
    scales = np.array([1, 1, 0.6, 0.6], dtype=np.float32)
    with pytest.warns(UserWarning, match=r"scale 0.6 on an axis of 4 gives 2.4.*output length 2"):
        y = _ours("Resize", [x, None, scales], opset=19, mode="linear",
                  coordinate_transformation_mode="align_corners")[0]
    np.testing.assert_allclose(y, [[[[1.0, 3.142857]]]], rtol=1e-6)  # ONNX's expected output
    np.testing.assert_allclose(_ort("Resize", [x, None, scales], opset=19, mode="linear",
                                    coordinate_transformation_mode="align_corners")[0], [[[[1.0, 4.0]]]])
    whole = np.array([1, 1, 1.5, 1.5], dtype=np.float32)
    attrs = {"mode": "linear", "coordinate_transformation_mode": "align_corners"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = _ours("Resize", [x, None, whole], opset=19, **attrs)
    b = _ort("Resize", [x, None, whole], opset=19, **attrs)
    np.testing.assert_allclose(a[0], b[0], rtol=1e-6)


@pytest.mark.parametrize("scale", [0.3, 0.5, 0.7, 1.3])
@pytest.mark.parametrize("mode", ["linear", "nearest"])
def test_resize_tf_crop_and_resize_with_unrounded_scales_matches_onnxruntime(scale: float, mode: str) -> None:
    """tf_crop_and_resize spaces positions by the output length, as the operator's text and onnxruntime (a
    single output takes the roi's centre); it used the unrounded scaled length (scale 0.3 on 5 pixels: 1.8,
    not 3.0)."""
    x = np.arange(1, 11, dtype=np.float32).reshape(1, 1, 2, 5)
    roi = np.array([0, 0, 0, 0.2, 1, 1, 1, 0.8], np.float32)
    scales = np.array([1, 1, 1, scale], np.float32)
    attrs = {"mode": mode, "coordinate_transformation_mode": "tf_crop_and_resize"}
    a = _ours("Resize", [x, roi, scales], opset=11, **attrs)[0]
    b = _ort("Resize", [x, roi, scales], opset=11, **attrs)[0]
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_bad_attributes_name_the_node() -> None:
    x = np.zeros((1, 2, 5, 5), np.float32)
    w = np.zeros((3, 2, 3, 3), np.float32)
    with pytest.raises(EngineError, match="kernel_shape"):
        _ours("Conv", [x, w], kernel_shape=[2, 2])
    with pytest.raises(EngineError, match="channels"):
        _ours("Conv", [x, np.zeros((3, 1, 3, 3), np.float32)])
    with pytest.raises(EngineError, match="empty"):
        _ours("MaxPool", [x], kernel_shape=[7, 7])
    with pytest.raises(EngineError, match="scales or sizes"):
        _ours("Resize", [x], opset=19)


@pytest.mark.parametrize("k", [2, 17], ids=["uint8-codes", "uint16-codes"])  # 4 and 289 kernel offsets
def test_maxpool_indices_with_ties_match_torch(k: int) -> None:
    """Many equal values per window: the first maximum in row-major window order wins, as in torch."""
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(5).integers(0, 3, (2, 3, 40, 40)).astype(np.float32)
    y, idx = _ours("MaxPool", [x], n_outputs=2, kernel_shape=[k, k], strides=[3, 3])
    ry, ri = torch.nn.functional.max_pool2d(torch.tensor(x), k, 3, return_indices=True)
    np.testing.assert_array_equal(y, ry.numpy())
    np.testing.assert_array_equal(idx, ri.numpy() + (np.arange(6) * 1600).reshape(2, 3, 1, 1))


def _spy_shifted(monkeypatch) -> list[int]:
    """A list that gets one entry per call of engine/kernels/conv.py's shifted-GEMM Conv."""
    from onnxtrain.engine.kernels import conv as conv_kernels

    calls: list[int] = []
    real = conv_kernels._shifted_conv
    monkeypatch.setattr(conv_kernels, "_shifted_conv", lambda *a: calls.append(1) or real(*a))
    return calls


def _inputs(seed: int, dtype, xs, ws, channels: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in (xs, ws, (channels,))]


@pytest.mark.parametrize("xs, ws, attrs", [
    ((2, 8, 9, 10), (12, 8, 3, 3), {"pads": [1, 2, 0, 1]}),
    ((2, 8, 9, 10), (5, 8, 3, 2), {"pads": [2, 1, 2, 1], "dilations": [2, 1]}),
    ((1, 8, 5, 6, 7), (4, 8, 3, 1, 3), {"pads": [1, 0, 1, 1, 0, 0]}),
    ((3, 16, 7, 7), (16, 16, 3, 3), {"auto_pad": "SAME_UPPER"}),
])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_shifted_conv_matches_torch(xs, ws, attrs, dtype, monkeypatch) -> None:
    """A stride-1 Conv with 8 or more input channels and few channel pairs runs one GEMM per kernel offset
    on shifted views (engine/kernels/conv.py); against torch, with pads, dilations, 3-D and SAME."""
    torch = pytest.importorskip("torch")
    calls = _spy_shifted(monkeypatch)
    x, w, b = _inputs(7, dtype, xs, ws, ws[0])
    (y,) = _ours("Conv", [x, w, b], **attrs)
    nd = len(xs) - 2
    dil = attrs.get("dilations", [1] * nd)
    if "pads" in attrs:
        p = attrs["pads"]
        widths = [v for i in reversed(range(nd)) for v in (p[i], p[nd + i])]
        xt = torch.nn.functional.pad(torch.tensor(x), widths)
        ref = (torch.nn.functional.conv2d, torch.nn.functional.conv3d)[nd - 2](
            xt, torch.tensor(w), torch.tensor(b), dilation=dil)
    else:
        ref = torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(w), torch.tensor(b), padding="same")
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(y, ref.numpy(), rtol=tol, atol=tol * float(np.abs(ref.numpy()).max()))
    assert calls == [1]


@pytest.mark.parametrize("xs, ws, attrs", [
    ((2, 8, 9, 10), (8, 12, 3, 3), {"pads": [1, 2, 0, 1]}),
    ((2, 8, 9, 10), (8, 5, 3, 2), {"pads": [2, 1, 2, 0], "dilations": [2, 1]}),
    ((1, 8, 5, 6, 4), (8, 4, 2, 2, 2), {"pads": [1, 0, 1, 1, 1, 0]}),
    ((3, 16, 7, 7), (16, 16, 3, 3), {}),
])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_stride1_conv_transpose_as_a_flipped_conv_matches_torch(xs, ws, attrs, dtype, monkeypatch) -> None:
    """A stride-1, group-1 ConvTranspose with 8 or more input channels runs as the Conv with the kernel
    flipped (engine/kernels/conv.py's shifted GEMMs); against torch, with pads, dilations and 3-D."""
    torch = pytest.importorskip("torch")
    calls = _spy_shifted(monkeypatch)
    x, w, b = _inputs(8, dtype, xs, ws, ws[1])
    (y,) = _ours("ConvTranspose", [x, w, b], **attrs)
    nd = len(xs) - 2
    fn = (torch.nn.functional.conv_transpose2d, torch.nn.functional.conv_transpose3d)[nd - 2]
    full = fn(torch.tensor(x), torch.tensor(w), torch.tensor(b), dilation=attrs.get("dilations", 1)).numpy()
    p = attrs.get("pads", [0] * 2 * nd)
    ref = full[(Ellipsis,) + tuple(slice(p[i], full.shape[2 + i] - p[nd + i]) for i in range(nd))]
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(y, ref, rtol=tol, atol=tol * float(np.abs(ref).max()))
    assert calls == [1]


_TF_NN_MODES = [{"mode": "nearest", "nearest_mode": m}
                for m in ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")]
_TF_NN_MODES += [{"mode": "linear"}, {"mode": "cubic"}]


@pytest.mark.parametrize("opset", [11, 12, 13])
@pytest.mark.parametrize("attrs", _TF_NN_MODES, ids=lambda a: a.get("nearest_mode", a["mode"]))
def test_resize_tf_half_pixel_for_nn_matches_onnxruntime(attrs: dict[str, Any], opset: int) -> None:
    """Resize-11/12's tf_half_pixel_for_nn (tf2onnx), x = (y + 0.5) / scale, as onnxruntime runs it (also at
    opset 13+, where ONNX dropped it and a lifted gradient graph may still carry it)."""
    x = np.random.default_rng(10).standard_normal((1, 2, 5, 6)).astype(np.float32)
    roi = np.zeros(0, np.float32)
    none = np.zeros(0, np.float32) if opset < 13 else None  # scales: required before 13, then optional
    attrs = {**attrs, "coordinate_transformation_mode": "tf_half_pixel_for_nn"}
    for scales in ([1, 1, 1.7, 2.5], [1, 1, 0.6, 0.75], [1, 1, 2, 1]):
        sc = np.array(scales, np.float32)
        a = _ours("Resize", [x, roi, sc], opset=opset, **attrs)[0]
        b = _ort("Resize", [x, roi, sc], opset=opset, **attrs)[0]
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"scales {scales}")
    sizes = np.array([1, 2, 3, 11], np.int64)
    a = _ours("Resize", [x, roi, none, sizes], opset=opset, **attrs)[0]
    b = _ort("Resize", [x, roi, none, sizes], opset=opset, **attrs)[0]
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg="sizes")


@pytest.mark.parametrize("attrs", [a for a in _TF_NN_MODES if "ceil" not in a.get("nearest_mode", "")],
                         ids=lambda a: a.get("nearest_mode", a["mode"]))
def test_resize_tf_half_pixel_for_nn_gradient(attrs: dict[str, Any]) -> None:
    """The gradient of a Resize-11 tf_half_pixel_for_nn: finite differences in float64 (engine), and the
    gradient graph (lifted to opset 17, keeping the mode) run by the engine and by onnxruntime."""
    from onnx import TensorProto as T
    from onnx import numpy_helper

    from onnxtrain.autodiff import build_gradient_model
    from onnxtrain.testing import gradcheck

    ort = pytest.importorskip("onnxruntime")

    def model(elem: int) -> onnx.ModelProto:
        dt = helper.tensor_dtype_to_np_dtype(elem)
        w = np.random.default_rng(11).standard_normal((1, 2, 8, 15)).astype(dt)
        g = helper.make_graph(
            [helper.make_node("Resize", ["x", "roi", "sc"], ["y"],
                              coordinate_transformation_mode="tf_half_pixel_for_nn", **attrs),
             helper.make_node("Mul", ["y", "w"], ["yw"]),
             helper.make_node("ReduceSum", ["yw"], ["loss"], keepdims=0)],
            "resize", [helper.make_tensor_value_info("x", elem, [1, 2, 5, 6])],
            [helper.make_tensor_value_info("loss", elem, [])],
            [numpy_helper.from_array(np.zeros(0, np.float32), "roi"),
             numpy_helper.from_array(np.array([1, 1, 1.7, 2.5], np.float32), "sc"),
             numpy_helper.from_array(w, "w")])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)], ir_version=8)

    x = np.random.default_rng(12).standard_normal((1, 2, 5, 6))
    gradcheck(model(T.DOUBLE), "loss", ["x"], {"x": x})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = build_gradient_model(model(T.FLOAT), "loss", ["x"])
    onnx.checker.check_model(gm, full_check=True)
    so = ort.SessionOptions()
    so.log_severity_level = 4  # the deprecation warning of tf_half_pixel_for_nn at opset 13+
    sess = ort.InferenceSession(gm.SerializeToString(), so, providers=["CPUExecutionProvider"])
    xf = x.astype(np.float32)
    ours = compile_model(gm).run({"x": xf})
    np.testing.assert_allclose(ours[-1], sess.run(None, {"x": xf})[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("width,scale", [(7, 0.5), (7, 0.75), (13, 1.5), (9, 0.5), (11, 0.25)])
def test_resize_half_pixel_symmetric_nearest_ceil_as_onnxruntime(width: int, scale: float) -> None:
    """The offset of half_pixel_symmetric in float32, as onnxruntime and onnx.reference compute it: in float64
    it landed an ulp above a whole source position and "ceil" took the next pixel (7 pixels at 0.5 gave
    [2, 3, 5] for [1, 3, 5]); kernel fuzz audit."""
    x = np.arange(width, dtype=np.float32).reshape(1, 1, 1, width)
    scales = np.array([1, 1, 1, scale], np.float32)
    attrs = dict(mode="nearest", coordinate_transformation_mode="half_pixel_symmetric", nearest_mode="ceil")
    (ours,) = _ours("Resize", [x, None, scales], opset=19, **attrs)
    (want,) = _ort("Resize", [x, None, scales], opset=19, **attrs)
    np.testing.assert_array_equal(ours, want)


@pytest.mark.parametrize("mode", ["linear", "cubic"])
@pytest.mark.parametrize("shape", [(0, 3, 4, 4), (2, 0, 4, 4), (2, 3, 0, 4), (2, 3, 4, 0)])
def test_resize_of_an_empty_tensor_is_empty(mode: str, shape: tuple[int, ...]) -> None:
    """A zero-size dim (the reshapes of the linear and cubic paths failed on it), as onnxruntime gives."""
    x = np.zeros(shape, np.float32)
    scales = np.array([1, 1, 2, 2], np.float32)
    (ours,) = _ours("Resize", [x, None, scales], opset=19, mode=mode)
    (want,) = _ort("Resize", [x, None, scales], opset=19, mode=mode)
    assert ours.shape == want.shape == (shape[0], shape[1], 2 * shape[2], 2 * shape[3])


@pytest.mark.parametrize("opset,mode,shape,scales", [
    (13, "linear", (1, 1, 3, 4), [1, 1, 5 / 3, 7 / 4]),
    (19, "nearest", (1, 1, 3, 3), [1, 1, 7 / 3, 10 / 3]),
    (9, "nearest", (1, 1, 3, 3), [1, 1, 5 / 3, 7 / 3]),  # Upsample
], ids=["resize13-linear", "resize19-nearest", "upsample9"])
def test_float32_scales_size_the_output_as_onnxruntime(opset: int, mode: str, shape: tuple,
                                                       scales: list) -> None:
    """Scales of float32 just below their ratio (tf2onnx writes tf.image.resize to 5 rows as scale 5/3):
    onnxruntime and TensorFlow size the output in float32 (3 · 1.6666666f = 5); the float64 product
    4.99999988 made 4 rows. Values against onnxruntime, and the gradient against torch's."""
    import onnxruntime
    import torch
    from onnx import numpy_helper

    from onnxtrain.autodiff import build_gradient_model

    s = np.array(scales, np.float32)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    node = (helper.make_node("Upsample", ["x", "scales"], ["y"], mode=mode) if opset < 10 else
            helper.make_node("Resize", ["x", "roi", "scales"], ["y"], mode=mode))
    inits = [numpy_helper.from_array(s, "scales")]
    if opset >= 10:
        inits.append(numpy_helper.from_array(np.array([], np.float32), "roi"))
    t, f32 = helper.make_tensor_value_info, onnx.TensorProto.FLOAT
    g = helper.make_graph([node, helper.make_node("Mul", ["y", "w"], ["p"]),
                           helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0)], "g",
                          [t("x", f32, list(shape)), t("w", f32, list("abcd"))],
                          [t("loss", f32, []), t("y", f32, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    so = onnxruntime.SessionOptions()
    so.log_severity_level = 3  # (it warns that the inferred shape, 4 rows, is not the one it computes)
    want_y = onnxruntime.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
        ["y"], {"x": x, "w": np.ones((1, 1, 1, 1), np.float32)})[0]
    w = np.random.default_rng(1).standard_normal(want_y.shape).astype(np.float32)
    y, = compile_model(m).run({"x": x, "w": w}, ["y"])
    assert y.shape == want_y.shape
    assert y.shape[2] > int(shape[2] * float(s[2]))  # (the float64 product's floor)
    np.testing.assert_allclose(y, want_y, rtol=1e-6, atol=1e-6)
    if mode == "linear":
        gm = build_gradient_model(m, "loss", ["x"])
        onnx.checker.check_model(gm, full_check=True)
        dx, = compile_model(gm).run({"x": x, "w": w}, ["x_grad"])
        tx = torch.tensor(x, requires_grad=True)
        ty = torch.nn.functional.interpolate(tx, size=want_y.shape[2:], mode="bilinear", align_corners=False)
        (ty * torch.tensor(w)).sum().backward()
        np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["cubic", "linear", "nearest"])
def test_resize_pytorch_half_pixel_to_one_element_samples_position_zero(mode: str) -> None:
    """ONNX: x_original = length_resized > 1 ? (x_resized + 0.5) / scale - 0.5 : 0; onnxruntime 1.32 gives
    X[0] there. The cubic kernel read position -0.5 (onnx.reference's code), 1.8377 where X[0] is 1.7641."""
    import onnxruntime as ort
    from onnx import TensorProto, numpy_helper

    import onnxtrain

    x = np.array([1.76405235, 0.97873798, 1.86755799, 0.95008842], np.float32).reshape(1, 1, 4, 1)
    sizes = numpy_helper.from_array(np.array([1, 1, 1, 1], np.int64), "sizes")
    g = helper.make_graph([helper.make_node("Resize", ["X", "", "", "sizes"], ["Y"], mode=mode,
                                            coordinate_transformation_mode="pytorch_half_pixel")], "g",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 1, 4, 1])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], [sizes])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)]).SerializeToString()
    want = ort.InferenceSession(m, providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]
    got = onnxtrain.InferenceSession(m).run(None, {"X": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got.ravel()[0] == x.ravel()[0]


@pytest.mark.parametrize("attrs,scales", [
    ({"mode": "linear"}, [1, 1, 2, 2]),
    ({"mode": "cubic"}, [1, 1, 2, 1.5]),
    ({"mode": "linear", "coordinate_transformation_mode": "align_corners"}, [1, 1, 2, 0.5]),
    ({"mode": "cubic", "antialias": 1}, [1, 1, 0.6, 0.5]),
], ids=["linear", "cubic", "align-corners", "antialias"])
@pytest.mark.parametrize("dense", [True, False], ids=["matrix", "taps"])
def test_resize_keeps_non_finite_values_to_their_taps(attrs: dict[str, Any], scales: list, dense: bool,
                                                       monkeypatch) -> None:
    """An inf and a NaN in an image reach only the outputs whose taps read them, as in onnxruntime: the
    dense (out, in) matrix multiplied them by its zeros, and one inf made NaN of most of the image (the
    taps of large axes, by the antialias filter's taps past its support)."""
    if not dense:
        from onnxtrain.engine.kernels import resize as resize_kernels
        monkeypatch.setattr(resize_kernels, "_DENSE_LIMIT", 0)
    x = np.random.default_rng(10).standard_normal((2, 2, 9, 10)).astype(np.float32)
    x[0, 1, 4, 3], x[1, 0, 2, 7] = np.inf, np.nan
    s = np.array(scales, np.float32)
    (ours,) = _ours("Resize", [x, None, s], opset=19, **attrs)
    (want,) = _ort("Resize", [x, None, s], opset=19, **attrs)
    assert np.isfinite(want).mean() > 0.6  # the case is what it says
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op, shape, attrs", [
    ("MaxPool", (1, 2, 4, 3, 7), {"kernel_shape": [3, 3, 1], "dilations": [2, 1, 1]}),
    ("MaxPool", (3, 2, 1), {"kernel_shape": [2]}),
    ("AveragePool", (1, 1, 1, 2, 9), {"kernel_shape": [2, 1, 2], "auto_pad": "VALID",
                                      "count_include_pad": 1}),
    ("LpPool", (3, 2, 1, 9), {"kernel_shape": [2, 2], "strides": [1, 2], "p": 3}),
    ("AveragePool", (2, 1, 1, 5), {"kernel_shape": [2, 2], "pads": [0, 1, 0, 0], "ceil_mode": 1}),
], ids=["max-dilated", "max-1d", "avg-valid", "lp", "avg-ceil"])
def test_pool_with_a_window_longer_than_its_axis_is_empty(op: str, shape: tuple,
                                                           attrs: dict[str, Any]) -> None:
    """An axis whose padded length is one short of the window has no output position: an empty output,
    as onnxruntime gives (the kernels refused it)."""
    x = np.random.default_rng(11).standard_normal(shape).astype(np.float32)
    (want,) = _ort(op, [x], opset=19, **attrs)
    (ours,) = _ours(op, [x], opset=19, **attrs)
    assert 0 in want.shape
    assert ours.shape == want.shape and ours.dtype == want.dtype
    if op == "MaxPool":
        ours_y, ours_i = _ours(op, [x], opset=19, n_outputs=2, **attrs)
        want_y, want_i = _ort(op, [x], opset=19, n_outputs=2, **attrs)
        assert ours_y.shape == want_y.shape and ours_i.shape == want_i.shape and ours_i.dtype == want_i.dtype


# x shape, W shape, attributes: a stride-1 ConvTranspose as a Conv by shifted GEMMs, as a depthwise Conv by
# banded rows, the depthwise canvas, the strided shifted GEMMs (conv_transpose_shifts.py), the flat col2im
CONV_TRANSPOSE_ROUTES = [
    ((2, 16, 8, 8), (16, 16, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((8, 64, 16, 16), (64, 1, 3, 3), {"pads": [1, 1, 1, 1], "group": 64}),
    ((4, 32, 15, 19), (32, 1, 5, 2), {"strides": [1, 3], "pads": [0, 0, 0, 0], "output_padding": [0, 1],
                                       "group": 32}),
    ((4, 16, 8, 8), (16, 32, 4, 4), {"strides": [2, 2], "pads": [0, 0, 0, 0]}),
    ((2, 3, 6, 7), (3, 4, 3, 3), {"pads": [1, 0, 2, 1]}),
]


@pytest.mark.parametrize("xs, ws, attrs", CONV_TRANSPOSE_ROUTES,
                         ids=["as-conv", "as-depthwise-conv", "depthwise-canvas", "shifts", "flat"])
def test_conv_transpose_keeps_non_finite_weights_to_their_products(xs, ws, attrs) -> None:
    """An inf or NaN in W reaches only the outputs its products land on, as in torch: the routes that
    multiply W by padding (the flipped Conv's, the canvases', the padded rows') made NaN of the others."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(12)
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    w[0, 0, 1, 1], w[-1, -1, 0, -1] = np.inf, np.nan
    y = _ours("ConvTranspose", [x, w], **attrs)[0]
    s, p, group = attrs.get("strides", [1, 1]), attrs["pads"], attrs.get("group", 1)
    full = torch.nn.functional.conv_transpose2d(torch.tensor(x), torch.tensor(w), stride=s, groups=group,
                                                output_padding=attrs.get("output_padding", 0))
    want = full[:, :, p[0]:full.shape[2] - p[2], p[1]:full.shape[3] - p[3]].numpy()
    assert np.isfinite(want).mean() > 0.5  # the case is what it says
    np.testing.assert_allclose(y, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("xs, ws, attrs", CONV_TRANSPOSE_ROUTES,
                         ids=["as-conv", "as-depthwise-conv", "depthwise-canvas", "shifts", "flat"])
def test_conv_transpose_routes_keep_non_finite_inputs_to_their_products(xs, ws, attrs, monkeypatch) -> None:
    """The fast routes are checked on W only (X meets none of their zeros): an inf or NaN in X reaches the
    outputs of its products there, as in torch, with no col2im fallback taken."""
    torch = pytest.importorskip("torch")
    from onnxtrain.engine.kernels import conv as conv_kernels

    monkeypatch.setattr(conv_kernels, "_col2im_conv_transpose", None)  # (a fallback would fail)
    rng = np.random.default_rng(14)
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    x[0, 0, 1, 1], x[-1, -1, 0, -1], x[0, -1, -1, 2] = np.inf, np.nan, -np.inf
    y = _ours("ConvTranspose", [x, w], **attrs)[0]
    s, p, group = attrs.get("strides", [1, 1]), attrs["pads"], attrs.get("group", 1)
    full = torch.nn.functional.conv_transpose2d(torch.tensor(x), torch.tensor(w), stride=s, groups=group,
                                                output_padding=attrs.get("output_padding", 0))
    want = full[:, :, p[0]:full.shape[2] - p[2], p[1]:full.shape[3] - p[3]].numpy()
    assert 0.5 < np.isfinite(want).mean() < 1  # the case is what it says
    np.testing.assert_allclose(y, want, rtol=1e-10, atol=1e-10)


def test_resize_of_large_float16_values_keeps_its_weight_matrix(monkeypatch) -> None:
    """The finiteness check after the matrix product must not take float16 values above 256 (whose squares
    overflow) for non-finite ones: such an image stays on the matrix path, with onnxruntime's values."""
    from onnxtrain.engine.kernels import resize as resize_kernels

    calls: list[int] = []
    by_taps = resize_kernels._by_taps
    monkeypatch.setattr(resize_kernels, "_by_taps", lambda *a: calls.append(1) or by_taps(*a))
    x = np.random.default_rng(13).uniform(300, 2000, (1, 2, 6, 7)).astype(np.float16)
    s = np.array([1, 1, 2, 1.5], np.float32)
    (ours,) = _ours("Resize", [x, None, s], opset=19, mode="linear")
    (want,) = _ort("Resize", [x, None, s], opset=19, mode="linear")
    assert not calls
    np.testing.assert_allclose(ours.astype(np.float32), want.astype(np.float32), rtol=2e-3)
