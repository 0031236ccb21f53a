"""ReduceMax / ReduceMin gradients at ties, against torch 2.13 autograd in float64.

The rule shares a slice's gradient evenly among the entries equal to its max (min), as ``torch.amax`` /
``torch.amin`` do (and ``torch.max(x)`` without a dim); a slice holding a NaN has a NaN max and a NaN
gradient throughout, as ``torch.amax``'s. Checked with ties inside rows, all-equal rows, ±0, ±inf and NaN
rows, keepdims 0 and 1, the axes as an attribute (opset 13), a constant input or a fed input (opset 18),
several and negative axes, and none (all of them); on the engine, and on onnxruntime where its forward
agrees (it does not always propagate NaN). Without ties, against central differences. ``torch.max(x, dim)``,
which torch exports as the same ReduceMax, gives the whole gradient to one index instead: that difference is
asserted too (README, "Gradients at edge values")."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.testing import gradcheck, run_engine

torch = pytest.importorskip("torch")
NAN, INF = np.nan, np.inf

# (2, 4, 5): along axis 2 row ties, all-equal rows, ±0, ±inf; the second plane holds NaNs in two rows
X = np.array([
    [[1, 3, 3, 2, 0], [5, 5, 5, 5, 5], [0.0, -0.0, -1, -2, -3], [INF, 1, INF, -INF, 0]],
    [[-INF, -INF, -INF, -INF, -INF], [2, NAN, 7, 7, 1], [4, 4, 4, 1, 1], [NAN, 1, 1, NAN, 1]],
])
CLEAN = X[:, [0, 1, 2, 3]].copy()
CLEAN[1, 1, 1], CLEAN[1, 3] = 7, [-1, 1, 1, -1, 1]  # the same ties, no NaN

TORCH = {"ReduceMax": torch.amax, "ReduceMin": torch.amin}
AXES = {"last": [2], "middle_negative": [-2], "two": [0, 2], "all": None}


def _model(op: str, axes: list[int] | None, keepdims: int, how: str) -> tuple[onnx.ModelProto, dict]:
    """``loss = Σ op(x)·r`` (r fixed, positive); the axes as ``how`` says: "attr" (opset 13), "const" or
    "fed" (opset 18, an initializer or a graph input); the feeds the axes need."""
    opset = 13 if how == "attr" else 18
    inputs = [helper.make_tensor_value_info("x", T.DOUBLE, list(X.shape))]
    inits, feeds, args, attrs = [], {}, ["x"], {"keepdims": keepdims}
    if axes is not None and how == "attr":
        attrs["axes"] = axes
    elif axes is not None:
        args.append("axes")
        if how == "const":
            inits.append(numpy_helper.from_array(np.array(axes, np.int64), "axes"))
        else:
            inputs.append(helper.make_tensor_value_info("axes", T.INT64, [len(axes)]))
            feeds["axes"] = np.array(axes, np.int64)
    r = np.random.default_rng(7).uniform(0.5, 1.5, _reduced_shape(axes, keepdims))
    return _loss_model(helper.make_node(op, args, ["y"], **attrs), inputs, r, opset, inits), feeds


def _loss_model(reduce: onnx.NodeProto, inputs: list, r: np.ndarray, opset: int = 18,
                inits: list | None = None) -> onnx.ModelProto:
    """``loss = Σ y·r`` for the node ``reduce`` making ``y`` from the graph ``inputs`` (r an initializer)."""
    nodes = [reduce, helper.make_node("Mul", ["y", "r"], ["yr"]),
             helper.make_node("ReduceSum", ["yr"], ["loss"], keepdims=0)]
    loss = helper.make_tensor_value_info("loss", T.DOUBLE, [])
    weights = [*(inits or []), numpy_helper.from_array(r, "r")]
    g = helper.make_graph(nodes, reduce.op_type, inputs, [loss], weights)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _reduced_shape(axes: list[int] | None, keepdims: int) -> tuple[int, ...]:
    red = {a % X.ndim for a in axes} if axes is not None else set(range(X.ndim))
    return tuple(1 if k in red else d for k, d in enumerate(X.shape) if keepdims or k not in red)


def _torch(op: str, x: np.ndarray, axes: list[int] | None, keepdims: int,
           r: np.ndarray) -> tuple[float, np.ndarray]:
    t = torch.tensor(x, requires_grad=True)
    dims = tuple(axes) if axes is not None else tuple(range(x.ndim))
    loss = (TORCH[op](t, dim=dims, keepdim=bool(keepdims)) * torch.tensor(r)).sum()
    loss.backward()
    return loss.item(), t.grad.numpy()


def _grads(op: str, axes: list[int] | None, keepdims: int, how: str):
    model, feeds = _model(op, axes, keepdims, how)
    grads = build_gradient_model(model, "loss", ["x"], outputs=["loss"])
    onnx.checker.check_model(grads, full_check=True)
    r = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "r"))
    return grads, feeds, r


def _same(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))  # NaN exactly where torch has it
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0, equal_nan=True)


@pytest.mark.parametrize("how", ["attr", "const", "fed"])
@pytest.mark.parametrize("axes", list(AXES), ids=list(AXES))
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("op", list(TORCH))
def test_ties_as_torch_amax_amin(op: str, keepdims: int, axes: str, how: str) -> None:
    grads, feeds, r = _grads(op, AXES[axes], keepdims, how)
    for x in (X, CLEAN):
        loss, dx = run_engine(grads, {"x": x, **feeds})
        want_loss, want_dx = _torch(op, x, AXES[axes], keepdims, r)
        _same(np.asarray(loss), np.asarray(want_loss))
        _same(dx, want_dx)
    # onnxruntime runs the same graph: the same gradients where its forward keeps NaN out
    sess = ort.InferenceSession(grads.SerializeToString(), providers=["CPUExecutionProvider"])
    _same(sess.run(None, {"x": CLEAN, **feeds})[1], _torch(op, CLEAN, AXES[axes], keepdims, r)[1])


def test_a_tie_is_shared_and_a_nan_row_is_nan() -> None:
    """The values themselves (not only torch's): a row's gradient r split among its k tied maxima."""
    grads, feeds, r = _grads("ReduceMax", [2], 1, "const")
    dx = run_engine(grads, {"x": X, **feeds})[1]
    np.testing.assert_array_equal(dx[0, 0], [0, r[0, 0, 0] / 2, r[0, 0, 0] / 2, 0, 0])
    np.testing.assert_allclose(dx[0, 1], np.full(5, r[0, 1, 0] / 5), rtol=1e-15)
    np.testing.assert_array_equal(dx[0, 2], [r[0, 2, 0] / 2, r[0, 2, 0] / 2, 0, 0, 0])  # 0.0 and -0.0 tie
    np.testing.assert_array_equal(dx[0, 3], [r[0, 3, 0] / 2, 0, r[0, 3, 0] / 2, 0, 0])
    assert np.isnan(dx[1, 1]).all() and np.isnan(dx[1, 3]).all()


def test_torch_max_dim_gives_one_index_instead() -> None:
    """torch.max(x, dim) exports as this ReduceMax but routes the whole gradient to the index it returns;
    the graph cannot tell it from torch.amax, whose shared gradient the rule gives."""
    grads, feeds, r = _grads("ReduceMax", [2], 0, "const")
    dx = run_engine(grads, {"x": CLEAN, **feeds})[1]
    t = torch.tensor(CLEAN, requires_grad=True)
    (torch.max(t, 2).values * torch.tensor(r)).sum().backward()
    tied = (CLEAN.max(2, keepdims=True) == CLEAN).sum(2) > 1
    assert tied.any()
    np.testing.assert_allclose(dx.sum(2), t.grad.numpy().sum(2))  # the same total per row
    assert not np.allclose(dx[tied], t.grad.numpy()[tied])  # shared where torch picks one


@pytest.mark.parametrize("op", list(TORCH))
@pytest.mark.parametrize("how", ["attr", "const"])
def test_without_ties_against_finite_differences(op: str, how: str) -> None:
    model, feeds = _model(op, [0, 2], 0, how)
    x = np.random.default_rng(3).standard_normal(X.shape)
    gradcheck(model, "loss", ["x"], {"x": x, **feeds}, rtol=1e-7, atol=1e-10)


def test_nothing_reduced_passes_the_gradient() -> None:
    """No axes and noop_with_empty_axes=1: the identity, ties or NaN anywhere."""
    model = _loss_model(helper.make_node("ReduceMax", ["x"], ["y"], noop_with_empty_axes=1),
                        [helper.make_tensor_value_info("x", T.DOUBLE, list(X.shape))],
                        np.arange(X.size, dtype=np.float64).reshape(X.shape))
    grads = build_gradient_model(model, "loss", ["x"])
    got = dict(zip([o.name for o in grads.graph.output], run_engine(grads, {"x": X})))
    np.testing.assert_array_equal(got["x_grad"], np.arange(X.size).reshape(X.shape))


@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("op", list(TORCH))
def test_fed_axes_empty_at_run_time_pass_the_gradient(op: str, keepdims: int) -> None:
    """A fed axes tensor, empty at run time, with noop_with_empty_axes=1: the identity too, so dY passes as
    it is at NaN inputs as well (the mask route gave NaN there: Equal(NaN, NaN) is false); fed non-empty, the
    shared gradient as torch.amax/amin's."""
    reduce = helper.make_node(op, ["x", "axes"], ["y"], noop_with_empty_axes=1, keepdims=keepdims)
    inputs = [helper.make_tensor_value_info("x", T.DOUBLE, list(X.shape)),
              helper.make_tensor_value_info("axes", T.INT64, [None])]
    r = np.random.default_rng(3).uniform(0.5, 1.5, X.shape)
    model = _loss_model(reduce, inputs, r)
    grads = build_gradient_model(model, "loss", ["x"])
    onnx.checker.check_model(grads, full_check=True)
    feeds = {"x": X, "axes": np.zeros(0, np.int64)}
    got = dict(zip([o.name for o in grads.graph.output], run_engine(grads, feeds)))
    np.testing.assert_array_equal(got["x_grad"], r)
    for x in (X, CLEAN):
        axes = [2]
        rr = r.max(axis=2, keepdims=bool(keepdims))  # any positive weights of the reduced shape
        grads2 = build_gradient_model(_loss_model(reduce, inputs, rr), "loss", ["x"])
        got2 = dict(zip([o.name for o in grads2.graph.output],
                        run_engine(grads2, {"x": x, "axes": np.array(axes, np.int64)})))
        _same(got2["x_grad"], _torch(op, x, axes, keepdims, rr)[1])
