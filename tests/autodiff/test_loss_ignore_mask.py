"""The ignore_index mask of SoftmaxCrossEntropyLoss/NegativeLogLikelihoodLoss gradients in fewer nodes.

The reference is the rule's emission before the change (a copy of the old ``_class_factor`` below, patched
in): the gradient graphs must give the same bits on the numpy engine and on ``onnx.reference``, for every
reduction, with and without class weights, labels equal to ignore_index, all ignored, an empty batch;
torch's float64 autograd is the independent oracle (within float32 rounding).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.autodiff.context import GradCtx
from onnxtrain.autodiff.rules import loss as loss_rules
from onnxtrain.engine import compile_model


def _old_class_factor(g: GradCtx) -> tuple[str, str | None]:
    lab = g.x(1)
    lt = g.elem_type(lab)
    ii = g.attr("ignore_index")
    keep = None
    if ii is not None:
        keep = g.emit("Not", g.emit("Equal", lab, g.const(ii, lt)))
        lab = g.emit("Where", keep, lab, g.const(0, lt))
    w = g.emit("Gather", g.x(2), lab) if g.has_x(2) else None
    if keep is not None:
        kf = g.emit("Cast", keep, to=g.dtype)
        w = kf if w is None else g.emit("Mul", w, kf)
    dl = g.dy(0)
    red = g.attr("reduction")
    if red == "mean":
        if w is not None:
            tw = g.emit("ReduceSum", w, keepdims=0)
            dl = g.emit("Div", dl, g.emit("Where", g.emit("Equal", tw, g.const(0)), g.const(1), tw))
        else:
            dl = g.emit("Div", dl, loss_rules._count(g))
    f = dl if w is None else g.emit("Mul", dl, w)
    return lab, f


def _model(op: str, reduction: str, weighted: bool, ii: int | None, dtype,
           classes: int = 5) -> onnx.ModelProto:
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    ins = ["x", "t"] + (["w"] if weighted else [])
    attrs = {"reduction": reduction, **({} if ii is None else {"ignore_index": ii})}
    # a dL/dloss that is not 1 (times 3) so the factor's product shows
    nodes = [helper.make_node(op, ins, ["l"], **attrs),
             helper.make_node("Mul", ["l", "three"], ["loss"])]
    inputs = [helper.make_tensor_value_info("x", et, ["N", classes]),
              helper.make_tensor_value_info("t", TensorProto.INT64, ["N"])]
    if weighted:
        inputs.append(helper.make_tensor_value_info("w", et, [classes]))
    three = helper.make_tensor("three", et, [], [3.0])
    g = helper.make_graph(nodes, "m", inputs, [helper.make_tensor_value_info("loss", et, None)], [three])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _feeds(n: int, weighted: bool, dtype, labels: np.ndarray | None, classes: int = 5) -> dict:
    rng = np.random.default_rng(n + 7)
    x = rng.standard_normal((n, classes)) * 2
    f = {"x": x.astype(dtype),
         "t": rng.integers(0, classes, n).astype(np.int64) if labels is None else labels}
    if weighted:
        f["w"] = rng.uniform(0.25, 2.0, classes).astype(dtype)
    return f


def _grads(model: onnx.ModelProto, feeds: dict) -> tuple[onnx.ModelProto, list[np.ndarray], list[np.ndarray]]:
    grad = build_gradient_model(model, "loss", ["x"])
    onnx.checker.check_model(grad, full_check=True)
    assert all(n.domain in ("", "ai.onnx") for n in grad.graph.node)
    ours = compile_model(grad).run(dict(feeds))
    # onnx.reference's losses reshape an empty batch to (0, C, -1), which numpy refuses
    ref = ReferenceEvaluator(grad).run(None, dict(feeds)) if len(feeds["t"]) else []
    return grad, list(ours), list(ref)


def _bits(a) -> tuple:
    a = np.asarray(a)
    return a.dtype.str, a.shape, a.tobytes()


LABELS = {
    "random": None,
    "some_ignored": np.array([0, -100, 2, 1, -100, 4], np.int64),
    "all_ignored": np.full(6, -100, np.int64),
    "ignore_a_class": np.array([1, 1, 0, 3, 1, 2], np.int64),  # ignore_index 1, a valid class
    "empty": np.zeros(0, np.int64),
}


def _ignore(labels: str) -> int:
    return 1 if labels == "ignore_a_class" else -100


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("labels", sorted(LABELS))
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
def test_same_bits_as_the_previous_rule(op: str, reduction: str, weighted: bool, labels: str, dtype) -> None:
    lab = LABELS[labels]
    n = 6 if lab is None else len(lab)
    feeds = _feeds(n, weighted, dtype, lab)
    model = _model(op, reduction, weighted, _ignore(labels), dtype)
    g_new, ours_new, ref_new = _grads(model, feeds)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loss_rules, "_class_factor", _old_class_factor)
        g_old, ours_old, ref_old = _grads(model, feeds)
    assert [_bits(v) for v in ours_new] == [_bits(v) for v in ours_old]
    assert [_bits(v) for v in ref_new] == [_bits(v) for v in ref_old]
    new, old = (Counter(n.op_type for n in g.graph.node if n.op_type != "Constant") for g in (g_new, g_old))
    assert new["Not"] == 0 and old["Not"] == 1
    assert sum(new.values()) < sum(old.values())  # (Constants aside: the engine runs no step for them)
    assert old["Cast"] - new["Cast"] == 1  # the float mask: one Where instead of Not and Cast
    if reduction == "mean" and not weighted:  # Max(count, 1) for Where(Equal(count, 0), 1, count)
        assert (old["Equal"] - new["Equal"], new["Max"] - old["Max"]) == (1, 1)


@pytest.mark.parametrize("labels", ["random", "some_ignored", "all_ignored", "empty"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_sce_gradient_against_torch(reduction: str, weighted: bool, labels: str) -> None:
    torch = pytest.importorskip("torch")
    lab = LABELS[labels]
    n = 6 if lab is None else len(lab)
    feeds = _feeds(n, weighted, np.float32, lab)
    _, ours, _ = _grads(_model("SoftmaxCrossEntropyLoss", reduction, weighted, -100, np.float32), feeds)
    x = torch.tensor(feeds["x"], dtype=torch.float64, requires_grad=True)
    w = torch.tensor(feeds["w"], dtype=torch.float64) if weighted else None
    loss = 3 * torch.nn.functional.cross_entropy(x, torch.tensor(feeds["t"]), w, ignore_index=-100,
                                                 reduction=reduction)
    dy = torch.ones_like(loss)
    (gx,) = torch.autograd.grad(loss, x, dy)
    gx = np.nan_to_num(gx.numpy())  # torch's 0/0 for a mean over nothing: the rule gives 0
    got = ours[-1]
    assert got.shape == feeds["x"].shape
    np.testing.assert_allclose(got, gx, rtol=1e-5, atol=1e-7)
    if labels == "all_ignored":
        assert not got.any()
