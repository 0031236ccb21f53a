"""A depthwise Conv's weight gradient read straight from X and dY (engine/fusion/grouped_weight_grad.py):
the gradient builder's Reshape/Transpose layout of X and dY goes, the same sums stay. Gradients against
torch autograd and bit-equal to the unfused plan, on one and two threads."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine.plan import Plan

torch = pytest.importorskip("torch")

FUSED = "FusedDepthwiseWeightGrad"


def conv_loss_grads(xs: tuple[int, ...], ws: tuple[int, ...], group: int, strides: list[int],
                    dilations: list[int], pads: list[int], dtype: type = np.float32) -> onnx.ModelProto:
    """loss = Σ Conv(x, w)² with the gradients of x and w (the gradient builder's graph)."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    w = (np.random.default_rng(0).standard_normal(ws) * 0.3).astype(dtype)
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], group=group, strides=strides, dilations=dilations,
                              pads=pads),
             helper.make_node("Mul", ["y", "y"], ["y2"]),
             helper.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", elem, xs)],
                              [helper.make_tensor_value_info("loss", elem, [])],
                              initializer=[numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    grads = build_gradient_model(model, "loss", ["x", "w"])
    onnx.checker.check_model(grads, full_check=True)
    return grads


def torch_grads(x: np.ndarray, w: np.ndarray, group: int, strides: list[int], dilations: list[int],
                pads: list[int]) -> tuple[np.ndarray, np.ndarray]:
    nd = x.ndim - 2
    xt = torch.tensor(x, requires_grad=True)
    wt = torch.tensor(w, requires_grad=True)
    xp = torch.nn.functional.pad(xt, [v for i in reversed(range(nd)) for v in (pads[i], pads[nd + i])])
    conv = (torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d)[nd - 1]
    y = conv(xp, wt, stride=strides, dilation=dilations, groups=group)
    (y * y).sum().backward()
    return xt.grad.numpy(), wt.grad.numpy()


# x shape, channel multiplier, kernel, strides, dilations, pads (begin + end): the depthwise kernels' routes
# (few outputs over wide planes, row products over narrow ones), strided, dilated, uneven pads, 1-D and 3-D
CASES = [
    ((4, 8, 20, 20), 1, (3, 3), [2, 2], [1, 1], [1, 1, 1, 1]),
    ((3, 6, 19, 17), 2, (3, 3), [1, 1], [1, 1], [1, 1, 1, 1]),
    ((2, 5, 21, 18), 1, (5, 3), [2, 1], [1, 2], [2, 0, 1, 3]),
    ((8, 16, 8, 8), 1, (7, 7), [1, 1], [1, 1], [3, 3, 3, 3]),
    ((2, 6, 80), 1, (5,), [2], [1], [2, 2]),
    ((2, 4, 9, 8, 10), 1, (3, 3, 3), [1, 2, 1], [1, 1, 1], [1, 1, 1, 1, 1, 1]),
    # strided with no end pads: computing only the kernel's taps means reading less of X (fusion's _cut)
    ((3, 6, 21, 22), 1, (3, 3), [2, 2], [1, 1], [1, 1, 0, 0]),
]


def taken(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each call of the depthwise kernels' weight gradient from now on took it (else None)."""
    from onnxtrain.engine.kernels import depthwise

    answers: list[bool] = []
    real = depthwise.weight_grad_planes

    def spy(*args):
        y = real(*args)
        answers.append(y is not None)
        return y

    monkeypatch.setattr(depthwise, "weight_grad_planes", spy)
    return answers


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_depthwise_weight_grad_fused(case, threads, monkeypatch) -> None:
    xs, mult, k, s, d, p = case
    answers = taken(monkeypatch)
    c = xs[1]
    grads = conv_loss_grads(xs, (c * mult, 1, *k), c, s, d, p)
    fused, plain = Plan(grads, threads=threads), Plan(grads, fuse=False, threads=threads)
    ops = [st.node.op_type for st in fused.steps]
    assert FUSED in ops and "Reshape" not in ops  # X's and dY's layout copies are gone
    x = np.random.default_rng(1).standard_normal(xs).astype(np.float32)
    (loss, dx, dw), (loss0, dx0, dw0) = fused.run({"x": x}), plain.run({"x": x})
    assert loss == loss0
    assert answers == [True]
    np.testing.assert_array_equal(dw, dw0)  # the same sums in the same order
    np.testing.assert_array_equal(dx, dx0)
    w = onnx.numpy_helper.to_array(grads.graph.initializer[0])
    want_dx, want_dw = torch_grads(x.astype(np.float64), w.astype(np.float64), c, s, d, p)
    np.testing.assert_allclose(dw, want_dw, rtol=2e-5, atol=2e-5 * np.abs(want_dw).max())
    np.testing.assert_allclose(dx, want_dx, rtol=2e-5, atol=2e-5 * np.abs(want_dx).max())


@pytest.mark.parametrize("case", [c for c in CASES if max(c[3]) > 1], ids=str)
def test_strided_weight_grad_computes_only_the_kernel(case, monkeypatch) -> None:
    """A strided Conv's weight gradient is a longer kernel the gradient builder crops with a Slice: the fused
    step takes the Slice in and the depthwise kernels compute the kernel's own taps (values: above)."""
    from onnxtrain.engine.kernels import depthwise

    xs, mult, k, s, d, p = case
    outs: list[list[int]] = []
    real = depthwise.weight_grad_planes
    monkeypatch.setattr(depthwise, "weight_grad_planes",
                        lambda xv, wv, g: outs.append(g["out"]) or real(xv, wv, g))
    grads = conv_loss_grads(xs, (xs[1] * mult, 1, *k), xs[1], s, d, p)
    assert "Slice" in [n.op_type for n in grads.graph.node]
    fused = Plan(grads)
    assert "Slice" not in [st.node.op_type for st in fused.steps]
    fused.run({"x": np.random.default_rng(4).standard_normal(xs).astype(np.float32)})
    assert outs == [list(k)]


def test_float64_matches_torch() -> None:
    xs, c = (3, 8, 16, 15), 8
    grads = conv_loss_grads(xs, (c, 1, 3, 3), c, [2, 2], [1, 1], [1, 1, 1, 1], np.float64)
    fused = Plan(grads)
    assert FUSED in [st.node.op_type for st in fused.steps]
    x = np.random.default_rng(2).standard_normal(xs)
    _, _, dw = fused.run({"x": x})
    w = onnx.numpy_helper.to_array(grads.graph.initializer[0])
    np.testing.assert_allclose(dw, torch_grads(x, w, c, [2, 2], [1, 1], [1, 1, 1, 1])[1], rtol=1e-12,
                               atol=1e-12)


def test_kernels_declining_run_the_original_steps(monkeypatch) -> None:
    """Planes smaller than the kernel: no depthwise route takes the weight gradient, the original steps do."""
    answers = taken(monkeypatch)
    xs, c = (2, 4, 2, 2), 4
    grads = conv_loss_grads(xs, (c, 1, 3, 3), c, [1, 1], [1, 1], [1, 1, 1, 1])
    fused, plain = Plan(grads), Plan(grads, fuse=False)
    assert FUSED in [st.node.op_type for st in fused.steps]
    x = np.random.default_rng(3).standard_normal(xs).astype(np.float32)
    dw = fused.run({"x": x})[2]
    assert answers == [False]
    np.testing.assert_array_equal(dw, plain.run({"x": x})[2])
    w = onnx.numpy_helper.to_array(grads.graph.initializer[0])
    want = torch_grads(x.astype(np.float64), w.astype(np.float64), c, [1, 1], [1, 1], [1, 1, 1, 1])[1]
    np.testing.assert_allclose(dw, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def test_grouped_conv_with_several_channels_a_group_is_left() -> None:
    xs, group = (2, 8, 12, 12), 4
    grads = conv_loss_grads(xs, (8, 2, 3, 3), group, [1, 1], [1, 1], [1, 1, 1, 1])
    fused = Plan(grads)
    assert FUSED not in [st.node.op_type for st in fused.steps]
    x = np.random.default_rng(4).standard_normal(xs).astype(np.float32)
    w = onnx.numpy_helper.to_array(grads.graph.initializer[0])
    want = torch_grads(x.astype(np.float64), w.astype(np.float64), group, [1, 1], [1, 1], [1, 1, 1, 1])[1]
    np.testing.assert_allclose(fused.run({"x": x})[2], want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
