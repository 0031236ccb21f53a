"""A depthwise Conv's weight gradient rewritten for onnxruntime (onnxtrain/engine/ort_conv_grads.py): per
kernel offset, a window of X times dY summed; against the unrewritten graph on onnxruntime and torch."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto
from onnx.reference import ReferenceEvaluator

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine.ort_rewrites import rewrite_for_onnxruntime
from tests.engine.test_ort_conv_grads import conv_loss_model, reference, run

ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

CASES = [  # channels, channel multiplier, image, kernel, Conv attributes
    (4, 1, (9, 8), (3, 3), {"pads": [1, 1, 1, 1]}),
    (3, 2, (11, 10), (3, 3), {"pads": [1, 0, 2, 1]}),
    (4, 2, (12, 12), (3, 2), {"dilations": [2, 1]}),
    (5, 1, (10, 9), (2, 3), {"pads": [0, 2, 1, 0], "dilations": [1, 2]}),
    (2, 3, (7, 9), (1, 1), {}),  # one position
]


def weight_grad_convs(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The grouped Convs reading no initializer: the autodiff's weight gradients."""
    inits = {t.name for t in model.graph.initializer}
    return [n for n in model.graph.node if n.op_type == "Conv" and not set(n.input) & inits]


def torch_weight_grad(x: np.ndarray, w: np.ndarray, u: np.ndarray, attrs: dict, group: int) -> np.ndarray:
    wt = torch.from_numpy(w).double().requires_grad_()
    (reference(x, wt, attrs, group) * torch.from_numpy(u).double()).sum().backward()
    return wt.grad.numpy()


@pytest.mark.parametrize("c, mult, hw, k, attrs", CASES, ids=str)
def test_depthwise_weight_gradient_rewritten_matches_torch(c, mult, hw, k, attrs) -> None:
    """float32 (onnxruntime has no float64 Conv): the rewritten graph, the autodiff's one and torch's float64
    autograd agree."""
    model, w = conv_loss_model(c, c * mult, hw, k, group=c, **attrs)
    grads = build_gradient_model(model, "loss", ["w"])
    assert len(weight_grad_convs(grads)) == 1
    new = rewrite_for_onnxruntime(grads)
    onnx.checker.check_model(new, full_check=True)
    ops = [n.op_type for n in new.graph.node]
    assert weight_grad_convs(new) == []
    was = [n.op_type for n in grads.graph.node]
    assert ops.count("Mul") - was.count("Mul") == k[0] * k[1]  # one per kernel offset
    assert ops.count("Slice") - was.count("Slice") == (k[0] * k[1] if k != (1, 1) else 0) + 1  # + dY's first
    read = {i for n in new.graph.node for i in n.input}
    assert [t.name for t in new.graph.initializer if t.name not in read] == []
    rng = np.random.default_rng(1)
    for batch in (3, 1):
        x = rng.standard_normal((batch, c, *hw)).astype(np.float32)
        u = rng.standard_normal(tuple(reference(x, w, attrs, c).shape)).astype(np.float32)
        want = torch_weight_grad(x, w, u, attrs, c)
        before, after = (run(g, {"x": x, "u": u})[1] for g in (grads, new))
        for got in (before, after):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-6 * np.abs(before).max())


@pytest.mark.parametrize("c, group, attrs", [(4, 4, {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
                                             (4, 2, {"pads": [1, 1, 1, 1]})], ids=str)
def test_strided_and_grouped_convolutions_are_left_alone(c, group, attrs) -> None:
    """A stride-2 depthwise Conv (slower rewritten: 6.8 → 12.7 ms a step at 16×144×16×16) and a grouped,
    not depthwise, one: the autodiff's graph as it is, still right."""
    model, w = conv_loss_model(c, c, (9, 9), (3, 3), group=group, **attrs)
    grads = build_gradient_model(model, "loss", ["w"])
    new = rewrite_for_onnxruntime(grads)
    assert len(weight_grad_convs(new)) == 1
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, c, 9, 9)).astype(np.float32)
    u = rng.standard_normal(tuple(reference(x, w, attrs, group).shape)).astype(np.float32)
    want = torch_weight_grad(x, w, u, attrs, group)
    np.testing.assert_allclose(run(new, {"x": x, "u": u})[1], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_depthwise_weight_gradient_in_float64() -> None:
    """float64 (onnxruntime has no float64 Conv: the rewritten graph run by onnx.reference) against torch."""
    c, attrs = 3, {"pads": [1, 1, 1, 1]}
    model, w = conv_loss_model(c, c, (8, 7), (3, 3), group=c, dtype=TensorProto.DOUBLE, **attrs)
    new = rewrite_for_onnxruntime(build_gradient_model(model, "loss", ["w"]))
    onnx.checker.check_model(new, full_check=True)
    assert weight_grad_convs(new) == []
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, c, 8, 7))
    u = rng.standard_normal(tuple(reference(x, w, attrs, c).shape))
    got = ReferenceEvaluator(new).run(None, {"x": x, "u": u})[1]
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, torch_weight_grad(x, w, u, attrs, c), rtol=1e-12, atol=1e-12)
