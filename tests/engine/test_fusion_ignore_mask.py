"""A mean cross-entropy gradient's ignore_index mask as one step (onnxtrain/engine/fusion/ignore_mask.py).

The gradient graphs come from the rule itself (``build_gradient_model``), with the loss's incoming gradient
fed (``seed_loss=False``) so that dL can be 3, −2.5, −0.0, ±inf or NaN. The fused plan must give the same
bits as the unfused one (``Plan(fuse=False)``) for every labels case (none ignored, some, all, an ignored
class that is a valid one, an empty batch), int32 and int64 labels, extra dims, NaN and ±inf scores, twice in
a row (the kept factor); torch's float64 autograd is the independent oracle.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine.plan import Plan


def _model(reduction: str = "mean", ii: int | None = -100, dtype=np.float32, lt=np.int64, extra: int = 0,
           weighted: bool = False, classes: int = 5) -> onnx.ModelProto:
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    ins = ["x", "t"] + (["w"] if weighted else [])
    attrs = {"reduction": reduction, **({} if ii is None else {"ignore_index": ii})}
    node = helper.make_node("SoftmaxCrossEntropyLoss", ins, ["loss"], **attrs)
    tail = ["d"] * extra
    inputs = [helper.make_tensor_value_info("x", et, ["N", classes, *tail]),
              helper.make_tensor_value_info("t", helper.np_dtype_to_tensor_dtype(np.dtype(lt)), ["N", *tail])]
    if weighted:
        inputs.append(helper.make_tensor_value_info("w", et, [classes]))
    g = helper.make_graph([node], "m", inputs, [helper.make_tensor_value_info("loss", et, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _grad_plans(model: onnx.ModelProto) -> tuple[Plan, Plan]:
    grad = build_gradient_model(model, "loss", ["x"], seed_loss=False)
    return Plan(grad), Plan(grad, fuse=False)


def _ops(plan: Plan) -> list[str]:
    return [st.node.op_type for st in plan.steps]


def _bits(a) -> tuple:
    a = np.asarray(a)
    return a.dtype.str, a.shape, a.tobytes()


LABELS = {
    "none_ignored": [0, 4, 2, 1, 3, 4],
    "some_ignored": [0, -100, 2, 1, -100, 4],
    "all_ignored": [-100] * 6,
    "empty": [],
}


def _feeds(labels: list[int], lt=np.int64, dtype=np.float32, extra: int = 0, dl: float = 1.0,
           special: bool = False, classes: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(len(labels) + 11)
    n = len(labels)
    shape = (n, classes) + (3,) * extra
    x = (rng.standard_normal(shape) * 2).astype(dtype)
    t = np.array(labels, lt).reshape((n,) + (1,) * extra) * np.ones((1,) + (3,) * extra, lt)
    if special and n:  # NaN and ±inf scores in kept rows (and in an ignored one, when there is one)
        x[0, 1] = np.nan
        x[min(2, n - 1), 0] = np.inf
        x[-1, 3] = -np.inf
    return {"x": x, "t": t.astype(lt), "loss_grad": np.array(dl, dtype)}


DLS = [1.0, 3.0, -2.5, -0.0, 0.0, np.inf, np.nan]


@pytest.mark.parametrize("dl", DLS)
@pytest.mark.parametrize("labels", sorted(LABELS))
@pytest.mark.parametrize("lt", [np.int64, np.int32])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_same_bits_as_the_unfused_steps(labels: str, lt, dtype, dl: float) -> None:
    fused, plain = _grad_plans(_model(dtype=dtype, lt=lt))
    assert "IgnoreMaskFactor" in _ops(fused)
    assert not {"Equal", "Max", "ReduceSum", "Unsqueeze"} & set(_ops(fused))
    for special in (False, True):
        f = _feeds(LABELS[labels], lt, dtype, dl=dl, special=special)
        want = plain.run(dict(f))
        for _ in range(2):  # the second run reuses the kept factor
            assert [_bits(v) for v in fused.run(dict(f))] == [_bits(v) for v in want]


@pytest.mark.parametrize("labels", sorted(LABELS))
def test_extra_dims_and_a_valid_ignored_class(labels: str) -> None:
    for model, lab in ((_model(extra=2), LABELS[labels]),
                       (_model(ii=1), [1 if v == -100 else (v if v != 1 else 0) for v in LABELS[labels]])):
        fused, plain = _grad_plans(model)
        assert "IgnoreMaskFactor" in _ops(fused)
        extra = 2 if len(model.graph.input[0].type.tensor_type.shape.dim) == 4 else 0
        for dl in (1.0, -0.0, np.nan):
            f = _feeds(lab, extra=extra, dl=dl, special=True)
            assert [_bits(v) for v in fused.run(dict(f))] == [_bits(v) for v in plain.run(dict(f))]


def test_the_kept_factor_follows_dl_and_the_batch_size() -> None:
    fused, plain = _grad_plans(_model())
    runs = [(LABELS["none_ignored"], 1.0), (LABELS["none_ignored"], -0.0), (LABELS["none_ignored"], 0.0),
            (LABELS["none_ignored"][:4], 0.0), (LABELS["some_ignored"], 0.0), (LABELS["none_ignored"], 2.0),
            (LABELS["none_ignored"] * 3, 2.0), (LABELS["none_ignored"], 1.0)]
    for lab, dl in runs:
        f = _feeds(lab, dl=dl)
        got, want = fused.run(dict(f)), plain.run(dict(f))
        assert [_bits(v) for v in got] == [_bits(v) for v in want]


@pytest.mark.parametrize("case", ["sum", "none", "weighted", "no_ignore_index"])
def test_other_forms_are_left_alone(case: str) -> None:
    reduction = case if case in ("sum", "none") else "mean"
    ii = None if case == "no_ignore_index" else -100
    model = _model(reduction=reduction, weighted=case == "weighted", ii=ii)
    fused, plain = _grad_plans(model)
    assert "IgnoreMaskFactor" not in _ops(fused)
    for labels in LABELS.values():
        if case == "no_ignore_index":
            labels = [v if v >= 0 else 0 for v in labels]
        f = _feeds(labels, dl=-2.5)
        if reduction == "none":
            f["loss_grad"] = np.linspace(-1, 2, len(labels)).astype(np.float32)
        if case == "weighted":
            f["w"] = np.array([0.5, 1.25, 2.0, 0.75, 1.5], np.float32)
        assert [_bits(v) for v in fused.run(dict(f))] == [_bits(v) for v in plain.run(dict(f))]


def test_a_label_out_of_range_fails_naming_the_node() -> None:
    fused, plain = _grad_plans(_model())
    f = _feeds([0, 7, 2, 1, -100, 4])
    errors = []
    for plan in (fused, plain):
        with pytest.raises(Exception) as e:
            plan.run(dict(f))
        errors.append((type(e.value), str(e.value)))
    assert errors[0] == errors[1]
    assert "SoftmaxCrossEntropyLoss" in errors[0][1] and "outside [0, 5)" in errors[0][1]


@pytest.mark.parametrize("labels", sorted(LABELS))
@pytest.mark.parametrize("lt", [np.int64, np.int32])
@pytest.mark.parametrize("extra", [0, 1])
def test_against_torch_float64(labels: str, lt, extra: int) -> None:
    torch = pytest.importorskip("torch")
    fused, _ = _grad_plans(_model(lt=lt, extra=extra))
    for dl in (1.0, 3.0, -2.5):
        f = _feeds(LABELS[labels], lt, extra=extra, dl=dl)
        got = fused.run(dict(f))[-1]
        x = torch.tensor(f["x"], dtype=torch.float64, requires_grad=True)
        loss = torch.nn.functional.cross_entropy(x, torch.tensor(f["t"].astype(np.int64)), ignore_index=-100)
        (gx,) = torch.autograd.grad(loss, x, torch.tensor(dl, dtype=torch.float64))
        # torch's 0/0 for a mean over nothing is NaN; the rule gives 0 there (its comment says why)
        want = np.nan_to_num(gx.numpy()) if labels in ("all_ignored", "empty") else gx.numpy()
        assert got.shape == f["x"].shape
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
        if labels == "all_ignored":
            assert not got.any()


def _hand_chain(ii: np.ndarray) -> onnx.ModelProto:
    """The mask's eight nodes written by hand, with the masked labels and the factor as graph outputs."""
    def const(name: str, v) -> onnx.NodeProto:
        value = onnx.numpy_helper.from_array(np.asarray(v), name)
        return helper.make_node("Constant", [], [name], value=value)

    nodes = [const("ii", ii), const("z", np.array(0, np.int64)), const("f0", np.array(0.0, np.float32)),
             const("f1", np.array(1.0, np.float32)), const("one", np.array(1.0, np.float32)),
             const("ax", np.array([1], np.int64)),
             helper.make_node("Equal", ["t", "ii"], ["E"]), helper.make_node("Where", ["E", "z", "t"], ["L"]),
             helper.make_node("Where", ["E", "f0", "f1"], ["K"]),
             helper.make_node("ReduceSum", ["K"], ["S"], keepdims=0),
             helper.make_node("Max", ["S", "one"], ["M"]),
             helper.make_node("Div", ["dl", "M"], ["D"]), helper.make_node("Mul", ["D", "K"], ["F"]),
             helper.make_node("Unsqueeze", ["F", "ax"], ["U"])]
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("t", onnx.TensorProto.INT64, ["N"]),
                                       helper.make_tensor_value_info("dl", onnx.TensorProto.FLOAT, [])],
                          [helper.make_empty_tensor_value_info(o) for o in ("L", "U")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_an_ignore_index_of_more_dims_than_the_labels_broadcasts_them(shape: tuple) -> None:
    """An ignore_index of shape (1, 1) makes the Equal, and so the masked labels and the factor, one dim
    wider than 1-D labels ((1, N), (1, 1, N)): the fused step must give those shapes, not (N,) and (N, 1)."""
    from onnx.reference import ReferenceEvaluator

    model = _hand_chain(np.full(shape, -100, np.int64))
    f = {"t": np.array([0, 3, 2], np.int64), "dl": np.array(1.5, np.float32)}
    want = ReferenceEvaluator(model).run(None, f)
    fused = Plan(model)
    assert ("IgnoreMaskFactor" in _ops(fused)) == (len(shape) <= 1)  # (one wider: the steps as they are)
    for plan in (fused, Plan(model, fuse=False)):
        assert [_bits(v) for v in plan.run(dict(f))] == [_bits(v) for v in want]
