"""Conv weight gradients and big-kernel Convs on the paths chosen by shape: the stride-1 im2col by rows only
while its junk columns are few, else by windows; one GEMM per output position for a kernel larger than the
output (kernels/conv.py); the fused weight gradient of 1-D and 3-D Convs (fusion/gemm.py). Gradients against
torch autograd (float64 and float32), forward Convs against onnxruntime."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine import compile_model
from onnxtrain.engine.fusion import gemm
from onnxtrain.engine.kernels import conv as conv_kernels
from onnxtrain.engine.plan import Plan
from onnxtrain.engine.registry import Attrs

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
F = torch.nn.functional


def _loss_model(op: str, x: np.ndarray, w: np.ndarray, r: np.ndarray,
                attrs: dict[str, Any]) -> onnx.ModelProto:
    """loss = Σ op(x, w)·r, r an initializer."""
    elem = helper.np_dtype_to_tensor_dtype(x.dtype)
    nodes = [helper.make_node(op, ["x", "w"], ["y"], **attrs), helper.make_node("Mul", ["y", "r"], ["yr"]),
             helper.make_node("ReduceSum", ["yr"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, op, [helper.make_tensor_value_info("x", elem, x.shape),
                                          helper.make_tensor_value_info("w", elem, w.shape)],
                              [helper.make_tensor_value_info("loss", elem, [])],
                              initializer=[numpy_helper.from_array(r, "r")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _engine_grads(op: str, x: np.ndarray, w: np.ndarray, r: np.ndarray,
                  attrs: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """dX, dW of the loss on the numpy engine (fusions on), and the op types of its plan's steps."""
    gm = build_gradient_model(_loss_model(op, x, w, r, attrs), "loss", ["x", "w"])
    plan = compile_model(gm)
    outs = dict(zip([o.name for o in gm.graph.output], plan.run({"x": x, "w": w}), strict=True))
    return outs["x_grad"], outs["w_grad"], [st.node.op_type for st in plan.steps]


def _torch_grads(fn: Callable, x: np.ndarray, w: np.ndarray, r: np.ndarray,
                 dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    """dX, dW of Σ fn(x, w)·r by torch autograd in ``dtype``."""
    xt = torch.tensor(x, dtype=dtype, requires_grad=True)
    wt = torch.tensor(w, dtype=dtype, requires_grad=True)
    (fn(xt, wt) * torch.tensor(r, dtype=dtype)).sum().backward()
    return xt.grad.numpy(), wt.grad.numpy()


def _torch_conv(nd: int, transpose: bool, attrs: dict[str, Any]) -> Callable:
    """torch's convNd / conv_transposeNd with the ONNX node's attributes (symmetric pads, or torch's pad)."""
    pads = attrs.get("pads", [0] * 2 * nd)
    kw: dict[str, Any] = {"stride": attrs.get("strides", 1), "dilation": attrs.get("dilations", 1),
                          "groups": attrs.get("group", 1)}
    if transpose:
        kw["output_padding"] = attrs.get("output_padding", 0)
        fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nd - 1]
        return lambda x, w: fn(x, w, padding=pads[:nd], **kw)
    fn = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
    if pads[:nd] == pads[nd:]:
        return lambda x, w: fn(x, w, padding=pads[:nd], **kw)
    torch_pads = [p for i in reversed(range(nd)) for p in (pads[i], pads[nd + i])]
    return lambda x, w: fn(F.pad(x, torch_pads), w, **kw)


# x shape, w shape, attributes, whether the plan fuses the weight gradient (group 1, "NOTSET" pads)
CONV = {
    "1d-pad": ((4, 8, 40), (6, 8, 3), {"pads": [1, 1]}, True),
    "1d-strided-dilated": ((3, 4, 41), (6, 4, 5), {"strides": [2], "dilations": [2], "pads": [2, 1]}, True),
    "1d-grouped": ((2, 6, 30), (9, 2, 4), {"group": 3, "pads": [1, 2]}, False),
    "1d-depthwise": ((2, 4, 30), (4, 1, 5), {"group": 4, "pads": [2, 2]}, False),
    "3d-pad": ((2, 4, 6, 7, 5), (5, 4, 3, 3, 3), {"pads": [1] * 6}, True),
    "3d-1x1x1": ((2, 3, 5, 4, 6), (4, 3, 1, 1, 1), {}, True),
    "3d-strided-asym-pads": ((2, 3, 7, 6, 5), (4, 3, 3, 2, 3),
                             {"strides": [2, 1, 2], "pads": [1, 0, 1, 0, 1, 1]}, True),
    "3d-dilated": ((2, 3, 9, 8, 7), (4, 3, 3, 2, 3),
                   {"dilations": [2, 1, 2], "pads": [2, 1, 0, 2, 0, 1]}, True),
    "3d-grouped": ((2, 4, 5, 6, 5), (6, 2, 3, 3, 2), {"group": 2, "pads": [1] * 6}, False),
    "3d-shifted": ((2, 8, 5, 6, 4), (8, 8, 3, 3, 3), {"pads": [1, 0, 1, 1, 2, 1]}, True),
    # strided, above gemm.PATCHES_ND_MIN_VALUES: channels-last patches (whole samples, or rows of one)
    "1d-strided-patch-rows": ((4, 2, 20000), (3, 2, 5), {"strides": [2], "pads": [2, 1]}, True),
    "3d-strided-patches": ((3, 8, 20, 18, 16), (5, 8, 3, 3, 3), {"strides": [2, 2, 2], "pads": [1] * 6},
                           True),
    "3d-strided-patch-rows": ((1, 6, 48, 48, 32), (3, 6, 3, 3, 3), {"strides": [2, 2, 2], "pads": [1] * 6},
                              True),
    "3d-patches-stride-1": ((2, 8, 16, 16, 12), (6, 8, 3, 3, 3), {"pads": [1, 0, 1, 1, 2, 1]}, True),
    # few input channels: channels-first columns (gemm.PATCH_RUN_MIN)
    "3d-columns-one-channel": ((4, 1, 26, 24, 22), (5, 1, 3, 3, 3), {"strides": [2, 2, 2], "pads": [1] * 6},
                               True),
    "3d-columns-stride-1": ((2, 3, 20, 18, 16), (4, 3, 3, 3, 3), {"pads": [1, 1, 0, 1, 1, 2]}, True),
    "3d-strided-dilated-patches": ((3, 6, 17, 16, 15), (4, 6, 3, 2, 3),
                                   {"strides": [2, 1, 2], "dilations": [1, 2, 1], "pads": [1, 0, 1, 1, 1, 0]},
                                   True),
    "2d-large-kernel": ((2, 3, 12, 11), (4, 3, 10, 9), {"pads": [1, 0, 2, 1]}, True),
    # strided 2-D: the gradient's Slice keeps the first k taps of a longer kernel, and only those are computed
    "2d-strided-3x3": ((4, 8, 12, 12), (6, 8, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}, True),
    "2d-strided-uneven": ((3, 7, 11, 10), (5, 7, 3, 2), {"strides": [2, 3], "pads": [1, 0, 0, 1]}, True),
    "2d-strided-few-channels": ((3, 2, 11, 10), (5, 2, 3, 3), {"strides": [2, 2], "pads": [1] * 4}, True),
    "2d-strided-1x1": ((4, 8, 12, 12), (6, 8, 1, 1), {"strides": [2, 2]}, True),
    "2d-strided-1x1-pointwise": ((2, 8, 24, 23), (6, 8, 1, 1), {"strides": [2, 2]}, True),
    "2d-grouped-large-kernel": ((3, 4, 7, 7), (4, 2, 5, 5), {"group": 2}, False),
}
CONV_TRANSPOSE = {
    "3d-stride-2": ((2, 4, 3, 4, 3), (4, 3, 2, 2, 2), {"strides": [2, 2, 2]}, True),
    "3d-stride-1-pad": ((2, 4, 5, 4, 5), (4, 6, 3, 3, 3), {"pads": [1] * 6}, True),
    "3d-shifted": ((2, 8, 4, 5, 4), (8, 8, 3, 3, 3), {"pads": [1, 0, 1, 1, 0, 1]}, True),
    "3d-strided-dilated": ((2, 3, 3, 4, 3), (3, 2, 3, 2, 2),
                           {"strides": [2, 1, 3], "dilations": [1, 2, 1], "output_padding": [1, 0, 2]}, True),
    "3d-grouped": ((2, 4, 3, 3, 4), (4, 2, 2, 3, 2), {"strides": [2, 1, 1], "group": 2}, False),
    "1d-stride-2": ((3, 5, 9), (5, 4, 4), {"strides": [2], "pads": [1, 1], "output_padding": [1]}, True),
    # above conv.PHASES_MIN_OUTPUT: col2im by stride phases
    "3d-stride-2-phases": ((2, 8, 10, 9, 8), (8, 4, 3, 3, 3),
                           {"strides": [2, 2, 2], "pads": [1] * 6, "output_padding": [1, 0, 1]},
                           True),
    "3d-strides-2-1-3-phases": ((2, 6, 9, 7, 6), (6, 5, 2, 3, 4),
                                {"strides": [2, 1, 3], "dilations": [1, 2, 1]}, True),
}
CASES = [("Conv", *v) for v in CONV.values()] + [("ConvTranspose", *v) for v in CONV_TRANSPOSE.values()]
IDS = [f"conv-{k}" for k in CONV] + [f"convtranspose-{k}" for k in CONV_TRANSPOSE]


def _small_limits(monkeypatch: pytest.MonkeyPatch, per_output: bool) -> None:
    """With ``per_output``: one GEMM per output position whatever the columns' size, and no fused
    shifted GEMMs (the unfused weight-gradient Conv takes the per-output path)."""
    if per_output:
        monkeypatch.setattr(conv_kernels, "PER_OUTPUT_MIN_COLUMNS", 0)
        monkeypatch.setattr(gemm, "SHIFTED_MAX_GEMMS", 0)


def _inputs(op: str, xs: tuple[int, ...], ws: tuple[int, ...], attrs: dict[str, Any], dtype: Any,
            seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, Callable]:
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    fn = _torch_conv(len(xs) - 2, op == "ConvTranspose", attrs)
    y = fn(torch.tensor(x), torch.tensor(w))
    r = rng.standard_normal(tuple(y.shape))
    return x.astype(dtype), w.astype(dtype), r.astype(dtype), fn


@pytest.mark.parametrize("per_output", [False, True], ids=["default-limits", "per-output"])
@pytest.mark.parametrize("op,xs,ws,attrs,fused", CASES, ids=IDS)
def test_training_grads_match_torch_float64(op, xs, ws, attrs, fused, per_output, monkeypatch) -> None:
    _small_limits(monkeypatch, per_output)
    x, w, r, fn = _inputs(op, xs, ws, attrs, np.float64)
    dx, dw, ops = _engine_grads(op, x, w, r, attrs)
    tdx, tdw = _torch_grads(fn, x, w, r, torch.float64)
    np.testing.assert_allclose(dw, tdw, rtol=1e-10, atol=1e-10, err_msg="weight gradient")
    np.testing.assert_allclose(dx, tdx, rtol=1e-10, atol=1e-10, err_msg="input gradient")
    assert ("FusedConvWeightGrad" in ops) == fused


@pytest.mark.parametrize("case", [k for k in CONV if "patch" in k or "columns" in k])
def test_large_strided_weight_grads_take_the_patches(case: str, monkeypatch) -> None:
    """The strided 1-D and the 3-D cases above gemm.PATCHES_ND_MIN_VALUES take the channels-last patches, or
    with few channels the columns (the float64 and float32 tests compare their values with torch's)."""
    calls = []
    kernel = "_weight_grad_columns_nd" if "columns" in case else "_weight_grad_patches_nd"
    real = getattr(gemm, kernel)
    monkeypatch.setattr(gemm, kernel, lambda *a: calls.append(1) or real(*a))
    xs, ws, attrs, _ = CONV[case]
    _engine_grads("Conv", *_inputs("Conv", xs, ws, attrs, np.float32)[:3], attrs)
    assert calls == [1]


@pytest.mark.parametrize("case", [k for k in CONV if k.startswith("2d-strided") or (
    "strided" in k and ("patch" in k or "columns" in k))])
def test_strided_weight_grads_compute_only_the_kernel(case: str, monkeypatch) -> None:
    """A strided Conv's weight gradient is a longer kernel the gradient builder crops with a Slice: the fused
    step takes the Slice in and its GEMMs see the kernel's own taps (the values: the torch tests above)."""
    xs, ws, attrs, _ = CONV[case]
    seen: list[tuple[int, ...]] = []
    for name in ("_weight_grad_patches", "_weight_grad_patches_nd", "_weight_grad_columns_nd",
                 "_weight_grad_gemm", "_pointwise_weight_grad"):
        real = getattr(gemm, name)
        monkeypatch.setattr(gemm, name, lambda *a, _r=real: seen.append(_r(*a).shape[2:]) or _r(*a))
    ops = _engine_grads("Conv", *_inputs("Conv", xs, ws, attrs, np.float32)[:3], attrs)[2]
    assert "Slice" not in ops and "FusedConvWeightGrad" in ops
    assert seen == [ws[2:]]


def _cropped_weight_grad(tail: list[onnx.NodeProto], opset: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The gradient builder's weight-gradient pattern of a 3×3 Conv at stride 2 (the swapped Conv dilated by
    2, a 4×4 result ``dwl``), then ``tail`` making ``dw`` of it: the fused plan's op types, and ``dw`` from
    the fused and the unfused plans."""
    n = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2, 3]),
         helper.make_node("Transpose", ["dy"], ["dyt"], perm=[1, 0, 2, 3]),
         helper.make_node("Conv", ["xt", "dyt"], ["c"], dilations=[2, 2], pads=[1, 1, 1, 1]),
         helper.make_node("Transpose", ["c"], ["dwl"], perm=[1, 0, 2, 3]), *tail]
    graph = helper.make_graph(n, "g", [helper.make_tensor_value_info(v, 1, None) for v in ("x", "dy")],
                              [helper.make_tensor_value_info("dw", 1, None)])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                          ir_version=8 if opset > 9 else 4)
    fused, plain = Plan(m), Plan(m, fuse=False)
    rng = np.random.default_rng(6)
    feeds = {"x": rng.standard_normal((3, 8, 11, 12)).astype(np.float32),
             "dy": rng.standard_normal((3, 5, 6, 6)).astype(np.float32)}
    return [st.node.op_type for st in fused.steps], fused.run(feeds)[0], plain.run(feeds)[0]


@pytest.mark.parametrize("starts, steps, absorbed", [([0, 0], [1, 1], True), ([1, 0], [1, 1], False),
                                                     ([0, 0], [1, 2], False)],
                         ids=["prefix", "offset", "step-2"])
def test_fused_weight_grad_takes_in_only_a_prefix_slice(starts, steps, absorbed) -> None:
    """Only a Slice that keeps the first entries of the kernel's axes joins the fused step; the values equal
    the unfused steps' either way."""
    tail = []
    for name, v in (("starts", starts), ("ends", [3, 3]), ("axes", [-2, 3]), ("steps", steps)):
        value = numpy_helper.from_array(np.array(v, np.int64))
        tail.append(helper.make_node("Constant", [], [name], value=value))
    tail.append(helper.make_node("Slice", ["dwl", "starts", "ends", "axes", "steps"], ["dw"]))
    ops, got, want = _cropped_weight_grad(tail, 17)
    assert ops == ["FusedConvWeightGrad"] + ([] if absorbed else ["Slice"])
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_fused_weight_grad_takes_in_slice_1() -> None:
    """Slice-1 (opset < 10) gives its bounds as attributes: the same prefix crop."""
    tail = [helper.make_node("Slice", ["dwl"], ["dw"], starts=[0, 0], ends=[3, 3], axes=[2, 3])]
    ops, got, want = _cropped_weight_grad(tail, 9)
    assert ops == ["FusedConvWeightGrad"]
    assert got.shape == want.shape == (5, 8, 3, 3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", [k for k in CONV_TRANSPOSE if "phases" in k])
def test_strided_3d_conv_transpose_by_phases_gives_the_strided_adds_bits(case: str, monkeypatch) -> None:
    """col2im by stride phases adds the same values in the same order as the strided adds: the same bits."""
    xs, ws, attrs, _ = CONV_TRANSPOSE[case]
    x, w = _inputs("ConvTranspose", xs, ws, attrs, np.float32)[:2]
    calls = []
    real = conv_kernels._col2im_by_phases
    monkeypatch.setattr(conv_kernels, "_col2im_by_phases", lambda *a: calls.append(1) or real(*a))
    got = conv_kernels.conv_transpose([x, w], Attrs(dict(attrs)))[0]
    assert calls == [1]
    monkeypatch.setattr(conv_kernels, "PHASES_MIN_OUTPUT", 1 << 60)
    want = conv_kernels.conv_transpose([x, w], Attrs(dict(attrs)))[0]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("op,xs,ws,attrs,fused", CASES, ids=IDS)
def test_training_grads_match_torch_float32(op, xs, ws, attrs, fused) -> None:
    """float32: the error against torch's float64 gradients within a few times torch's own float32 error."""
    x, w, r, fn = _inputs(op, xs, ws, attrs, np.float32, seed=1)
    got = _engine_grads(op, x, w, r, attrs)[:2]
    want = _torch_grads(fn, x, w, r, torch.float64)
    theirs = _torch_grads(fn, x, w, r, torch.float32)
    for name, g, t64, t32 in zip(("dX", "dW"), got, want, theirs, strict=True):
        assert g.dtype == np.float32 and g.shape == t64.shape
        scale = np.abs(t64).max()
        ours_err, torch_err = np.abs(g - t64).max() / scale, np.abs(t32 - t64).max() / scale
        assert ours_err <= max(4 * torch_err, 1e-6), (name, ours_err, torch_err)


# ---- forward Convs whose path changed, against onnxruntime ------------------------------------------------
# x shape, w shape, attributes, the path: "per_output", "windows" (im2col by windows, the rows' junk too
# many), "rows" (im2col by flattened rows), "shifted" (one GEMM per kernel offset on shifted views)
FORWARD = {
    # 3-D weight gradient of Conv3d(3×3×3, pad 1): kernel 12³, output 3³
    "3d-weight-grad": ((8, 2, 12, 12, 12), (8, 2, 12, 12, 12), {"pads": [1] * 6}, "per_output"),
    # ConvTranspose3d(2×2×2, stride 2)'s weight gradient: kernel 10³ dilated by 2, output 2³
    "3d-convtranspose-weight-grad": ((16, 4, 20, 20, 20), (8, 4, 10, 10, 10), {"dilations": [2] * 3},
                                     "per_output"),
    "2d-big-kernel": ((16, 8, 40, 40), (16, 8, 40, 40), {"pads": [1, 2, 0, 1]}, "per_output"),
    "1d-big-kernel": ((32, 16, 514), (8, 16, 512), {}, "per_output"),
    "2d-grouped-big-kernel": ((128, 32, 6, 6), (8, 16, 5, 5), {"group": 2}, "per_output"),
    "3d-dilated-windows": ((2, 4, 16, 16, 16), (8, 4, 3, 3, 3), {"dilations": [4] * 3}, "windows"),
    "3d-windows-pad": ((4, 4, 10, 10, 10), (8, 4, 3, 3, 3), {"dilations": [3] * 3, "pads": [1] * 6},
                       "windows"),
    "3d-rows": ((4, 4, 8, 8, 8), (16, 4, 3, 3, 3), {"pads": [1] * 6}, "rows"),
    "3d-shifted": ((4, 16, 8, 8, 8), (16, 16, 3, 3, 3), {"pads": [1, 0, 1, 1, 2, 0]}, "shifted"),
    "2d-rows-dilated": ((4, 4, 20, 20), (8, 4, 3, 3), {"dilations": [4, 4]}, "rows"),
    # at most conv.ONE_GEMM_WINDOWS_MAX_COLUMNS outputs an image: the batch's windows as one GEMM's columns
    "2d-strided-small-planes": ((8, 16, 16, 16), (32, 16, 3, 3), {"strides": [2, 2], "pads": [1] * 4},
                                "one_gemm"),
    "1d-strided-one-gemm": ((8, 16, 40), (8, 16, 5), {"strides": [2], "pads": [2, 1]}, "one_gemm"),
    "3d-strided-one-gemm": ((4, 4, 7, 7, 7), (8, 4, 3, 3, 3), {"strides": [2] * 3, "pads": [1] * 6},
                            "one_gemm"),
    "2d-wide-dilated-one-gemm": ((4, 80, 6, 7), (64, 80, 3, 3), {"dilations": [2, 1], "pads": [2, 1, 1, 0]},
                                 "one_gemm"),
    "2d-one-image-windows": ((1, 16, 16, 16), (32, 16, 3, 3), {"strides": [2, 2], "pads": [1] * 4},
                             "windows"),
}


def _ort_conv(x: np.ndarray, w: np.ndarray, attrs: dict[str, Any]) -> np.ndarray:
    node = helper.make_node("Conv", ["x", "w"], ["y"], **attrs)
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info("x", 1, x.shape),
                                               helper.make_tensor_value_info("w", 1, w.shape)],
                              [helper.make_tensor_value_info("y", 1, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x, "w": w})[0]


def _count_paths(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of the Conv kernel's per-output GEMMs, im2col by windows and by rows, shifted GEMMs and the one
    GEMM over the batch's windows, from now on."""
    seen = {"per_output": 0, "windows": 0, "rows": 0, "shifted": 0, "one_gemm": 0}
    per_output, im2col = conv_kernels._per_output_conv, conv_kernels._im2col_conv
    shifted, one_gemm = conv_kernels._shifted_conv, conv_kernels._one_gemm_windows

    def count_per_output(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray:
        seen["per_output"] += 1
        return per_output(x, w, g)

    depth = [0]  # im2col of large columns calls itself on chunks of images: count the outer call only

    def count_im2col(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray:
        before = seen["one_gemm"]
        depth[0] += 1
        try:
            y = im2col(x, w, g)
        finally:
            depth[0] -= 1
        if seen["one_gemm"] == before and depth[0] == 0:
            seen["rows" if g["flat_cols"] else "windows"] += 1
        return y

    def count_one_gemm(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray:
        seen["one_gemm"] += 1
        return one_gemm(x, w, g)

    def count_shifted(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray:
        seen["shifted"] += 1
        return shifted(x, w, g)

    monkeypatch.setattr(conv_kernels, "_per_output_conv", count_per_output)
    monkeypatch.setattr(conv_kernels, "_shifted_conv", count_shifted)
    monkeypatch.setattr(conv_kernels, "_im2col_conv", count_im2col)
    monkeypatch.setattr(conv_kernels, "_one_gemm_windows", count_one_gemm)
    return seen


@pytest.mark.parametrize("xs,ws,attrs,path", FORWARD.values(), ids=list(FORWARD))
def test_forward_conv_matches_onnxruntime(xs, ws, attrs, path, monkeypatch) -> None:
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
    seen = _count_paths(monkeypatch)
    y = conv_kernels.conv([x, w], Attrs(dict(attrs)))[0]
    assert seen == {p: int(p == path) for p in seen}
    want = _ort_conv(x, w, attrs)
    assert y.shape == want.shape and y.dtype == np.float32
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-5 * np.abs(want).max())
    # and about as close to the float64 Conv as onnxruntime's float32 sums are
    ref = _float64_conv(x, w, attrs)
    assert np.abs(y - ref).max() <= 4 * max(np.abs(want - ref).max(), 1e-7 * np.abs(ref).max())


def _float64_conv(x: np.ndarray, w: np.ndarray, attrs: dict[str, Any]) -> np.ndarray:
    """The Conv in float64 by torch."""
    nd = x.ndim - 2
    return _torch_conv(nd, False, attrs)(torch.tensor(x, dtype=torch.float64),
                                         torch.tensor(w, dtype=torch.float64)).numpy()


def test_per_output_conv_matches_im2col_bit_for_bit_in_float64() -> None:
    """Same products, same sums: the per-output GEMMs against the windowed im2col in float64."""
    rng = np.random.default_rng(3)
    for xs, ws, attrs, _ in list(FORWARD.values())[:5]:
        x, w = rng.standard_normal(xs), rng.standard_normal(ws)
        g = conv_kernels._conv_geometry(Attrs(dict(attrs)), x.shape, w.shape)
        got = conv_kernels._per_output_conv(x, w, g)
        want = conv_kernels._im2col_conv(x, w, {**g, "flat_cols": False})
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


def test_big_kernel_conv_needs_little_scratch() -> None:
    """A ConvTranspose 3-D's weight gradient (kernel 12³ dilated by 2, output 2³) without an im2col buffer:
    by rows its columns were 2 · 24² per kernel offset, 127 MB for these 1.8 MB of input."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((8, 2, 24, 24, 24)).astype(np.float32)
    w = rng.standard_normal((8, 2, 12, 12, 12)).astype(np.float32)
    attrs = Attrs({"dilations": [2, 2, 2]})
    tracemalloc.start()
    try:
        y = conv_kernels.conv([x, w], attrs)[0]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * (x.nbytes + w.nbytes), peak
    np.testing.assert_allclose(y, _ort_conv(x, w, {"dilations": [2, 2, 2]}), rtol=0, atol=1e-3)


@pytest.mark.parametrize("rank", [3, 5])
def test_fused_weight_grad_plan_1d_3d(rank: int) -> None:
    """The autodiff's weight-gradient pattern in 1-D and 3-D is one fused step, equal to the unfused Conv."""
    sp = list(range(2, rank))
    n = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, *sp]),
         helper.make_node("Transpose", ["dy"], ["dyt"], perm=[1, 0, *sp]),
         helper.make_node("Conv", ["xt", "dyt"], ["c"], pads=[1] * 2 * (rank - 2)),
         helper.make_node("Transpose", ["c"], ["dw"], perm=[1, 0, *sp])]
    graph = helper.make_graph(n, "g", [helper.make_tensor_value_info(v, 1, None) for v in ("x", "dy")],
                              [helper.make_tensor_value_info("dw", 1, None)])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    fused, plain = Plan(m), Plan(m, fuse=False)
    assert [st.node.op_type for st in fused.steps] == ["FusedConvWeightGrad"]
    rng = np.random.default_rng(5)
    sizes = (9, 8, 7)[: rank - 2]
    x = rng.standard_normal((3, 5, *sizes)).astype(np.float32)
    dy = rng.standard_normal((3, 4, *sizes)).astype(np.float32)
    got, want = fused.run({"x": x, "dy": dy})[0], plain.run({"x": x, "dy": dy})[0]
    assert got.shape == (4, 5, *([3] * (rank - 2))) and got.dtype == np.float32
    ref = plain.run({"x": x.astype(np.float64), "dy": dy.astype(np.float64)})[0]
    assert np.abs(got - ref).max() <= 4 * max(np.abs(want - ref).max(), 1e-7 * np.abs(ref).max())
    x[0, 1, 0] = np.inf  # an inf meets the padded zeros: the unfused Conv's NaNs, not a finite guess
    got, want = fused.run({"x": x, "dy": dy})[0], plain.run({"x": x, "dy": dy})[0]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n, ci, co, size, k",
                         [(9, 16, 16, 12, (3, 3)), (6, 4, 8, 10, (3, 5)), (5, 3, 4, 20, (4,))])
def test_shifted_weight_grad_splits_samples_over_threads_bit_for_bit(dtype, n, ci, co, size, k) -> None:
    """The shifted GEMMs' per-sample products run on the threads by sample groups (OpenBLAS on each calling
    thread) and are summed in sample order afterwards: the bits of one thread, and torch's gradient."""
    from onnxtrain.engine.parallel import recording_splits, running_with

    nd = len(k)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((n, ci, *[size] * nd)).astype(dtype)
    out = [size + 2 - kk + 1 for kk in k]  # padded by 1 on both sides, stride 1
    dy = rng.standard_normal((n, co, *out)).astype(dtype)
    xp = gemm._padded(x, [1] * nd * 2)
    assert gemm._shifted_grad_fits(xp, dy, list(k), [1] * nd)
    parts: list[int] = []
    with running_with(2), recording_splits(parts):
        two = gemm._weight_grad_shifted(xp, dy, list(k), [1] * nd)
    with running_with(1):
        one = gemm._weight_grad_shifted(xp, dy, list(k), [1] * nd)
    assert parts == [2]
    np.testing.assert_array_equal(two, one)
    conv = F.conv2d if nd == 2 else F.conv1d
    w = torch.zeros((co, ci, *k), dtype=torch.float64, requires_grad=True)
    y = conv(torch.from_numpy(x.astype(np.float64)), w, padding=1)
    y.backward(torch.from_numpy(dy.astype(np.float64)))
    np.testing.assert_allclose(two, w.grad.numpy(), rtol=1e-4 if dtype == np.float32 else 1e-10,
                               atol=1e-3 if dtype == np.float32 else 1e-9)
