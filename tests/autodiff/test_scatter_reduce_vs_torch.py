"""ScatterElements / ScatterND with reduction max and min: gradients against torch autograd
(``torch.scatter_reduce(..., "amax"/"amin", include_self=True)``) in float64, on integer-valued data and
updates so that data and updates tie for a slot's result and the gradient is shared among them. The op
table's rows check the tie-free case by finite differences; ties are where a convention is needed, and
torch's is the one users compare with."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.ir.builder import make_model
from onnxtrain.testing import random_loss_model, run_engine

torch = pytest.importorskip("torch")


def _model(op: str, shapes: tuple[tuple[int, ...], ...], **attrs: object) -> onnx.ModelProto:
    (ds, is_, us) = shapes
    node = helper.make_node(op, ["data", "idx", "upd"], ["y"], **attrs)
    graph = helper.make_graph(
        [node], "scatter",
        [helper.make_tensor_value_info("data", TensorProto.DOUBLE, ds),
         helper.make_tensor_value_info("idx", TensorProto.INT64, is_),
         helper.make_tensor_value_info("upd", TensorProto.DOUBLE, us)],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, ds)],
    )
    return make_model(graph, 18)


def _grads(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    y = run_engine(model, feeds)[0]
    lmodel = random_loss_model(model, [y.shape], [0])
    u = onnx.numpy_helper.to_array(next(t for t in lmodel.graph.initializer if t.name == "u0"))
    gmodel = build_gradient_model(lmodel, "loss", ["data", "upd"])
    onnx.checker.check_model(gmodel, full_check=True)
    names = [o.name for o in gmodel.graph.output]
    got = dict(zip(names, run_engine(gmodel, feeds)))
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(gmodel.SerializeToString(), providers=["CPUExecutionProvider"])
    theirs = dict(zip(names, sess.run(None, feeds)))
    for k in ("data_grad", "upd_grad"):
        np.testing.assert_allclose(theirs[k], got[k], rtol=1e-14, atol=0, err_msg=f"onnxruntime {k}")
    return u, got


@pytest.mark.parametrize("reduction", ["max", "min"])
@pytest.mark.parametrize("axis", [0, 1])
def test_scatter_elements_max_min_ties_match_torch(reduction: str, axis: int) -> None:
    rng = np.random.default_rng(3 + axis)
    data = rng.integers(-2, 3, (4, 5)).astype(np.float64)
    ishape = (6, 5) if axis == 0 else (4, 7)
    idx = rng.integers(-data.shape[axis], data.shape[axis], ishape)
    upd = rng.integers(-2, 3, ishape).astype(np.float64)
    model = _model("ScatterElements", (data.shape, idx.shape, upd.shape), axis=axis, reduction=reduction)
    u, got = _grads(model, {"data": data, "idx": idx, "upd": upd})

    td = torch.tensor(data, requires_grad=True)
    tu = torch.tensor(upd, requires_grad=True)
    ti = torch.tensor(idx % data.shape[axis])
    ty = td.scatter_reduce(axis, ti, tu, "amax" if reduction == "max" else "amin", include_self=True)
    (ty * torch.tensor(u)).sum().backward()
    np.testing.assert_allclose(got["data_grad"], td.grad.numpy(), rtol=1e-14, atol=0)
    np.testing.assert_allclose(got["upd_grad"], tu.grad.numpy(), rtol=1e-14, atol=0)
    # the case has ties between data and updates, and slots no update reaches
    assert 0 < np.count_nonzero(td.grad.numpy()) < data.size
    shared = td.grad.numpy() / u
    assert np.any((shared > 0) & (shared < 1))


@pytest.mark.parametrize("reduction", ["max", "min"])
def test_scatter_nd_max_min_ties_match_torch(reduction: str) -> None:
    """ScatterND over rows of a (5, 3) tensor: torch's scatter_reduce along axis 0 with each row index
    repeated across the columns is the same reduction."""
    rng = np.random.default_rng(11)
    data = rng.integers(-2, 3, (5, 3)).astype(np.float64)
    rows = rng.integers(-5, 5, 8)
    upd = rng.integers(-2, 3, (8, 3)).astype(np.float64)
    model = _model("ScatterND", (data.shape, (8, 1), upd.shape), reduction=reduction)
    u, got = _grads(model, {"data": data, "idx": rows[:, None], "upd": upd})

    td = torch.tensor(data, requires_grad=True)
    tu = torch.tensor(upd, requires_grad=True)
    ti = torch.tensor(np.repeat((rows % 5)[:, None], 3, axis=1))
    ty = td.scatter_reduce(0, ti, tu, "amax" if reduction == "max" else "amin", include_self=True)
    (ty * torch.tensor(u)).sum().backward()
    np.testing.assert_allclose(got["data_grad"], td.grad.numpy(), rtol=1e-14, atol=0)
    np.testing.assert_allclose(got["upd_grad"], tu.grad.numpy(), rtol=1e-14, atol=0)
    share = tu.grad.numpy() / u[rows % 5]  # each update's fraction of its slot's gradient
    assert np.any((share > 0) & (share < 1))  # some update shares its slot with a tie


@pytest.mark.parametrize("op", ["ScatterElements", "ScatterND"])
def test_repeated_indices_without_reduction_give_each_slot_once(op: str) -> None:
    """Without a reduction, updates that repeat an index overwrite each other: only the one the slot keeps
    (the last, as the engine and onnxruntime write) gets the slot's gradient. Each copy got it before, so a
    value broadcast to repeated slots (torch's export of ``index_fill`` with an index listed twice) had its
    gradient counted once per copy (24.9 against torch's 14.8 in the OpInfo sample). Against torch's
    ``index_fill``, whose value fills each listed column once."""
    rng = np.random.default_rng(2)
    data, columns, value = rng.standard_normal((3, 5)), np.array([4, 1, 1, 4, 0]), -0.7
    if op == "ScatterElements":
        idx, upd = np.tile(columns, (3, 1)), np.full((3, 5), value)
        model = _model(op, ((3, 5), (3, 5), (3, 5)), axis=1)
    else:  # rows of the transposed data
        data, idx, upd = data.T.copy(), columns[:, None], np.full((5, 3), value)
        model = _model(op, ((5, 3), (5, 1), (5, 3)))
    feeds = {"data": data, "idx": idx, "upd": upd}
    u, got = _grads(model, feeds)
    d = torch.tensor(data if op == "ScatterElements" else data.T, requires_grad=True)
    v = torch.tensor(value, dtype=torch.float64, requires_grad=True)
    y = d.index_fill(1, torch.tensor(columns), v)
    weights = torch.tensor(u if op == "ScatterElements" else u.T)
    dd, dv = torch.autograd.grad((y * weights).sum(), [d, v])
    want_data = dd.numpy() if op == "ScatterElements" else dd.numpy().T
    np.testing.assert_allclose(got["data_grad"], want_data, rtol=1e-12)
    np.testing.assert_allclose(got["upd_grad"].sum(), dv.item(), rtol=1e-12)


@pytest.mark.parametrize("static", [True, False], ids=["static", "symbolic"])
@pytest.mark.parametrize("op", ["ScatterElements", "ScatterND"])
def test_constant_indices_naming_a_slot_negatively_and_positively_overwrite(op: str, static: bool) -> None:
    """Constant indices 2 and -1 over an axis of 3 name the same slot (ONNX counts a negative index from the
    end), so the second update overwrites the first and the first gets no gradient; both got it, as the
    indices were taken for distinct. With the data's dims declared or symbolic. Oracle: central
    differences of onnxruntime's float64 forward with respect to each update."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(5)
    if op == "ScatterElements":
        idx, ds, us, attrs = np.array([[2, -1, 0], [-3, 1, -2]]), (2, 3), (2, 3), {"axis": 1}
    else:
        idx, ds, us, attrs = np.array([[2], [-1], [0]]), (3, 2), (3, 2), {}
    data, upd, w = rng.standard_normal(ds), rng.standard_normal(us), rng.standard_normal(ds)
    graph = helper.make_graph(
        [helper.make_node(op, ["data", "idx", "upd"], ["y"], **attrs),
         helper.make_node("Mul", ["y", "w"], ["yw"]),
         helper.make_node("ReduceSum", ["yw"], ["loss"], keepdims=0)],
        "scatter",
        [helper.make_tensor_value_info("data", TensorProto.DOUBLE, ds if static else ["a", "b"]),
         helper.make_tensor_value_info("upd", TensorProto.DOUBLE, us)],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        [onnx.numpy_helper.from_array(idx.astype(np.int64), "idx"), onnx.numpy_helper.from_array(w, "w")])
    model = make_model(graph, 18)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = np.zeros_like(upd)
    for k in np.ndindex(upd.shape):
        step = np.zeros_like(upd)
        step[k] = 1e-6
        hi, lo = (sess.run(None, {"data": data, "upd": upd + s})[0] for s in (step, -step))
        want[k] = (hi - lo) / 2e-6
    gmodel = build_gradient_model(model, "loss", ["data", "upd"])
    names = [o.name for o in gmodel.graph.output]
    got = dict(zip(names, run_engine(gmodel, {"data": data, "upd": upd})))
    np.testing.assert_allclose(got["upd_grad"], want, rtol=1e-7, atol=1e-9)
