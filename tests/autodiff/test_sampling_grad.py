"""GridSample and AffineGrid gradient graphs against torch autograd in float64.

torch is the oracle where onnx.reference cannot be: the opset-16 mode names (bilinear, bicubic), which
onnx.reference does not know, and cubic border padding beyond the edge, where onnx.reference clamps the
coordinate and torch (with onnxruntime and the engine) does not. Grids here are plain random numbers
reaching well outside [-1, 1]. DeformConv has no torch op (no torchvision); it is covered by the op
table (finite differences, onnx.reference and onnxruntime) and here against a torch composition of
grid_sample and a matrix product. onnxruntime has float32 GridSample kernels only before opset 20, so
opset-17 gradient graphs run there in float32.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.testing import random_loss_model, run_engine

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _grad_model(op: str, inputs: list[np.ndarray | None], attrs: dict[str, Any], opset: int, wrt: list[int],
                batched: tuple[int, ...] = ()) -> tuple[onnx.ModelProto, dict[str, np.ndarray], np.ndarray]:
    """The gradient model of loss = Σ Y·U (U fixed random) w.r.t. inputs ``wrt``, its feeds and U; the
    inputs ``batched`` get a symbolic first dimension N."""
    names = [f"x{i}" if v is not None else "" for i, v in enumerate(inputs)]
    node = helper.make_node(op, names, ["y"], **attrs)

    def info(i: int, v: np.ndarray) -> onnx.ValueInfoProto:
        shape = ["N", *v.shape[1:]] if i in batched else list(v.shape)
        return helper.make_tensor_value_info(names[i], helper.np_dtype_to_tensor_dtype(v.dtype), shape)

    graph = helper.make_graph([node], op, [info(i, v) for i, v in enumerate(inputs) if v is not None],
                              [helper.make_empty_tensor_value_info("y")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)
    feeds = {n: v for n, v in zip(names, inputs) if n}
    y = run_engine(model, feeds)[0]
    lmodel = random_loss_model(model, [y.shape], [0], dtype=y.dtype)
    u = numpy_helper.to_array(next(t for t in lmodel.graph.initializer if t.name == "u0"))
    gmodel = build_gradient_model(lmodel, "loss", [names[i] for i in wrt])
    onnx.checker.check_model(gmodel, full_check=True)
    return gmodel, feeds, u


def _grads(op: str, inputs: list[np.ndarray | None], attrs: dict[str, Any], opset: int,
           wrt: list[int], batched: tuple[int, ...] = ()) -> tuple[dict[int, np.ndarray], np.ndarray]:
    """Our gradients w.r.t. inputs ``wrt`` (see ``_grad_model``), and U."""
    gmodel, feeds, u = _grad_model(op, inputs, attrs, opset, wrt, batched)
    outs = dict(zip([o.name for o in gmodel.graph.output], run_engine(gmodel, feeds)))
    return {i: outs[f"x{i}_grad"] for i in wrt}, u


def _torch_grads(fn, inputs: list[np.ndarray | None], u: np.ndarray) -> list[np.ndarray | None]:
    ts = [None if v is None else torch.tensor(v, requires_grad=True) for v in inputs]
    y = fn(*ts)
    assert tuple(y.shape) == u.shape
    (y * torch.tensor(u)).sum().backward()
    return [None if t is None else t.grad.numpy() for t in ts]


_TORCH_MODE = {"bilinear": "bilinear", "linear": "bilinear", "nearest": "nearest", "bicubic": "bicubic",
               "cubic": "bicubic"}

GRID = [  # X shape, grid's spatial shape, mode, padding, align_corners, opset
    ((2, 3, 5, 6), (4, 3), "bilinear", "zeros", 0, 17),
    ((2, 3, 5, 6), (4, 3), "bilinear", "border", 1, 17),
    ((1, 2, 4, 7), (3, 5), "bilinear", "reflection", 0, 16),
    ((1, 2, 4, 7), (3, 5), "bilinear", "reflection", 1, 17),
    ((2, 2, 5, 4), (3, 3), "nearest", "zeros", 1, 17),
    ((2, 2, 5, 4), (3, 3), "nearest", "reflection", 0, 17),
    ((1, 2, 6, 5), (4, 4), "bicubic", "zeros", 0, 17),
    ((1, 2, 6, 5), (4, 4), "bicubic", "border", 1, 17),
    ((1, 2, 6, 5), (4, 4), "bicubic", "reflection", 0, 16),
    ((1, 2, 5, 5), (3, 4), "cubic", "border", 0, 20),
    ((2, 2, 3, 4, 5), (2, 3, 2), "linear", "zeros", 1, 20),
    ((1, 2, 4, 3, 5), (3, 2, 2), "linear", "border", 0, 20),
    ((1, 2, 4, 3, 5), (3, 2, 2), "linear", "reflection", 1, 20),
    ((1, 1, 3, 4, 2), (2, 2, 2), "nearest", "border", 0, 20),
]


@pytest.mark.parametrize("xs, out, mode, padding, align, opset", GRID,
                         ids=[f"{m}-{p}-ac{a}-{len(x) - 2}d-v{o}" for x, _, m, p, a, o in GRID])
def test_grid_sample_grad_vs_torch(xs, out, mode, padding, align, opset) -> None:
    rng = np.random.default_rng(len(xs) * 100 + opset + align)
    x = rng.standard_normal(xs)
    grid = rng.uniform(-2.2, 2.2, (xs[0], *out, len(xs) - 2))  # reaches about a pixel size beyond the edges
    attrs = {"mode": mode, "padding_mode": padding, "align_corners": align}
    ours, u = _grads("GridSample", [x, grid], attrs, opset, [0, 1])

    def fn(a, b):
        return F.grid_sample(a, b, mode=_TORCH_MODE[mode], padding_mode=padding, align_corners=bool(align))

    dx, dgrid = _torch_grads(fn, [x, grid], u)
    np.testing.assert_allclose(ours[0], dx, rtol=1e-10, atol=1e-12, err_msg="dX")
    np.testing.assert_allclose(ours[1], dgrid, rtol=1e-9, atol=1e-11, err_msg="dgrid")
    if mode == "nearest":
        assert not np.any(ours[1])
    else:
        assert np.abs(ours[1]).max() > 0.1


def test_grid_sample_grad_dynamic_batch() -> None:
    rng = np.random.default_rng(7)
    x, grid = rng.standard_normal((3, 2, 4, 5)), rng.uniform(-1.5, 1.5, (3, 2, 6, 2))
    attrs = {"mode": "linear", "padding_mode": "reflection", "align_corners": 0}
    ours, u = _grads("GridSample", [x, grid], attrs, 20, [0, 1], batched=(0, 1))
    dx, dgrid = _torch_grads(lambda a, b: F.grid_sample(a, b, padding_mode="reflection", align_corners=False),
                             [x, grid], u)
    np.testing.assert_allclose(ours[0], dx, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ours[1], dgrid, rtol=1e-9, atol=1e-11)


# a unit-size axis with align_corners=1 is left out: torch puts its point at 0 (and warns the case is not
# meant to be used), onnx.reference and the engine at -1, onnxruntime at +1
AFFINE = [((2, 3, 4, 5), 0), ((2, 3, 4, 5), 1), ((3, 1, 1, 6), 0), ((2, 2, 3, 4, 5), 0), ((2, 2, 3, 4, 5), 1),
          ((1, 1, 1, 2, 3), 0)]


@pytest.mark.parametrize("size, align", AFFINE, ids=[f"{s}-ac{a}" for s, a in AFFINE])
def test_affine_grid_grad_vs_torch(size, align) -> None:
    rng = np.random.default_rng(sum(size) + align)
    r = len(size) - 2
    theta = rng.standard_normal((size[0], r, r + 1))
    ours, u = _grads("AffineGrid", [theta, np.array(size, dtype=np.int64)], {"align_corners": align}, 20, [0])
    (dtheta,) = _torch_grads(lambda t: F.affine_grid(t, list(size), align_corners=bool(align)), [theta], u)
    np.testing.assert_allclose(ours[0], dtheta, rtol=1e-10, atol=1e-12)


def test_spatial_transformer_chain_vs_torch() -> None:
    """AffineGrid feeding GridSample (a spatial transformer): dX and dθ through both rules."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 5, 6))
    theta = np.array([[[0.9, -0.3, 0.1], [0.2, 1.1, -0.2]], [[1.2, 0.4, 0.3], [-0.5, 0.8, 0.1]]])
    nodes = [helper.make_node("AffineGrid", ["theta", "size"], ["grid"], align_corners=0),
             helper.make_node("GridSample", ["x", "grid"], ["y"], padding_mode="border")]
    size = numpy_helper.from_array(np.array([2, 3, 4, 4], dtype=np.int64), "size")
    graph = helper.make_graph(nodes, "stn", [helper.make_tensor_value_info("x", 11, x.shape),
                                             helper.make_tensor_value_info("theta", 11, theta.shape)],
                              [helper.make_empty_tensor_value_info("y")], [size])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=9)
    feeds = {"x": x, "theta": theta}
    lmodel = random_loss_model(model, [(2, 3, 4, 4)], [0], dtype=np.float64)
    u = numpy_helper.to_array(next(t for t in lmodel.graph.initializer if t.name == "u0"))
    gmodel = build_gradient_model(lmodel, "loss", ["x", "theta"])
    outs = dict(zip([o.name for o in gmodel.graph.output], run_engine(gmodel, feeds)))

    def fn(a, t):
        return F.grid_sample(a, F.affine_grid(t, [2, 3, 4, 4], align_corners=False), padding_mode="border",
                             align_corners=False)

    dx, dtheta = _torch_grads(fn, [x, theta], u)
    np.testing.assert_allclose(outs["x_grad"], dx, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(outs["theta_grad"], dtheta, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("mode, padding, align", [("bilinear", "reflection", 0), ("bicubic", "border", 1),
                                                  ("nearest", "zeros", 0), ("bilinear", "zeros", 1)])
def test_opset17_gradient_graph_on_onnxruntime(mode: str, padding: str, align: int) -> None:
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 3, 5, 6)).astype(np.float32)
    grid = rng.uniform(-2, 2, (2, 4, 3, 2)).astype(np.float32)
    attrs = {"mode": mode, "padding_mode": padding, "align_corners": align}
    gmodel, feeds, _ = _grad_model("GridSample", [x, grid], attrs, 17, [0, 1])
    ours = run_engine(gmodel, feeds)
    sess = ort.InferenceSession(gmodel.SerializeToString(), providers=["CPUExecutionProvider"])
    for o, a, b in zip(gmodel.graph.output, ours, sess.run(None, feeds)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=o.name)


def _torch_deform_conv(x, w, off, b, mask, *, group: int, og: int, strides, pads, dil):
    """DeformConv composed of torch ops: grid_sample (align_corners, zero padding) at the deformed
    positions of each kernel tap, the mask, and a grouped matrix product."""
    n, c, h, wd = x.shape
    m, _, kh, kw = w.shape
    oh, ow = off.shape[2:]
    ki, kj, oi, oj = np.meshgrid(np.arange(kh), np.arange(kw), np.arange(oh), np.arange(ow), indexing="ij")
    base = np.stack([ki * dil[0] + oi * strides[0] - pads[0], kj * dil[1] + oj * strides[1] - pads[1]], -1)
    base = torch.tensor(base.reshape(kh * kw, oh * ow, 2), dtype=x.dtype)
    pos = off.reshape(n, og, kh * kw, 2, oh * ow).permute(0, 1, 2, 4, 3) + base  # (N, og, K, P, [h, w])
    grid = torch.stack([pos[..., 1] / (wd - 1) * 2 - 1, pos[..., 0] / (h - 1) * 2 - 1], -1)
    samp = F.grid_sample(x.reshape(n * og, c // og, h, wd), grid.reshape(n * og, kh * kw, oh * ow, 2),
                         mode="bilinear", padding_mode="zeros", align_corners=True)
    cols = samp.reshape(n, og, c // og, kh * kw, oh * ow)
    if mask is not None:
        cols = cols * mask.reshape(n, og, 1, kh * kw, oh * ow)
    y = w.reshape(group, m // group, -1) @ cols.reshape(n, group, -1, oh * ow)
    y = y.reshape(n, m, oh, ow)
    return y if b is None else y + b.reshape(1, m, 1, 1)


@pytest.mark.parametrize("group, og, strides, pads, dil, mask, bias, dynamic", [
    (1, 1, [1, 1], [0, 0, 0, 0], [1, 1], False, False, False),
    (2, 2, [2, 1], [1, 0, 1, 2], [1, 2], True, True, False),
    (1, 2, [1, 2], [1, 1, 1, 1], [2, 1], True, False, True),
])
def test_deform_conv_grad_vs_torch(group, og, strides, pads, dil, mask, bias, dynamic) -> None:
    rng = np.random.default_rng(group + 3 * og)
    n, c, h, wd, m, k = 2, 4, 6, 7, 4, (3, 2)
    out = [(h + pads[0] + pads[2] - (k[0] - 1) * dil[0] - 1) // strides[0] + 1,
           (wd + pads[1] + pads[3] - (k[1] - 1) * dil[1] - 1) // strides[1] + 1]
    inputs = [rng.standard_normal((n, c, h, wd)), rng.standard_normal((m, c // group, *k)),
              rng.uniform(-2.5, 2.5, (n, og * 6 * 2, *out)), rng.standard_normal(m) if bias else None,
              rng.uniform(0, 1, (n, og * 6, *out)) if mask else None]
    attrs = {"group": group, "offset_group": og, "strides": strides, "pads": pads, "dilations": dil}
    wrt = [i for i, v in enumerate(inputs) if v is not None]
    ours, u = _grads("DeformConv", inputs, attrs, 19, wrt, batched=(0, 2, 4) if dynamic else ())
    theirs = _torch_grads(lambda *t: _torch_deform_conv(*t, group=group, og=og, strides=strides, pads=pads,
                                                        dil=dil), inputs, u)
    for i in wrt:
        np.testing.assert_allclose(ours[i], theirs[i], rtol=1e-8, atol=1e-10, err_msg=f"input {i}")


def test_float16_grid_gradient_computes_coordinates_in_float32() -> None:
    """A float16 grid's pixel coordinates are computed in float32 by the kernel and by the rule: the
    grid gradient of the float16 graph stays close to the float32 graph's at the same (float16) values,
    where float16 coordinate arithmetic (1/32 pixel at 30 pixels) would move the taps' slopes."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 2, 30, 30)).astype(np.float16)
    grid = rng.uniform(-0.97, 0.97, (2, 6, 6, 2)).astype(np.float16)
    attrs = {"mode": "bilinear", "padding_mode": "zeros", "align_corners": 0}
    g16, _ = _grads("GridSample", [x, grid], attrs, 16, [0, 1])
    g32, _ = _grads("GridSample", [x.astype(np.float32), grid.astype(np.float32)], attrs, 16, [0, 1])
    for i in (0, 1):
        assert g16[i].dtype == np.float16
        err = np.abs(g16[i].astype(np.float32) - g32[i]).max() / np.abs(g32[i]).max()
        assert err < 4e-3, (i, err)  # without the float32 coordinates: 1.3e-2 on the grid
