"""Conv, ConvTranspose, MaxPool and AveragePool gradient graphs against torch autograd in float64.

torch is the oracle where onnx.reference cannot be (grouped ConvTranspose, which Conv's dX uses).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.testing import random_loss_model, run_engine

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _grads(
    op: str, inputs: list[np.ndarray], attrs: dict[str, Any], keep: list | None = None
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Our gradients of loss = Σ Y·U (U fixed random) w.r.t. every input, and U; ``keep`` receives the
    gradient model and its feeds."""
    names = [f"x{i}" for i in range(len(inputs))]
    node = helper.make_node(op, names, ["y"], **attrs)
    elem = helper.np_dtype_to_tensor_dtype(inputs[0].dtype)
    g_in = [helper.make_tensor_value_info(n, elem, v.shape) for n, v in zip(names, inputs)]
    graph = helper.make_graph([node], op, g_in, [helper.make_empty_tensor_value_info("y")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    feeds = dict(zip(names, inputs))
    y = run_engine(model, feeds)[0]
    lmodel = random_loss_model(model, [y.shape], [0], dtype=inputs[0].dtype)
    u = next(t for t in lmodel.graph.initializer if t.name == "u0")
    u_arr = numpy_helper.to_array(u)
    gmodel = build_gradient_model(lmodel, "loss", names)
    if keep is not None:
        keep.extend((gmodel, feeds))
    outs = dict(zip([o.name for o in gmodel.graph.output], run_engine(gmodel, feeds)))
    return {n: outs[f"{n}_grad"] for n in names}, u_arr


def _torch_grads(fn, inputs: list[np.ndarray], u: np.ndarray) -> list[np.ndarray]:
    ts = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in inputs]
    y = fn(*ts)
    assert tuple(y.shape) == u.shape, (tuple(y.shape), u.shape)
    (y * torch.tensor(u)).sum().backward()
    return [t.grad.numpy() for t in ts]


def _check(ours: dict[str, np.ndarray], theirs: list[np.ndarray]) -> None:
    for i, t in enumerate(theirs):
        np.testing.assert_allclose(ours[f"x{i}"], t, rtol=1e-10, atol=1e-12, err_msg=f"gradient of input {i}")


CONV = [  # x shape, w shape, stride, pad, dilation, groups
    ((2, 3, 8, 8), (4, 3, 3, 3), 1, 1, 1, 1),
    ((2, 3, 9, 8), (4, 3, 3, 3), 2, 1, 1, 1),
    ((2, 2, 10, 9), (3, 2, 3, 2), 1, 2, 2, 1),
    ((2, 4, 7, 7), (6, 2, 3, 3), 2, 1, 1, 2),
    ((2, 4, 9, 9), (4, 1, 3, 3), 2, 1, 2, 4),
    ((1, 6, 7, 6), (9, 2, 2, 3), 2, 0, 1, 3),
    ((2, 4, 6, 6), (8, 1, 3, 3), 1, 1, 1, 4),
]


@pytest.mark.parametrize("xs,ws,stride,pad,dil,groups", CONV, ids=lambda v: str(v))
def test_conv_grad_vs_torch(xs, ws, stride, pad, dil, groups) -> None:
    rng = np.random.default_rng(0)
    x, w, b = rng.standard_normal(xs), rng.standard_normal(ws), rng.standard_normal(ws[0])
    attrs = {"strides": [stride] * 2, "pads": [pad] * 4, "dilations": [dil] * 2, "group": groups}
    ours, u = _grads("Conv", [x, w, b], attrs)
    theirs = _torch_grads(
        lambda x, w, b: F.conv2d(x, w, b, stride=stride, padding=pad, dilation=dil, groups=groups),
        [x, w, b],
        u,
    )
    _check(ours, theirs)


CONVT = [  # x shape, w shape, stride, pad, output_padding, dilation, groups
    ((2, 3, 4, 4), (3, 2, 3, 3), 2, 1, 1, 1, 1),
    ((2, 4, 3, 5), (4, 3, 3, 2), 2, 0, 0, 1, 2),
    ((1, 4, 4, 4), (4, 1, 3, 3), 1, 1, 0, 2, 4),
    ((2, 6, 3, 3), (6, 2, 2, 2), 3, 0, 2, 1, 3),
]


@pytest.mark.parametrize("xs,ws,stride,pad,opad,dil,groups", CONVT, ids=lambda v: str(v))
def test_conv_transpose_grad_vs_torch(xs, ws, stride, pad, opad, dil, groups) -> None:
    rng = np.random.default_rng(1)
    x, w, b = rng.standard_normal(xs), rng.standard_normal(ws), rng.standard_normal(ws[1] * groups)
    attrs = {
        "strides": [stride] * 2,
        "pads": [pad] * 4,
        "output_padding": [opad] * 2,
        "dilations": [dil] * 2,
        "group": groups,
    }
    ours, u = _grads("ConvTranspose", [x, w, b], attrs)
    theirs = _torch_grads(
        lambda x, w, b: F.conv_transpose2d(
            x, w, b, stride=stride, padding=pad, output_padding=opad, groups=groups, dilation=dil
        ),
        [x, w, b],
        u,
    )
    _check(ours, theirs)


POOL = [  # x shape, kernel, stride, pad, ceil_mode, dilation (max only)
    ((2, 3, 9, 9), 3, 2, 1, 0, 1),
    ((1, 2, 8, 7), 2, 2, 0, 1, 1),
    ((2, 2, 7, 7), 3, 2, 1, 1, 1),
    ((1, 2, 10, 10), 2, 3, 1, 1, 2),
]


@pytest.mark.parametrize("xs,k,stride,pad,ceil,dil", POOL, ids=lambda v: str(v))
def test_max_pool_grad_vs_torch(xs, k, stride, pad, ceil, dil) -> None:
    n = int(np.prod(xs))
    x = (np.random.default_rng(2).permutation(n).reshape(xs) / n).astype(np.float64)  # no ties
    attrs = {
        "kernel_shape": [k] * 2,
        "strides": [stride] * 2,
        "pads": [pad] * 4,
        "ceil_mode": ceil,
        "dilations": [dil] * 2,
    }
    ours, u = _grads("MaxPool", [x], attrs)
    theirs = _torch_grads(
        lambda x: F.max_pool2d(x, k, stride, pad, dilation=dil, ceil_mode=bool(ceil)), [x], u
    )
    _check(ours, theirs)


@pytest.mark.parametrize("include_pad", [0, 1])
@pytest.mark.parametrize("xs,k,stride,pad,ceil,dil", [p for p in POOL if p[5] == 1], ids=lambda v: str(v))
def test_average_pool_grad_vs_torch(xs, k, stride, pad, ceil, dil, include_pad) -> None:
    x = np.random.default_rng(3).standard_normal(xs)
    attrs = {
        "kernel_shape": [k] * 2,
        "strides": [stride] * 2,
        "pads": [pad] * 4,
        "ceil_mode": ceil,
        "count_include_pad": include_pad,
    }
    ours, u = _grads("AveragePool", [x], attrs)
    theirs = _torch_grads(
        lambda x: F.avg_pool2d(x, k, stride, pad, ceil_mode=bool(ceil), count_include_pad=bool(include_pad)),
        [x],
        u,
    )
    _check(ours, theirs)


UNPOOL = [  # x shape, kernel, stride, pad, ceil_mode; True: windows never overlap and MaxUnpool fits X
    ((2, 3, 8, 8), 2, 2, 0, 0, True),
    ((1, 2, 6, 6), 2, 2, 1, 0, True),
    ((1, 2, 8, 8), 2, 3, 0, 0, True),
    ((1, 2, 9, 9), 2, 2, 0, 0, False),  # the last row and column are in no window
    ((1, 2, 9, 9), 2, 2, 0, 1, False),  # ceil mode: the last window hangs over
    ((1, 2, 9, 9), 3, 2, 0, 0, False),  # overlapping windows
]


@pytest.mark.parametrize("xs,k,stride,pad,ceil,unpools", UNPOOL, ids=lambda v: str(v))
def test_max_pool_grad_float32_by_max_unpool_vs_torch(xs, k, stride, pad, ceil, unpools) -> None:
    """In float32, the gradient of a MaxPool whose windows never overlap is one MaxUnpool of dY at the
    Indices; the other cases keep the ScatterElements form. Both match torch (and onnxruntime runs them:
    tests/engine/test_backends.py trains LeNet)."""
    n = int(np.prod(xs))
    x = (np.random.default_rng(4).permutation(n).reshape(xs) / n).astype(np.float32)  # no ties
    attrs = {"kernel_shape": [k] * 2, "strides": [stride] * 2, "pads": [pad] * 4, "ceil_mode": ceil}
    kept: list = []
    ours, u = _grads("MaxPool", [x], attrs, kept)
    gmodel, feeds = kept
    ops = [n.op_type for n in gmodel.graph.node]
    assert ("MaxUnpool" in ops, "ScatterElements" in ops) == (unpools, not unpools), ops
    theirs = _torch_grads(
        lambda x: F.max_pool2d(x, k, stride, pad, ceil_mode=bool(ceil)), [x.astype(np.float64)], u
    )
    np.testing.assert_allclose(ours["x0"], theirs[0], rtol=1e-6, atol=1e-7)
    ort = pytest.importorskip("onnxruntime")
    onnx.checker.check_model(gmodel, full_check=True)
    sess = ort.InferenceSession(gmodel.SerializeToString(), providers=["CPUExecutionProvider"])
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    np.testing.assert_array_equal(out["x0_grad"], ours["x0"])


DYNAMIC = [  # op, x shape, weight shape or None, attrs, torch function
    ("Conv", (2, 3, 6, 6), (4, 3, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]},
     lambda x, w: F.conv2d(x, w, stride=2, padding=1)),
    ("Conv", (2, 2, 8), (3, 2, 3), {"strides": [2], "pads": [1, 1]},
     lambda x, w: F.conv1d(x, w, stride=2, padding=1)),
    ("Conv", (1, 2, 7, 6), (2, 2, 3, 3), {"strides": [2, 3], "pads": [1, 0, 1, 2], "dilations": [1, 2]},
     lambda x, w: F.conv2d(F.pad(x, (0, 2, 1, 1)), w, stride=(2, 3), dilation=(1, 2))),
    ("AveragePool", (2, 2, 7, 6), None, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1],
                                         "count_include_pad": 1},
     lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=True)),
    ("MaxPool", (2, 2, 7, 6), None, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
     lambda x: F.max_pool2d(x, 3, stride=2, padding=1)),
    # count_include_pad=0 with pads: the windows' counts computed at run time (refused before)
    ("AveragePool", (2, 2, 7, 6), None, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
     lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=False)),
    ("AveragePool", (1, 3, 9), None, {"kernel_shape": [4], "strides": [3], "pads": [2, 1]},  # uneven pads:
     lambda x: F.avg_pool1d(F.pad(x, (2, 1)), 4, stride=3)  # window sum over the count of inputs in it
     / F.avg_pool1d(F.pad(torch.ones_like(x), (2, 1)), 4, stride=3)),
]


@pytest.mark.parametrize("op,x_shape,w_shape,attrs,fn", DYNAMIC, ids=[f"{c[0]}{c[1]}" for c in DYNAMIC])
def test_window_gradients_with_spatial_sizes_known_only_at_run_time(op, x_shape, w_shape, attrs, fn) -> None:
    """Spatial dims declared symbolic (an export with dynamic H/W): the input gradient's ConvTranspose is
    cut to X's size at run time. Sizes where (S + pads − k_eff) % stride leaves input rows after the last
    window (6 with k 3, s 2, p 1) lost those rows' gradients before."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal(x_shape)
    inputs = [x] if w_shape is None else [x, rng.standard_normal(w_shape)]
    y = fn(*(torch.tensor(v) for v in inputs)).numpy()
    u = rng.standard_normal(y.shape)
    names = ["x0", "x1"][: len(inputs)]
    dims = [x_shape[0], x_shape[1], *[f"s{i}" for i in range(len(x_shape) - 2)]]
    g_in = [helper.make_tensor_value_info("x0", onnx.TensorProto.DOUBLE, dims)]
    if w_shape is not None:
        g_in.append(helper.make_tensor_value_info("x1", onnx.TensorProto.DOUBLE, w_shape))
    nodes = [helper.make_node(op, names, ["y"], **attrs), helper.make_node("Mul", ["y", "u"], ["yu"]),
             helper.make_node("ReduceSum", ["yu"], ["loss"], keepdims=0)]
    loss = helper.make_tensor_value_info("loss", onnx.TensorProto.DOUBLE, [])
    graph = helper.make_graph(nodes, op, g_in, [loss], [numpy_helper.from_array(u, "u")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    gmodel = build_gradient_model(model, "loss", names)
    onnx.checker.check_model(gmodel, full_check=True)
    outs = dict(zip([o.name for o in gmodel.graph.output], run_engine(gmodel, dict(zip(names, inputs)))))
    _check({n: outs[f"{n}_grad"] for n in names}, _torch_grads(fn, inputs, u))
