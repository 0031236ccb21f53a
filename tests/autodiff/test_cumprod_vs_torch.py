"""CumProd's gradient against torch autograd (torch.cumprod) in float64, with zeros along the axis.

The rule solves the gradient's recurrence by recursive doubling, unrolled when the axis length is known
as the graph is built and in a Loop when it is not (a symbolic dim): both forms are checked, and the Loop
form also on onnx.reference and onnxruntime (the op table's rows only have static shapes).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.ir.builder import make_model
from onnxtrain.testing import random_loss_model, run_engine

torch = pytest.importorskip("torch")


def _model(shape: tuple[int, ...], axis: int, dynamic: bool, **attrs: int) -> onnx.ModelProto:
    dims = [f"d{i}" for i in range(len(shape))] if dynamic else list(shape)
    node = helper.make_node("CumProd", ["x", "axis"], ["y"], **attrs)
    graph = helper.make_graph(
        [node], "cumprod", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, dims)],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, dims)],
        [numpy_helper.from_array(np.array(axis, np.int64), "axis")],
    )
    return make_model(graph, 26)


def _torch_cumprod(t, axis: int, exclusive: int, reverse: int):
    if reverse:
        t = t.flip(axis)
    y = torch.cumprod(t, axis)
    if exclusive:
        n = t.shape[axis]
        y = torch.cat([torch.ones_like(y.narrow(axis, 0, 1)), y.narrow(axis, 0, n - 1)], axis)
    return y.flip(axis) if reverse else y


def _with_zeros(shape: tuple[int, ...], axis: int, zeros: int, seed: int) -> np.ndarray:
    """Uniform values with ``zeros`` exact zeros along ``axis`` in every lane, at random places."""
    rng = np.random.default_rng(seed)
    x = np.moveaxis(rng.uniform(-2, 2, shape), axis, -1).copy()  # C-contiguous: its lanes are views
    for lane in x.reshape(-1, x.shape[-1]):
        lane[rng.choice(lane.size, zeros, replace=False)] = 0
    return np.ascontiguousarray(np.moveaxis(x, -1, axis))


CASES = [  # shape, axis, zeros per lane
    ((6,), 0, 0),
    ((3, 5), 1, 1),
    ((4, 6), -1, 2),
    ((5, 3), 0, 2),
    ((2, 9, 2), -2, 1),
    ((2, 16), 1, 3),
    ((3, 1), 1, 0),
]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)],
                         ids=["inclusive", "exclusive", "reverse", "excl_rev"])
@pytest.mark.parametrize("shape,axis,zeros", CASES, ids=lambda v: str(v))
def test_cumprod_gradient_matches_torch(shape, axis, zeros, exclusive, reverse, dynamic) -> None:
    x = _with_zeros(shape, axis, zeros, seed=len(shape) * 10 + zeros)
    assert (np.moveaxis(x == 0, axis, -1).sum(-1) == zeros).all()
    model = _model(shape, axis, dynamic, exclusive=exclusive, reverse=reverse)
    y = run_engine(model, {"x": x})[0]
    lmodel = random_loss_model(model, [y.shape], [0])
    u = numpy_helper.to_array(next(t for t in lmodel.graph.initializer if t.name == "u0"))
    gmodel = build_gradient_model(lmodel, "loss", ["x"])
    onnx.checker.check_model(gmodel, full_check=True)
    assert any(n.op_type == "Loop" for n in gmodel.graph.node) == dynamic
    names = [o.name for o in gmodel.graph.output]
    dx = dict(zip(names, run_engine(gmodel, {"x": x})))["x_grad"]

    t = torch.tensor(x, requires_grad=True)
    ty = _torch_cumprod(t, axis, exclusive, reverse)
    (ty * torch.tensor(u)).sum().backward()
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-12, atol=0)
    np.testing.assert_allclose(dx, t.grad.numpy(), rtol=1e-10, atol=1e-12)

    if dynamic:  # the Loop form on the other runtimes (the static form is the op table's)
        from onnx.reference import ReferenceEvaluator

        ref = dict(zip(names, ReferenceEvaluator(gmodel).run(None, {"x": x})))["x_grad"]
        np.testing.assert_allclose(ref, dx, rtol=1e-12, atol=1e-14, err_msg="onnx.reference")
        ort = pytest.importorskip("onnxruntime")
        sess = ort.InferenceSession(gmodel.SerializeToString(), providers=["CPUExecutionProvider"])
        got = dict(zip(names, sess.run(None, {"x": x})))["x_grad"]
        np.testing.assert_allclose(got, dx, rtol=1e-12, atol=1e-14, err_msg="onnxruntime")


def test_cumprod_gradient_has_no_division() -> None:
    """dY·Y/X would give NaN or 0 at the zeros; the rule divides nowhere, unrolled or in its Loop."""
    for dynamic in (False, True):
        model = random_loss_model(_model((3, 8), 1, dynamic), [(3, 8)], [0])
        gmodel = build_gradient_model(model, "loss", ["x"])
        nodes = list(gmodel.graph.node)
        for loop in (n for n in gmodel.graph.node if n.op_type == "Loop"):
            nodes += onnx.helper.get_attribute_value(loop.attribute[0]).node
        ops = {n.op_type for n in nodes}
        assert ("Loop" in ops) == dynamic
        assert not ops & {"Div", "Reciprocal", "Log", "Pow"}, ops
