"""The onnxruntime backend's weight-gradient rewrite (onnxtrain/engine/ort_conv_grads.py) of a Conv whose
dilation reaches past X (DeepLabV3's ASPP: 3×3 at dilations 12, 24, 36, padded by the dilation, over 4²
planes, where only the centre offset reads X): one product per live offset and a Pad for the dead ones' zeros.
Checked against torch's float64 autograd and the unrewritten graph, both run by onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine.ort_rewrites import rewrite_for_onnxruntime
from tests.engine.test_ort_conv_grads import conv_loss_model, reference

ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

# name: channels in, out, group, image, kernel, Conv attributes, live offsets (rows, columns)
CASES = {
    "aspp-d12": (8, 6, 1, (4, 4), (3, 3), {"dilations": [12, 12], "pads": [12] * 4}, ((1, 1), (1, 1))),
    # C·P ≥ 3·Q: the batch inside the one product
    "aspp-d36-fold": (64, 6, 1, (4, 4), (3, 3), {"dilations": [36, 36], "pads": [36] * 4}, ((1, 1), (1, 1))),
    # pads under the dilation: the live window starts inside X, at its row 3
    "inside-x": (4, 5, 1, (8, 16), (3, 3), {"dilations": [8, 1], "pads": [5, 1, 5, 1]}, ((1, 1), (0, 2))),
    # the last offsets dead, no pad left at all
    "last-dead": (4, 5, 1, (4, 4), (3, 3), {"dilations": [6, 6], "pads": [0, 0, 12, 12]}, ((0, 0), (0, 0))),
    # strided (the window's own step), one axis cut, the other whole
    "strided-rows": (3, 4, 1, (5, 6), (3, 3), {"strides": [2, 1], "dilations": [12, 1],
                                                "pads": [12, 1, 12, 1]}, ((1, 1), (0, 2))),
    # two live offsets of three on each axis: their block padded with zeros
    "two-of-three": (4, 6, 1, (4, 4), (3, 3), {"dilations": [3, 3], "pads": [0, 0, 6, 6]}, ((0, 1), (0, 1))),
    # depthwise, with a channel multiplier
    "depthwise-two-of-three": (4, 8, 4, (4, 4), (3, 3), {"dilations": [3, 3], "pads": [0, 0, 6, 6]},
                               ((0, 1), (0, 1))),
    "depthwise-d12": (3, 6, 3, (4, 4), (3, 3), {"dilations": [12, 12], "pads": [12] * 4}, ((1, 1), (1, 1))),
}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_dead_offsets_are_zeros_not_products(case: str) -> None:
    """One product (MatMul, or Mul for a depthwise Conv) per live offset, the rest zeros (by a product with a
    one-hot mask where each axis has one live offset or all, else by a Pad); the gradient equals torch's and
    the unrewritten graph's for several batch sizes, an empty one included."""
    c, o, group, hw, k, attrs, ((a0, b0), (a1, b1)) = CASES[case]
    model, w = conv_loss_model(c, o, hw, k, group=group, **attrs)
    grads = build_gradient_model(model, "loss", ["w"])
    new = rewrite_for_onnxruntime(grads)
    onnx.checker.check_model(new, full_check=True)
    ops = [n.op_type for n in new.graph.node]
    assert ops.count("Conv") == 1  # the forward's only: the weight gradient's is rewritten
    was = [n.op_type for n in grads.graph.node]
    product = "MatMul" if group == 1 else "Mul"
    live = (b0 - a0 + 1, b1 - a1 + 1)
    masked = all(v in (1, full) for v, full in zip(live, k, strict=True))
    assert ops.count(product) - was.count(product) == live[0] * live[1] + (masked and group > 1)
    zeros = [n for n in new.graph.node if n.op_type == ("Mul" if masked else "Pad")
             and any(("live_offsets" if masked else "dead_offsets") in i for i in n.input)]
    assert len(zeros) == 1 and zeros[0].output[0] in {i for n in new.graph.node for i in n.input}
    read = {i for n in new.graph.node for i in n.input}
    assert [t.name for t in new.graph.initializer if t.name not in read] == []
    sessions = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
                for m in (new, grads)]
    rng = np.random.default_rng(3)
    # (an empty batch: the autodiff's grouped weight gradient reshapes to [0, group, ·, -1], which ONNX
    # cannot resolve for 0 rows, rewritten or not)
    for batch in (2, 1, 0) if group == 1 else (2, 1):
        x = rng.standard_normal((batch, c, *hw)).astype(np.float32)
        wt = torch.from_numpy(w).double().requires_grad_()
        y = reference(x, wt, attrs, group)
        u = rng.standard_normal(tuple(y.shape)).astype(np.float32)
        (y * torch.from_numpy(u).double()).sum().backward()
        want = wt.grad.numpy()
        dead = np.ones(k, bool)
        dead[a0:b0 + 1, a1:b1 + 1] = False
        assert not want[..., dead].any()  # the oracle agrees that they read only padding
        got, before = (sess.run(None, {"x": x, "u": u})[1] for sess in sessions)
        tol = 1e-5 * max(1.0, np.abs(want).max())
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=tol)
        np.testing.assert_allclose(got, before, rtol=1e-5, atol=tol)
        assert not got[..., dead].any()


@pytest.mark.parametrize("k, attrs", [((3, 3), {"pads": [1] * 4}),
                                      ((3, 3), {"dilations": [3, 3], "pads": [3] * 4})], ids=str)
def test_every_offset_live_adds_no_zeros(k, attrs) -> None:
    """Every offset reads X somewhere (partly in the padding too): all nine products, no zeros put in."""
    model, _ = conv_loss_model(4, 4, (4, 4), k, **attrs)
    new = rewrite_for_onnxruntime(build_gradient_model(model, "loss", ["w"]))
    ops = [n.op_type for n in new.graph.node]
    assert ops.count("MatMul") == 9
    assert not any("_offsets" in i for n in new.graph.node for i in n.input)


def test_kernels_past_the_offset_limit_keep_their_conv_with_dead_offsets() -> None:
    """A 5×5 at dilation 2 over 4² (9 live offsets of 25): more than MAX_POSITIONS offsets, so its Conv
    stays, as without dead offsets (rewritten it ran 1.25× as long, 256 → 256 channels at batch 2)."""
    model, _ = conv_loss_model(4, 4, (4, 4), (5, 5), dilations=[2, 2], pads=[4] * 4)
    grads = build_gradient_model(model, "loss", ["w"])
    new = rewrite_for_onnxruntime(grads)
    assert [n.op_type for n in new.graph.node] == [n.op_type for n in grads.graph.node]
