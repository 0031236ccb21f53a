"""Inference paths of the Conv kernel for small planes, against onnxruntime.

- a depthwise Conv over tiny output planes with many channels runs channels innermost, one product per
  kernel offset over every channel (engine/kernels/depthwise.py ``_depthwise_channels_last``);
- a stride-2 2-D depthwise Conv with narrow rows runs by banded GEMMs over every other padded row
  (``_depthwise_rows``);
- a Conv of a batch with few output positions an image runs as one GEMM over all the images' columns
  (engine/kernels/conv.py ``_one_gemm``).

Each case checks that the path ran and the values against onnxruntime.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxtrain.engine.kernels import conv as conv_kernels
from onnxtrain.engine.kernels import depthwise
from onnxtrain.engine.parallel import running_with
from onnxtrain.engine.registry import Attrs

ort = pytest.importorskip("onnxruntime")


def _model(xs: tuple[int, ...], ws: tuple[int, ...], attrs: dict[str, Any]) -> onnx.ModelProto:
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], **attrs)
    graph = helper.make_graph([node], "Conv", [
        helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, xs),
        helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, ws),
        helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, ws[:1])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", "m"] + [f"s{i}" for i in xs[2:]])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def _check(seed: int, xs: tuple[int, ...], ws: tuple[int, ...], attrs: dict[str, Any],
           threads: int = 1) -> None:
    """Conv of random X, W, B by our kernel against onnxruntime's."""
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
    b = rng.standard_normal(ws[:1]).astype(np.float32)
    sess = ort.InferenceSession(_model(xs, ws, attrs).SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, {"x": x, "w": w, "b": b})[0]
    with running_with(threads):
        y = conv_kernels.conv([x, w, b], Attrs(dict(attrs), op="Conv"))[0]
    assert y.shape == want.shape and y.dtype == want.dtype
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def _spy(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[tuple[int, ...]]:
    """The shapes of the first argument of ``module.name`` (X of a path, the columns for ``_one_gemm``) from
    now on."""
    seen: list[tuple[int, ...]] = []
    real = getattr(module, name)

    def spy(x: np.ndarray, *rest: Any) -> np.ndarray:
        seen.append(x.shape)
        return real(x, *rest)

    monkeypatch.setattr(module, name, spy)
    return seen


def _depthwise_attrs(c: int, k: int, stride: int, pads: list[int], dil: int = 1) -> dict[str, Any]:
    return dict(group=c, strides=[stride, stride], pads=pads, dilations=[dil, dil], kernel_shape=[k, k])


@pytest.mark.parametrize("n,c,mult,hw,k,stride,pads,dil", [
    (16, 96, 1, 2, 3, 1, [1, 1, 1, 1], 1),  # MobileNetV2's 960-channel layer, fewer channels
    (1, 64, 1, 2, 3, 1, [1, 1, 1, 1], 1),
    (2, 72, 1, 4, 3, 1, [1, 1, 1, 1], 1),  # 4² planes
    (3, 40, 2, 4, 3, 2, [1, 0, 1, 2], 1),  # a channel multiplier, stride 2, uneven pads
    (2, 33, 1, 3, 3, 2, [2, 2, 2, 2], 2),  # dilated
    (4, 48, 3, 2, 2, 1, [0, 1, 1, 0], 1),
])
def test_depthwise_tiny_planes_run_channels_last(monkeypatch: pytest.MonkeyPatch, n: int, c: int, mult: int,
                                                 hw: int, k: int, stride: int, pads: list[int],
                                                 dil: int) -> None:
    seen = _spy(monkeypatch, depthwise, "_depthwise_channels_last")
    for threads in (1, 2):
        _check(n + c, (n, c, hw, hw), (c * mult, 1, k, k), _depthwise_attrs(c, k, stride, pads, dil), threads)
    assert seen == [(n, c, hw, hw)] * 2


@pytest.mark.parametrize("xs,k,stride,pads", [
    ((3, 40, 7), [3], [2], [1, 1]),  # 1-D
    ((2, 36, 3, 2, 4), [3, 1, 3], [1, 1, 2], [1, 0, 1, 1, 0, 1]),  # 3-D
])
def test_channels_last_in_1d_and_3d(monkeypatch: pytest.MonkeyPatch, xs: tuple[int, ...], k: list[int],
                                    stride: list[int], pads: list[int]) -> None:
    seen = _spy(monkeypatch, depthwise, "_depthwise_channels_last")
    _check(len(xs), xs, (xs[1], 1, *k), dict(group=xs[1], strides=stride, pads=pads, kernel_shape=k))
    assert seen == [xs]


def test_channels_last_leaves_larger_planes_and_few_channels(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _spy(monkeypatch, depthwise, "_depthwise_channels_last")
    _check(0, (16, 64, 8, 8), (64, 1, 3, 3), _depthwise_attrs(64, 3, 1, [1] * 4))  # 8² outputs: banded
    _check(1, (16, 8, 2, 2), (8, 1, 3, 3), _depthwise_attrs(8, 3, 1, [1] * 4))  # 8 channels
    assert seen == []


@pytest.mark.parametrize("n,c,mult,hw,k,stride,pads,dil", [
    (16, 24, 1, 16, 3, 2, [1, 1, 1, 1], 1),  # MobileNetV2's strided 144-channel layer, fewer channels
    (4, 20, 1, 15, 3, 2, [1, 1, 1, 1], 1),  # odd sizes: the last padded row of an image rounded up
    (3, 12, 2, 17, 5, 2, [2, 1, 0, 2], 1),  # a channel multiplier, uneven pads
    (2, 16, 1, 12, 3, 2, [2, 2, 2, 2], 2),  # dilated
])
def test_strided_depthwise_runs_by_banded_gemms(monkeypatch: pytest.MonkeyPatch, n: int, c: int, mult: int,
                                                hw: int, k: int, stride: int, pads: list[int],
                                                dil: int) -> None:
    monkeypatch.setattr(depthwise, "MIN_DEPTHWISE", 0)
    monkeypatch.setattr(depthwise, "MIN_BANDED", 0)
    monkeypatch.setattr(depthwise, "MIN_BANDED_WIDE", 0)
    seen = _spy(monkeypatch, depthwise, "_depthwise_rows")
    for threads in (1, 2):
        attrs = _depthwise_attrs(c, k, stride, pads, dil)
        _check(n + hw, (n, c, hw, hw), (c * mult, 1, k, k), attrs, threads)
    assert seen == [(n, c, hw, hw)] * 2


@pytest.mark.parametrize("n,c,hw,m,k,stride,pads,route", [
    (16, 64, 2, 160, 1, 1, [0, 0, 0, 0], "_one_gemm"),  # MobileNetV2's 1×1 layers over 2², fewer channels
    (5, 24, 1, 7, 1, 1, [0, 0, 0, 0], "_one_gemm"),
    # a kernel or stride to take windows of: copied straight into the one GEMM's columns
    (6, 5, 2, 12, 3, 1, [1, 1, 1, 1], "_one_gemm_windows"),
    (3, 8, 4, 10, 3, 2, [1, 0, 1, 1], "_one_gemm_windows"),  # stride 2 to 2²
])
def test_small_planes_of_a_batch_run_as_one_gemm(monkeypatch: pytest.MonkeyPatch, n: int, c: int, hw: int,
                                                 m: int, k: int, stride: int, pads: list[int],
                                                 route: str) -> None:
    seen = {name: _spy(monkeypatch, conv_kernels, name) for name in ("_one_gemm", "_one_gemm_windows")}
    attrs = dict(strides=[stride, stride], pads=pads, kernel_shape=[k, k])
    _check(n * hw, (n, c, hw, hw), (m, c, k, k), attrs)
    assert {name: len(calls) for name, calls in seen.items()} == {
        name: int(name == route) for name in seen}


def test_one_image_or_larger_planes_keep_the_batched_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _spy(monkeypatch, conv_kernels, "_one_gemm")
    _check(0, (1, 64, 2, 2), (96, 64, 1, 1), dict(kernel_shape=[1, 1]))
    _check(1, (4, 16, 8, 8), (32, 16, 1, 1), dict(kernel_shape=[1, 1]))
    assert seen == []


def test_depthwise_conv_transpose_on_tiny_planes_goes_channels_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stride-1 depthwise ConvTranspose (a depthwise Conv's input gradient) taken as the Conv with flipped
    kernels reaches the channels-last path too."""
    seen = _spy(monkeypatch, depthwise, "_depthwise_channels_last")
    n, c = 16, 576
    rng = np.random.default_rng(7)
    x = rng.standard_normal((n, c, 2, 2)).astype(np.float32)
    w = rng.standard_normal((c, 1, 3, 3)).astype(np.float32)
    attrs = dict(group=c, pads=[1, 1, 1, 1], kernel_shape=[3, 3])
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], **attrs)
    graph = helper.make_graph([node], "ConvTranspose", [
        helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x.shape),
        helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, w.shape)],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", "m", "h", "w"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "w": w})[0]
    y = conv_kernels.conv_transpose([x, w], Attrs(dict(attrs), op="ConvTranspose"))[0]
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    assert seen == [(n, c, 2, 2)]
