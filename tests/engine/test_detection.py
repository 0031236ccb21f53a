"""Detection ops on what the op table cannot check against onnx.reference.

onnx.reference has no MaxRoiPool, applies opset 16's half_pixel default to RoiAlign-10, and fails on
NonMaxSuppression without an iou_threshold input. The oracles here: MaxRoiPool written out in plain loops,
onnxruntime (whose MaxRoiPool starts each bin at the smallest positive float instead of the lowest,
hence positive inputs when it is the oracle), and float64 finite differences over every element.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx
import pytest

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.testing import gradcheck, random_loss_model, run_engine
from tests.op_cases import OpCase
from tests.op_cases.detection import nms_inputs, roi_boxes
from tests.op_cases.harness import feeds_of, one_node_model, run_ours

ort = pytest.importorskip("onnxruntime")


def _ort(model: onnx.ModelProto, feeds: dict[str, Any]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _case(op: str, inputs: list[Any], opset: int = 17, **attrs: Any) -> tuple[onnx.ModelProto, dict]:
    case = OpCase(op, attrs=attrs, opset=opset)
    return one_node_model(case, inputs), feeds_of(inputs)


def _loss_model(model: onnx.ModelProto, feeds: dict[str, Any]) -> onnx.ModelProto:
    y = run_engine(model, feeds)[0]
    return random_loss_model(model, [y.shape], [0])


# ---- MaxRoiPool -----------------------------------------------------------------------------------


def _max_roi_pool_loops(x: np.ndarray, rois: np.ndarray, pooled: tuple[int, int], scale: float) -> np.ndarray:
    """MaxRoiPool as the Caffe layer describes it, one output element at a time."""
    n_r, (_, c, h, w) = rois.shape[0], x.shape
    ph, pw = pooled
    y = np.zeros((n_r, c, ph, pw), dtype=x.dtype)
    for r in range(n_r):
        b = int(rois[r, 0])
        # C's round: half away from zero
        x1, y1, x2, y2 = (int(math.copysign(math.floor(abs(float(v) * scale) + 0.5), v)) for v in rois[r, 1:])
        rh, rw = max(y2 - y1 + 1, 1), max(x2 - x1 + 1, 1)
        for i in range(ph):
            hs = min(max(math.floor(i * rh / ph) + y1, 0), h)
            he = min(max(math.ceil((i + 1) * rh / ph) + y1, 0), h)
            for j in range(pw):
                ws = min(max(math.floor(j * rw / pw) + x1, 0), w)
                we = min(max(math.ceil((j + 1) * rw / pw) + x1, 0), w)
                for ch in range(c):
                    best = None
                    for hh in range(hs, he):
                        for ww in range(ws, we):
                            v = x[b, ch, hh, ww]
                            best = v if best is None or v > best else best
                    y[r, ch, i, j] = 0 if best is None else best
    return y


def _max_roi_pool_inputs(rng: np.random.Generator, shape: tuple[int, ...], n: int, dt: Any,
                         low: float = -2.0) -> list[np.ndarray]:
    x = rng.uniform(low, 2, shape).astype(dt)
    boxes = roi_boxes(rng, n, (2 * shape[3], 2 * shape[2]), dt, outside=4.0)
    boxes[0] = [-9, -9, -5, -5]  # entirely outside: every bin empty
    boxes[1, 2:] = boxes[1, :2] - 3  # reversed: forced to one pixel
    boxes[2] = [-1, 5, 13, 9]  # halves after scaling by 0.5: C's round goes away from zero, not to even
    batch = rng.integers(0, shape[0], (n, 1)).astype(dt)
    return [x, np.concatenate([batch, boxes], axis=1)]


@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("pooled", [(3, 2), (4, 4), (1, 1)])
def test_max_roi_pool_matches_loops(dt, pooled) -> None:
    x, rois = _max_roi_pool_inputs(np.random.default_rng(sum(pooled)), (2, 3, 9, 11), 8, dt)
    model, feeds = _case("MaxRoiPool", [x, rois], pooled_shape=list(pooled), spatial_scale=0.5)
    got = run_ours(model, feeds)[0]
    np.testing.assert_array_equal(got, _max_roi_pool_loops(x, rois, pooled, 0.5))


def test_max_roi_pool_matches_onnxruntime() -> None:
    x, rois = _max_roi_pool_inputs(np.random.default_rng(3), (2, 4, 10, 12), 12, np.float32, low=0.1)
    model, feeds = _case("MaxRoiPool", [x, rois], pooled_shape=[3, 4], spatial_scale=0.5)
    np.testing.assert_array_equal(run_ours(model, feeds)[0], _ort(model, feeds)[0])


def _max_roi_pool_grad_loops(x: np.ndarray, rois: np.ndarray, pooled: tuple[int, int], scale: float,
                             dy: np.ndarray) -> np.ndarray:
    """dX of MaxRoiPool: each bin's gradient to the first maximum of its window (row-major)."""
    dx = np.zeros_like(x)
    for r in range(rois.shape[0]):
        one = rois[r:r + 1].copy()
        one[0, 0] = 0
        b = int(rois[r, 0])
        y = _max_roi_pool_loops(x[b:b + 1], one, pooled, scale)[0]
        x1, y1, x2, y2 = (int(math.copysign(math.floor(abs(float(v) * scale) + 0.5), v)) for v in rois[r, 1:])
        rh, rw = max(y2 - y1 + 1, 1), max(x2 - x1 + 1, 1)
        h, w = x.shape[2:]
        for i in range(pooled[0]):
            hs = min(max(math.floor(i * rh / pooled[0]) + y1, 0), h)
            he = min(max(math.ceil((i + 1) * rh / pooled[0]) + y1, 0), h)
            for j in range(pooled[1]):
                ws = min(max(math.floor(j * rw / pooled[1]) + x1, 0), w)
                we = min(max(math.ceil((j + 1) * rw / pooled[1]) + x1, 0), w)
                for ch in range(x.shape[1]):
                    hits = [(hh, ww) for hh in range(hs, he) for ww in range(ws, we)
                            if x[b, ch, hh, ww] == y[ch, i, j]]
                    if hits:
                        dx[(b, ch, *hits[0])] += dy[r, ch, i, j]
    return dx


def test_max_roi_pool_gradient_routes_to_first_maximum() -> None:
    # quantised values force ties inside windows: the gradient goes to the first one, row-major
    rng = np.random.default_rng(5)
    x, rois = _max_roi_pool_inputs(rng, (2, 2, 7, 8), 6, np.float64)
    x = np.round(x * 2) / 2
    model, feeds = _case("MaxRoiPool", [x, rois], pooled_shape=[2, 3], spatial_scale=0.5)
    lmodel = _loss_model(model, feeds)
    gmodel = build_gradient_model(lmodel, "loss", ["x0"])
    onnx.checker.check_model(gmodel, full_check=True)
    outs = dict(zip([o.name for o in gmodel.graph.output], run_engine(gmodel, feeds), strict=True))
    dx = outs["x0_grad"]
    u = onnx.numpy_helper.to_array(next(t for t in lmodel.graph.initializer if t.name == "u0"))
    np.testing.assert_allclose(dx, _max_roi_pool_grad_loops(x, rois, (2, 3), 0.5, u), rtol=0, atol=1e-12)


def test_max_roi_pool_gradient_numeric_and_portable() -> None:
    # continuous inputs (no ties), small enough for a full finite-difference Jacobian
    rng = np.random.default_rng(7)
    x, rois = _max_roi_pool_inputs(rng, (2, 2, 4, 4), 5, np.float64)
    model, feeds = _case("MaxRoiPool", [x, rois], pooled_shape=[2, 2], spatial_scale=0.5)
    lmodel = _loss_model(model, feeds)
    gradcheck(lmodel, "loss", ["x0"], feeds, rtol=1e-6, atol=1e-9, full_jacobian_max=64)
    # onnxruntime runs MaxRoiPool in float32 only: the same graph in float32, positive inputs
    x32, rois32 = _max_roi_pool_inputs(rng, (2, 3, 9, 10), 9, np.float32, low=0.1)
    model32, feeds32 = _case("MaxRoiPool", [x32, rois32], pooled_shape=[3, 2], spatial_scale=0.5)
    lm32 = random_loss_model(model32, [run_engine(model32, feeds32)[0].shape], [0], dtype=np.float32)
    g32 = build_gradient_model(lm32, "loss", ["x0"])
    for a, b in zip(run_engine(g32, feeds32), _ort(g32, feeds32), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def _max_roi_pool_half_inputs() -> list[np.ndarray]:
    """Float16 inputs whose corners times 0.3 land within float16 rounding of a half (k / 0.6)."""
    rng = np.random.default_rng(4)
    x = rng.uniform(-2, 2, (2, 2, 9, 10)).astype(np.float16)
    corners = rng.integers(-3, 20, (12, 4)) / 0.6
    batch = rng.integers(0, 2, (12, 1))
    return [x, np.concatenate([batch, corners], axis=1).astype(np.float16)]


def test_max_roi_pool_float16_scales_in_float32() -> None:
    # 1.667 (float16) * 0.3 is 0.5001 in float32 but 0.4998 with the scale rounded to float16 (0.2998): the
    # corners must round as the exact product does (oracle: the loops, in Python floats)
    x, rois = _max_roi_pool_half_inputs()
    model, feeds = _case("MaxRoiPool", [x, rois], pooled_shape=[3, 2], spatial_scale=0.3)
    np.testing.assert_array_equal(run_ours(model, feeds)[0], _max_roi_pool_loops(x, rois, (3, 2), 0.3))


def test_max_roi_pool_float16_gradient_uses_the_kernel_windows() -> None:
    x, rois = _max_roi_pool_half_inputs()
    model, feeds = _case("MaxRoiPool", [x, rois], pooled_shape=[3, 2], spatial_scale=0.3)
    lmodel = random_loss_model(model, [run_engine(model, feeds)[0].shape], [0], dtype=np.float16)
    gmodel = build_gradient_model(lmodel, "loss", ["x0"])
    outs = dict(zip([o.name for o in gmodel.graph.output], run_engine(gmodel, feeds), strict=True))
    u = onnx.numpy_helper.to_array(next(t for t in lmodel.graph.initializer if t.name == "u0"))
    want = _max_roi_pool_grad_loops(x.astype(np.float32), rois, (3, 2), 0.3, u.astype(np.float32))
    np.testing.assert_allclose(outs["x0_grad"].astype(np.float32), want, rtol=0, atol=1e-2)


# ---- RoiAlign -------------------------------------------------------------------------------------


def _roi_align_inputs(rng: np.random.Generator, shape: tuple[int, ...], n: int, dt: Any,
                      scale: float) -> list[np.ndarray]:
    x = rng.uniform(-2, 2, shape).astype(dt)
    rois = roi_boxes(rng, n, (shape[3] / scale, shape[2] / scale), dt)
    return [x, rois, rng.integers(0, shape[0], n).astype(np.int64)]


@pytest.mark.parametrize("mode", ["avg", "max"])
def test_roi_align_opset10_is_output_half_pixel(mode) -> None:
    # opset 10 has no coordinate_transformation_mode: onnxruntime (and the spec) align pixel corners
    x, rois, b = _roi_align_inputs(np.random.default_rng(11), (2, 3, 8, 9), 6, np.float32, 1.0)
    attrs = {"output_height": 2, "output_width": 3, "mode": mode}
    m10, feeds = _case("RoiAlign", [x, rois, b], opset=10, **attrs)
    np.testing.assert_allclose(run_ours(m10, feeds)[0], _ort(m10, feeds)[0], rtol=1e-5, atol=1e-6)
    m16, _ = _case("RoiAlign", [x, rois, b], opset=16, coordinate_transformation_mode="output_half_pixel",
                   **attrs)
    np.testing.assert_array_equal(run_ours(m10, feeds)[0], run_ours(m16, feeds)[0])


def test_roi_align_opset10_gradient() -> None:
    # the gradient builder upgrades the model to opset 17; the box geometry must stay output_half_pixel
    x, rois, b = _roi_align_inputs(np.random.default_rng(12), (2, 2, 6, 7), 4, np.float64, 1.0)
    model, feeds = _case("RoiAlign", [x, rois, b], opset=10, output_height=2, output_width=2,
                         sampling_ratio=2)
    lmodel = _loss_model(model, feeds)
    gradcheck(lmodel, "loss", ["x0"], feeds, rtol=1e-6, atol=1e-9)
    gmodel = build_gradient_model(lmodel, "loss", ["x0"])
    for a, c in zip(run_engine(gmodel, feeds), _ort(gmodel, feeds), strict=True):
        np.testing.assert_allclose(a, c, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("ratio", [0, 3])
def test_roi_align_gradient_full_jacobian(mode, ratio) -> None:
    # 60 elements: every element of dX is checked against central differences
    x, rois, b = _roi_align_inputs(np.random.default_rng(13 + ratio), (2, 2, 3, 5), 4, np.float64, 0.5)
    model, feeds = _case("RoiAlign", [x, rois, b], opset=16, output_height=2, output_width=3,
                         sampling_ratio=ratio, spatial_scale=0.5, mode=mode)
    gradcheck(_loss_model(model, feeds), "loss", ["x0"], feeds, rtol=1e-6, atol=1e-9, full_jacobian_max=64)


def _roi_align_half_cases() -> list[tuple[list[np.ndarray], dict[str, Any]]]:
    """Float16 inputs whose sample positions reach 10-20 pixels, where float16 steps by 1/64 to 1/32."""
    rng = np.random.default_rng(21)
    cases = []
    configs = [("avg", "half_pixel", 0, 1.0), ("avg", "output_half_pixel", 2, 0.5),
               ("max", "half_pixel", 3, 1.0), ("max", "output_half_pixel", 0, 0.5)]
    for k, (mode, ctm, ratio, scale) in enumerate(configs):
        x, rois, b = _roi_align_inputs(rng, (2, 3, 11, 12), 6, np.float16, scale)
        attrs = {"output_height": 3 + k, "output_width": 5 - k, "sampling_ratio": ratio,
                 "spatial_scale": scale, "mode": mode, "coordinate_transformation_mode": ctm}
        cases.append(([x, rois, b], attrs))
    return cases


@pytest.mark.parametrize("k", range(4))
def test_roi_align_float16_matches_onnxruntime(k: int) -> None:
    # float16 box geometry would put the samples up to 1/32 pixel off and flip taps and validity tests:
    # the kernel computes it in float32, as onnxruntime does
    inputs, attrs = _roi_align_half_cases()[k]
    model, feeds = _case("RoiAlign", inputs, opset=16, **attrs)
    got, want = run_ours(model, feeds)[0], _ort(model, feeds)[0]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=0, atol=2e-3)


@pytest.mark.parametrize("k", range(4))
def test_roi_align_float16_gradient_matches_float32(k: int) -> None:
    # the float16 gradient graph works in float32 like the kernel; oracle: the float32 model's gradient graph
    # on onnxruntime (the float32 rule is checked against central differences above)
    inputs, attrs = _roi_align_half_cases()[k]
    grads = []
    for dt, runner in ((np.float16, run_engine), (np.float32, _ort)):
        model, feeds = _case("RoiAlign", [inputs[0].astype(dt), inputs[1].astype(dt), inputs[2]], opset=16,
                             **attrs)
        lmodel = random_loss_model(model, [run_engine(model, feeds)[0].shape], [0], dtype=dt)
        gmodel = build_gradient_model(lmodel, "loss", ["x0"])
        outs = dict(zip([o.name for o in gmodel.graph.output], runner(gmodel, feeds), strict=True))
        grads.append(outs["x0_grad"].astype(np.float32))
    np.testing.assert_allclose(grads[0], grads[1], rtol=0, atol=5e-3)


def test_roi_align_rejects_bad_batch_index() -> None:
    x, rois, b = _roi_align_inputs(np.random.default_rng(1), (2, 1, 4, 4), 2, np.float32, 1.0)
    b[1] = 2
    model, feeds = _case("RoiAlign", [x, rois, b], opset=16, output_height=1, output_width=1)
    with pytest.raises(Exception, match="batch_indices"):
        run_ours(model, feeds)


# ---- NonMaxSuppression ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "limit, iou, score, center",
    [(None, None, None, False), (4, None, None, False), (3, 0.4, None, True), (50, 0.6, 0.2, False),
     (2, 0.0, 0.5, True), (0, 0.5, None, False)],
)
def test_nms_matches_onnxruntime(limit, iou, score, center) -> None:
    inputs = nms_inputs(3, 2, 25, center, limit, iou, score, ties=not center)(np.random.default_rng(2), None)
    model, feeds = _case("NonMaxSuppression", inputs, opset=11, center_point_box=int(center))
    got, want = run_ours(model, feeds)[0], _ort(model, feeds)[0]
    assert got.dtype == np.int64 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
