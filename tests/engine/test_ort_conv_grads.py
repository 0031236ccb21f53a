"""A Conv's weight gradient rewritten for onnxruntime (onnxtrain/engine/ort_conv_grads.py): the gradient graph
of the autodiff, run by onnxruntime before and after the rewrite, against torch."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine.ort_rewrites import rewrite_for_onnxruntime

ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")


def conv_loss_model(c: int, o: int, hw: tuple[int, int], k: tuple[int, int], group: int = 1,
                    dtype: int = TensorProto.FLOAT, **attrs) -> tuple[onnx.ModelProto, np.ndarray]:
    """loss = Σ Conv(X, W)·U, X and U of dynamic batch; returns the model and W."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((o, c // group, *k)).astype(helper.tensor_dtype_to_np_dtype(dtype))
    out = reference(np.zeros((1, c, *hw)), w, attrs, group).shape[2:]
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], group=group, **attrs),
             helper.make_node("Mul", ["y", "u"], ["yu"]),
             helper.make_node("ReduceSum", ["yu"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", dtype, ["N", c, *hw]),
                                          helper.make_tensor_value_info("u", dtype, ["N", o, *out])],
                          [helper.make_tensor_value_info("loss", dtype, [])],
                          [numpy_helper.from_array(w, "w")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), w


def run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


CASES = [  # channels in, out, image, kernel, Conv attributes, the batch inside the products (FOLD_RATIO)
    (4, 6, (9, 8), (3, 3), {"pads": [1, 1, 1, 1]}, False),
    (3, 5, (11, 10), (3, 3), {"pads": [1, 0, 2, 1], "strides": [2, 2]}, False),
    (4, 4, (12, 12), (3, 2), {"dilations": [2, 1], "strides": [1, 2]}, False),
    (2, 3, (7, 9), (1, 1), {}, False),  # a 1×1 Conv: one position
    (40, 6, (3, 4), (1, 1), {}, True),  # C·P = 40 against Q = 12
    (12, 5, (4, 4), (3, 3), {"pads": [1, 1, 1, 1]}, True),  # 108 against 16
    (24, 4, (7, 6), (3, 3), {"pads": [1, 0, 1, 1], "strides": [2, 2]}, True),  # a longer kernel, cut after
]


@pytest.mark.parametrize("c, o, hw, k, attrs, folded", CASES, ids=str)
def test_rewritten_weight_gradient_matches_torch(c, o, hw, k, attrs, folded) -> None:
    """float32 (onnxruntime has no float64 Conv)."""
    dtype = TensorProto.FLOAT
    model, w = conv_loss_model(c, o, hw, k, dtype=dtype, **attrs)
    grads = build_gradient_model(model, "loss", ["w"])
    new = rewrite_for_onnxruntime(grads)
    assert new is not grads
    onnx.checker.check_model(new, full_check=True)
    made_by = {out: n for n in new.graph.node for out in n.output}
    transposed = {out for out, n in made_by.items() if n.op_type == "Transpose"}
    assert not any(n.op_type == "Conv" and set(n.input) <= transposed for n in new.graph.node)
    assert "MatMul" in [n.op_type for n in new.graph.node]
    read = {i for n in new.graph.node for i in n.input}
    assert [t.name for t in new.graph.initializer if t.name not in read] == []  # onnxruntime would warn
    rng = np.random.default_rng(1)
    npt = helper.tensor_dtype_to_np_dtype(dtype)
    # folded: the batch summed inside each offset's product, dY as (O, N·Q) made once, no (N, O, C) products
    # summed over the batch after (onnxruntime's ReduceSum over a leading axis: 7 ms of a 1×1 Conv's 10.6 ms
    # gradient at batch 8); else per-sample products and that sum
    products = [n for n in new.graph.node if n.op_type == "MatMul" and "/product_" in n.output[0]]
    assert products and len({n.input[0] for n in products}) == 1
    assert (made_by[made_by[products[0].input[0]].input[0]].op_type == "Transpose") == folded
    summed = {made_by[n.input[0]].op_type for n in new.graph.node if n.op_type == "ReduceSum"}
    assert bool(summed & {"MatMul", "Concat", "Unsqueeze"}) != folded
    for batch in (3, 1, 0):  # one graph, several batch sizes (an empty batch: a zero gradient)
        x = rng.standard_normal((batch, c, *hw)).astype(npt)
        wt = torch.from_numpy(w).double().requires_grad_()
        y = reference(x, wt, attrs)
        u = rng.standard_normal(tuple(y.shape)).astype(npt)
        (y * torch.from_numpy(u).double()).sum().backward()
        want = wt.grad.numpy()
        tol = 1e-5
        for graph in (grads, new):
            got = run(graph, {"x": x, "u": u})[1]
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def reference(x: np.ndarray, w, attrs: dict, group: int = 1):
    """torch's Conv of float64 ``x`` (padded by hand: ONNX's pads may differ at the two ends)."""
    pt, pl, pb, pr = attrs.get("pads", [0, 0, 0, 0])
    xt = torch.nn.functional.pad(torch.from_numpy(np.asarray(x, np.float64)), (pl, pr, pt, pb))
    wt = w if isinstance(w, torch.Tensor) else torch.from_numpy(np.asarray(w, np.float64))
    return torch.nn.functional.conv2d(xt, wt, stride=attrs.get("strides", 1),
                                      dilation=attrs.get("dilations", 1), groups=group)


@pytest.mark.parametrize("k, group", [((5, 5), 1), ((3, 3), 2)])
def test_wide_kernels_and_grouped_convolutions_are_left_alone(k, group) -> None:
    """More than MAX_POSITIONS kernel offsets (LeNet's 5×5, slower rewritten) or groups: the autodiff's
    graph as it is."""
    model, _ = conv_loss_model(4, 4, (12, 12), k, group=group)
    grads = build_gradient_model(model, "loss", ["w"])
    new = rewrite_for_onnxruntime(grads)
    assert [n.op_type for n in new.graph.node] == [n.op_type for n in grads.graph.node]
