"""LRN, Col2Im and Det, forward and gradient graph, against torch autograd in float64.

onnx.reference's LRN is only right when batch == channels, so torch is the oracle for other shapes.
torch's LocalResponseNorm sums channels [c − n//2, c + (n−1)//2] where ONNX sums [c − (n−1)//2, c + n//2]
(the same for odd n; both scale by alpha/n): even sizes are compared on channel-reversed inputs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.testing import gradcheck, random_loss_model, run_engine

torch = pytest.importorskip("torch")


def _ours(op: str, x: np.ndarray, attrs: dict[str, Any], ints: dict[str, np.ndarray] | None = None,
          as_inits: bool = False, opset: int = 17) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Y, d(Σ Y·U)/dX and U, for one ``op`` node on float64 ``x`` with int inputs ``ints`` (graph inputs,
    or initializers when ``as_inits``)."""
    ints = ints or {}
    node = helper.make_node(op, ["x", *ints], ["y"], **attrs)
    g_in = [helper.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, x.shape)]
    inits = []
    for name, v in ints.items():
        if as_inits:
            inits.append(numpy_helper.from_array(v, name))
        else:
            g_in.append(helper.make_tensor_value_info(name, onnx.TensorProto.INT64, v.shape))
    graph = helper.make_graph([node], op, g_in, [helper.make_empty_tensor_value_info("y")], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    feeds = {"x": x} if as_inits else {"x": x, **ints}
    y = run_engine(model, feeds)[0]
    lmodel = random_loss_model(model, [y.shape], [0])
    u = numpy_helper.to_array(next(t for t in lmodel.graph.initializer if t.name == "u0"))
    gmodel = build_gradient_model(lmodel, "loss", ["x"])
    onnx.checker.check_model(gmodel, full_check=True)
    outs = dict(zip([o.name for o in gmodel.graph.output], run_engine(gmodel, feeds)))
    return y, outs["x_grad"], u


def _torch(fn, x: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = fn(t)
    (y * torch.tensor(u)).sum().backward()
    return y.detach().numpy(), t.grad.numpy()


def _close(a: np.ndarray, b: np.ndarray, what: str) -> None:
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=what)


LRN = [  # shape, size, alpha, beta, bias (float32-exact: ONNX float attributes are float32)
    ((2, 5, 3, 3), 3, 2.0**-13, 0.75, 1.0),
    ((3, 6, 4), 5, 0.875, 0.625, 1.5),
    ((1, 7, 2, 2, 3), 2, 0.5, 1.375, 0.75),
    ((2, 4, 3, 2), 4, 2.0, 0.875, 0.25),
    ((2, 3, 5), 6, 1.25, 0.5, 2.0),  # the window is wider than the channels
]


@pytest.mark.parametrize("shape,size,alpha,beta,bias", LRN)
def test_lrn_matches_torch(shape, size, alpha, beta, bias) -> None:
    x = np.random.default_rng(size).uniform(-2, 2, shape)
    y, dx, u = _ours("LRN", x, {"size": size, "alpha": alpha, "beta": beta, "bias": bias}, opset=13)
    lrn = torch.nn.LocalResponseNorm(size, alpha=alpha, beta=beta, k=bias)
    if size % 2:
        ty, tdx = _torch(lrn, x, u)
    else:  # mirror the channels so that torch's window is ONNX's
        ty, tdx = _torch(lambda t: lrn(t.flip(1)).flip(1), x, u)
    _close(y, ty, "LRN forward")
    _close(dx, tdx, "LRN gradient")


COL2IM = [  # N, C, image, block, strides, pads (begin h, w, end h, w), dilations
    (2, 3, (5, 6), (2, 3), (1, 1), (0, 0, 0, 0), (1, 1)),
    (1, 2, (7, 6), (3, 2), (2, 1), (1, 0, 1, 0), (1, 2)),
    (2, 1, (6, 6), (2, 2), (2, 3), (1, 2, 1, 2), (2, 1)),
]


@pytest.mark.parametrize("as_inits", [False, True], ids=["shape_inputs", "shape_initializers"])
@pytest.mark.parametrize("n,c,image,block,strides,pads,dil", COL2IM)
def test_col2im_matches_torch_fold(n, c, image, block, strides, pads, dil, as_inits: bool) -> None:
    # torch's fold pads symmetrically: our pads are equal per axis here
    grid = [(image[i] + pads[i] + pads[2 + i] - dil[i] * (block[i] - 1) - 1) // strides[i] + 1
            for i in (0, 1)]
    x = np.random.default_rng(n + c).uniform(-2, 2, (n, c * block[0] * block[1], grid[0] * grid[1]))
    ints = {"image_shape": np.array(image, np.int64), "block_shape": np.array(block, np.int64)}
    attrs = {"strides": list(strides), "pads": list(pads), "dilations": list(dil)}
    y, dx, u = _ours("Col2Im", x, attrs, ints, as_inits=as_inits, opset=18)
    fold = torch.nn.Fold(image, block, dilation=dil, padding=pads[:2], stride=strides)
    ty, tdx = _torch(fold, x, u)
    _close(y, ty, "Col2Im forward")
    _close(dx, tdx, "Col2Im gradient")


@pytest.mark.parametrize("shape", [(3, 3), (2, 4, 4), (2, 1, 2, 2), (5, 1, 1), (2, 0, 0)])  # 0×0: det 1
def test_det_matches_torch(shape) -> None:
    x = np.random.default_rng(len(shape)).uniform(-2, 2, shape)
    y, dx, u = _ours("Det", x, {})
    ty, tdx = _torch(torch.linalg.det, x, u)
    _close(y, ty, "Det forward")
    _close(dx, tdx, "Det gradient")


def test_det_gradient_of_singular_matrices() -> None:
    # no inverse exists: the cofactors still give the gradient (checked by central differences)
    x = np.array([[[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.5, -1.0, 2.0]],  # rank 2
                  [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]])  # rank 1: gradient 0
    node = helper.make_node("Det", ["x"], ["y"])
    x_info = helper.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, x.shape)
    graph = helper.make_graph([node], "det", [x_info], [helper.make_empty_tensor_value_info("y")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    lmodel = random_loss_model(model, [(2,)], [0])
    grads = gradcheck(lmodel, "loss", ["x"], {"x": x}, rtol=1e-6, atol=1e-8)
    assert np.abs(grads["x"][0]).max() > 1  # not a trivially zero gradient
    np.testing.assert_allclose(grads["x"][1], 0, atol=1e-12)
