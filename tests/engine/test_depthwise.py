"""The grouped-convolution kernels of engine/kernels/depthwise.py against torch and onnxruntime.

Depthwise Convs, ConvTransposes with one output channel per group (a depthwise Conv's input gradient)
and grouped Convs with fewer output positions than kernel offsets (its weight gradient) take these
kernels; the shapes here are big enough for several blocks of planes, and each is also run on two
threads, which must give the same bits as one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxtrain.engine import compile_model
from onnxtrain.engine.kernels import conv as conv_kernels
from onnxtrain.engine.parallel import running_with
from onnxtrain.engine.registry import Attrs

torch = pytest.importorskip("torch")
F = torch.nn.functional

# x shape, multiplier, kernel, strides, dilations, pads (begin + end)
DEPTHWISE = [
    ((3, 8, 20, 21), 1, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)),
    ((2, 6, 17, 16), 2, (3, 3), (2, 2), (1, 1), (1, 1, 1, 1)),
    ((2, 5, 15, 18), 1, (5, 3), (1, 2), (2, 1), (2, 0, 1, 1)),
    ((2, 4, 12, 13), 3, (3, 2), (3, 1), (1, 2), (0, 1, 2, 0)),
    ((2, 6, 40), 1, (5,), (2,), (1,), (2, 2)),
    ((2, 4, 7, 8, 9), 1, (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1, 1, 1, 1)),
    ((2, 4, 7, 8, 9), 2, (3, 2, 3), (2, 1, 2), (1, 2, 1), (1, 0, 1, 0, 1, 1)),
]


def _small(monkeypatch, block: int = 256) -> list[bool]:
    """These small cases through the kernels of depthwise.py, in blocks of ``block`` elements; returns the
    list that each depthwise call appends its layout to (True: channel-major)."""
    from onnxtrain.engine import parallel
    from onnxtrain.engine.kernels import depthwise

    for name, value in (("BLOCK", block), ("SCRATCH", block), ("CHANNEL_MAJOR_RUN", block),
                        ("MIN_DEPTHWISE", 0), ("MIN_TRANSPOSED", 0), ("MIN_WINDOW", 0)):
        monkeypatch.setattr(depthwise, name, value)
    monkeypatch.setattr(parallel, "MIN_ROWS_WORK", 1)  # two threads split even these small cases
    layouts: list[bool] = []
    lanes = depthwise._lanes

    def spy(*args: int) -> tuple[bool, int, int]:
        layouts.append(lanes(*args)[0])
        return lanes(*args)

    monkeypatch.setattr(depthwise, "_lanes", spy)
    return layouts


# blocks of 32 elements: plane by plane, a plane or less a block; 2,048: a few channels' planes a block;
# 65,536: every channel's planes in one run (each case's images are smaller than that)
BLOCKS = [32, 2048, 1 << 16]


def _check_layouts(layouts: list[bool], block: int, n: int) -> None:
    """The cases took the layout their block size is there for (several images: channel-major)."""
    assert layouts
    if block == BLOCKS[0]:
        assert not any(layouts)
    elif block == BLOCKS[-1]:
        assert all(layouts) == (n > 1)


def _conv_fn(nd: int, transposed: bool = False):
    return ((F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d) if transposed
            else (F.conv1d, F.conv2d, F.conv3d))[nd - 1]


def _run(op: str, inputs: list[np.ndarray], attrs: dict[str, Any], threads: int) -> np.ndarray:
    kernel = conv_kernels.conv if op == "Conv" else conv_kernels.conv_transpose
    with running_with(threads):
        return kernel(inputs, Attrs(attrs, op=op))[0]


def _both_widths(op: str, inputs: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    one = _run(op, inputs, attrs, 1)
    two = _run(op, inputs, attrs, 2)
    np.testing.assert_array_equal(one, two, err_msg="two threads changed the bits")
    return one


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("case", DEPTHWISE, ids=str)
def test_depthwise_conv_matches_torch(case, block, monkeypatch) -> None:
    xs, mult, k, s, d, p = case
    layouts = _small(monkeypatch, block)
    rng = np.random.default_rng(0)
    c, nd = xs[1], len(xs) - 2
    x, w, b = rng.standard_normal(xs), rng.standard_normal((c * mult, 1, *k)), rng.standard_normal(c * mult)
    attrs = {"group": c, "strides": list(s), "dilations": list(d), "pads": list(p)}
    y = _both_widths("Conv", [x, w, b], attrs)
    pads = [p[i] for i in range(nd)]
    if p[:nd] != p[nd:]:  # torch pads symmetrically: pad x by hand
        x_t = F.pad(torch.tensor(x), [v for i in reversed(range(nd)) for v in (p[i], p[nd + i])])
        pads = [0] * nd
    else:
        x_t = torch.tensor(x)
    ref = _conv_fn(nd)(x_t, torch.tensor(w), torch.tensor(b), stride=s, padding=pads, dilation=d, groups=c)
    np.testing.assert_allclose(y, ref.numpy(), rtol=1e-12, atol=1e-12)
    _check_layouts(layouts, block, xs[0])


# x shape, W shape (C, 1, k...), group, strides, dilations, pads, output_padding
DEPTHWISE_T = [
    ((2, 8, 11, 12), (8, 1, 3, 3), 8, (1, 1), (1, 1), (1, 1, 1, 1), (0, 0)),
    ((2, 6, 9, 10), (6, 1, 3, 3), 6, (2, 2), (1, 1), (1, 1, 1, 1), (1, 0)),
    ((2, 6, 9, 10), (6, 1, 3, 2), 3, (2, 1), (2, 2), (0, 1, 2, 0), (1, 0)),  # two inputs per group
    ((2, 4, 8, 7), (4, 1, 5, 3), 4, (1, 3), (2, 1), (2, 1, 2, 1), (0, 2)),
    ((2, 6, 30), (6, 1, 4), 6, (3,), (1,), (1, 2), (2,)),
    ((1, 4, 5, 6, 7), (4, 1, 3, 3, 3), 4, (1, 1, 1), (1, 1, 2), (1, 1, 1, 1, 1, 1), (0, 0, 0)),
    ((1, 4, 5, 6, 7), (4, 1, 2, 3, 2), 4, (2, 1, 2), (1, 1, 1), (0, 1, 0, 0, 1, 0), (1, 0, 1)),
]


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("case", DEPTHWISE_T, ids=str)
def test_depthwise_conv_transpose_matches_torch(case, block, monkeypatch) -> None:
    xs, ws, group, s, d, p, op = case
    layouts = _small(monkeypatch, block)
    rng = np.random.default_rng(1)
    nd = len(xs) - 2
    x, w, b = rng.standard_normal(xs), rng.standard_normal(ws), rng.standard_normal(group)
    attrs = {"group": group, "strides": list(s), "dilations": list(d), "pads": list(p),
             "output_padding": list(op)}
    y = _both_widths("ConvTranspose", [x, w, b], attrs)
    full = _conv_fn(nd, True)(torch.tensor(x), torch.tensor(w), torch.tensor(b), stride=s, dilation=d,
                              groups=group, output_padding=op)
    crop = tuple(slice(p[i], full.shape[2 + i] - p[nd + i]) for i in range(nd))
    np.testing.assert_allclose(y, full.numpy()[(Ellipsis,) + crop], rtol=1e-12, atol=1e-12)
    _check_layouts(layouts, block, xs[0])


# x shape, W shape, group, strides, dilations, pads: fewer output positions than kernel offsets
FEW_OUTPUTS = [
    ((1, 6, 12, 11), (3, 2, 10, 9), 3, (1, 1), (1, 1), (1, 1, 1, 1)),
    ((1, 8, 14, 13), (8, 2, 6, 6), 4, (1, 1), (2, 2), (1, 1, 1, 1)),
    ((2, 6, 13, 12), (8, 3, 9, 8), 2, (2, 1), (1, 1), (0, 1, 0, 1)),
    ((1, 4, 30), (4, 2, 25), 2, (2,), (1,), (1, 1)),
    ((1, 4, 7, 8, 6), (4, 1, 6, 7, 5), 4, (1, 1, 1), (1, 1, 1), (1, 1, 1, 1, 1, 1)),
]


@pytest.mark.parametrize("block", [256, 4096])  # one group a block; several (one image: blocks of groups)
@pytest.mark.parametrize("case", FEW_OUTPUTS, ids=str)
def test_few_outputs_conv_matches_torch(case, block, monkeypatch) -> None:
    xs, ws, group, s, d, p = case
    _small(monkeypatch, block)
    rng = np.random.default_rng(2)
    nd = len(xs) - 2
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    attrs = {"group": group, "strides": list(s), "dilations": list(d), "pads": list(p)}
    y = _both_widths("Conv", [x, w], attrs)
    assert int(np.prod(y.shape[2:])) < int(np.prod(ws[2:]))  # the case is what it says
    ref = _conv_fn(nd)(torch.tensor(x), torch.tensor(w), stride=s, padding=list(p[:nd]), dilation=d,
                       groups=group)
    np.testing.assert_allclose(y, ref.numpy(), rtol=1e-12, atol=1e-12)


def _depthwise_loss_model(xs: tuple[int, ...], c: int, stride: int) -> onnx.ModelProto:
    ys = (xs[0], c, (xs[2] - 1) // stride + 1, (xs[3] - 1) // stride + 1)
    rng = np.random.default_rng(3)
    w = onnx.numpy_helper.from_array((rng.standard_normal((c, 1, 3, 3)) * 0.3).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], group=c, pads=[1, 1, 1, 1], strides=[stride] * 2),
             helper.make_node("Mul", ["y", "u"], ["yu"]),
             helper.make_node("ReduceSum", ["yu"], ["loss"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "dw", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, xs),
                      helper.make_tensor_value_info("u", onnx.TensorProto.FLOAT, ys)],
        [helper.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, [])], initializer=[w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("stride", [1, 2])
def test_depthwise_gradients_in_float32_match_onnxruntime_and_torch(stride: int) -> None:
    """A MobileNet-sized depthwise layer's training graph: our kernels (many blocks, two threads in the
    plan) against onnxruntime running the same graph and torch autograd."""
    ort = pytest.importorskip("onnxruntime")
    from onnxtrain.autodiff import build_gradient_model

    xs, c = (4, 32, 40, 40), 32  # sizes that take depthwise.py's kernels unpatched
    model = _depthwise_loss_model(xs, c, stride)
    gm = build_gradient_model(model, "loss", ["x", "w"])
    onnx.checker.check_model(gm, full_check=True)
    rng = np.random.default_rng(4)
    x = rng.standard_normal(xs).astype(np.float32)
    out = (40 - 1) // stride + 1
    u = rng.standard_normal((4, c, out, out)).astype(np.float32)
    plan = compile_model(gm)
    ours = dict(zip([o.name for o in gm.graph.output], plan.run({"x": x, "u": u}), strict=True))
    sess = ort.InferenceSession(gm.SerializeToString(), providers=["CPUExecutionProvider"])
    theirs = dict(zip([o.name for o in gm.graph.output], sess.run(None, {"x": x, "u": u}), strict=True))
    w = onnx.numpy_helper.to_array(model.graph.initializer[0])
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    wt = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    y = F.conv2d(xt, wt, stride=stride, padding=1, groups=c)
    (y * torch.tensor(u, dtype=torch.float64)).sum().backward()
    for name, ref in (("x_grad", xt.grad.numpy()), ("w_grad", wt.grad.numpy())):
        scale = np.abs(ref).max()
        np.testing.assert_allclose(ours[name], ref, rtol=0, atol=2e-6 * scale, err_msg=name)
        np.testing.assert_allclose(ours[name], theirs[name], rtol=0, atol=2e-6 * scale, err_msg=name)


# x shape (an empty batch), W shape, group, pads: a few-outputs grouped Conv, depthwise 2-D and 3-D
EMPTY_BATCH = [
    ((0, 32, 15, 18), (4, 8, 15, 16), 4, (0, 1, 0, 2)),
    ((0, 32, 9, 6, 4), (64, 1, 7, 2, 7), 32, (2, 1, 1, 2, 0, 2)),
    ((0, 16, 20, 20), (16, 1, 3, 3), 16, (1, 1, 1, 1)),
    ((0, 8, 12, 11), (8, 2, 10, 9), 4, (1, 1, 1, 1)),
]


@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("case", EMPTY_BATCH, ids=str)
def test_grouped_conv_of_an_empty_batch_is_empty(case, small, monkeypatch) -> None:
    """A batch of no images through the grouped routes (as they are, and with every size threshold at its
    least) gives torch's empty output; the few-outputs route made a strided view past its empty buffer."""
    xs, ws, group, p = case
    if small:
        _small(monkeypatch)
    rng = np.random.default_rng(5)
    nd = len(xs) - 2
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    y = _both_widths("Conv", [x, w], {"group": group, "pads": list(p)})
    x_t = F.pad(torch.tensor(x), [v for i in reversed(range(nd)) for v in (p[i], p[nd + i])])
    ref = _conv_fn(nd)(x_t, torch.tensor(w), groups=group)
    assert y.shape == tuple(ref.shape) and y.dtype == x.dtype


# op, x shape, W shape, group, strides, pads: the routes whose products include zero taps (banded rows,
# the few-outputs dot products, the rows weight gradient, a stride-1 depthwise ConvTranspose by banded rows)
NON_FINITE = [
    ("Conv", (8, 64, 16, 16), (64, 1, 3, 3), 64, (1, 1), (1, 1, 1, 1)),
    ("Conv", (8, 64, 32, 32), (64, 1, 3, 3), 64, (2, 2), (1, 1, 1, 1)),
    ("Conv", (2, 8, 12, 11), (8, 2, 10, 9), 4, (1, 1), (1, 1, 1, 1)),
    ("Conv", (1, 8, 12, 11), (8, 2, 10, 9), 4, (1, 1), (1, 1, 1, 1)),
    ("Conv", (1, 8, 12, 11), (4, 2, 3, 3), 4, (1, 1), (1, 1, 1, 1)),
    ("ConvTranspose", (8, 64, 16, 16), (64, 1, 3, 3), 64, (1, 1), (1, 1, 1, 1)),
]


@pytest.mark.parametrize("case", NON_FINITE, ids=str)
def test_grouped_routes_keep_non_finite_inputs_in_their_windows(case) -> None:
    """An inf or NaN of X reaches only the outputs whose windows hold it, as in torch: the routes that
    multiply zero taps with X (inf · 0 = NaN) made NaNs of outputs far from it."""
    op, xs, ws, group, s, p = case
    rng = np.random.default_rng(6)
    nd = len(xs) - 2
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    x.reshape(-1)[rng.integers(0, x.size, 4)] = [np.inf, -np.inf, np.nan, np.inf]
    attrs = {"group": group, "strides": list(s), "pads": list(p)}
    with np.errstate(invalid="ignore"):
        y = _both_widths(op, [x, w], attrs)
    if op == "Conv":
        ref = _conv_fn(nd)(torch.tensor(x), torch.tensor(w), stride=s, padding=list(p[:nd]), groups=group)
    else:
        full = _conv_fn(nd, True)(torch.tensor(x), torch.tensor(w), stride=s, groups=group)
        ref = full[(Ellipsis,) + tuple(slice(p[i], full.shape[2 + i] - p[nd + i]) for i in range(nd))]
    ref = ref.numpy()
    assert np.isnan(ref).sum() < np.isinf(ref).sum()  # the case is what it says: infs, few NaNs
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)
