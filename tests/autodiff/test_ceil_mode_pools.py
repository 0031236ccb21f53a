"""Pools under ceil_mode whose last window would start in the end pad, in models whose later static shapes
depend on the pool's window count (Flatten → Linear, a Conv after it).

torch, onnxruntime's kernels and the numpy engine drop that window (as the ONNX spec says: "sliding windows
that would start in the right padded region are ignored"); ONNX 1.23's shape inference counts it. The
gradient builder built its Reshapes to ONNX's count ("cannot reshape array of size 252 into shape
(1,newaxis,4,4)") and generate_artifacts wrote models onnx.checker refuses. Oracle: torch's autograd on the
same modules in float64 (SGD steps), torch's pools for the MaxPool's Indices."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import onnxtrain
from onnxtrain.autodiff import build_gradient_model
from tests.session.helpers import backend_options, params

torch = pytest.importorskip("torch")
F = torch.nn.functional

LR = 0.05


def _torch_model(kind: str) -> tuple[Any, tuple[int, int]]:
    """A module with a ceil_mode pool that drops a last window on both axes of its input size."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    if kind == "max-flatten-linear":  # 5×5 → 3×3 (ONNX's inference: 4×4)
        body = [conv, torch.nn.Tanh(), torch.nn.MaxPool2d(2, 2, padding=1, ceil_mode=True),
                torch.nn.Flatten(), torch.nn.Linear(4 * 3 * 3, 2)]
        return torch.nn.Sequential(*body), (5, 5)
    cip = kind == "avg-with-pads-conv"  # 5×7 → 3×4 (ONNX: 4×5), then a Conv 2×2 → 2×3
    body = [conv, torch.nn.Tanh(),
            torch.nn.AvgPool2d(2, 2, padding=1, ceil_mode=True, count_include_pad=cip),
            torch.nn.Conv2d(4, 2, 2), torch.nn.Flatten(), torch.nn.Linear(2 * 2 * 3, 2)]
    return torch.nn.Sequential(*body), (5, 7)


def _exported(module: Any, hw: tuple[int, int]) -> onnx.ModelProto:
    f = io.BytesIO()
    torch.onnx.export(module, (torch.zeros(1, 3, *hw),), f, dynamo=False, input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    return onnx.load_from_string(f.getvalue())


def _with_mse(body: onnx.ModelProto) -> onnx.ModelProto:
    """``body`` with loss = mean((y − t)²) as its output."""
    m = onnx.ModelProto()
    m.CopyFrom(body)
    g = m.graph
    g.input.append(helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, ["N", 2]))
    g.node.extend([helper.make_node("Sub", ["y", "t"], ["d"]), helper.make_node("Mul", ["d", "d"], ["d2"]),
                   helper.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0)])
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, []))
    return m


def _data(hw: tuple[int, int], steps: int = 2) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(3)
    return [(rng.standard_normal((n, 3, *hw)).astype(np.float32),
             rng.standard_normal((n, 2)).astype(np.float32)) for n in (2, 3)[:steps]]


def _torch_steps(module: Any, data: list, loss_fn: Callable[[Any, Any], Any]) -> tuple[list[float], dict]:
    """SGD steps of a float64 copy of ``module``: the losses and the final weights (by parameter name)."""
    ref = module.double()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    losses = []
    for x, t in data:
        opt.zero_grad()
        loss = loss_fn(ref(torch.tensor(x, dtype=torch.float64)), torch.tensor(t, dtype=torch.float64))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().numpy() for k, v in ref.named_parameters()}


def _check_model(model: onnx.ModelProto, what: str) -> None:
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{what} fails onnx.checker: {e}") from e


KINDS = ["max-flatten-linear", "avg-with-pads-conv", "avg-without-pads-conv"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_torch_exported_ceil_mode_pool_trains_on_the_legacy_session(kind: str) -> None:
    module, hw = _torch_model(kind)
    body = _exported(module, hw)
    model = _with_mse(body)
    names = [t.name for t in body.graph.initializer]
    grad = build_gradient_model(model, "loss", names)
    _check_model(grad, "the gradient model")
    sess = onnxtrain.TrainingSession(model.SerializeToString(), params("SGDOptimizer"),
                                     backend_options("numpy"))
    data = _data(hw)
    losses = [float(sess.run(["loss"], {"x": x, "t": t, "Learning_Rate": np.array([LR], np.float32)})[0])
              for x, t in data]
    want, weights = _torch_steps(module, data, lambda y, t: ((y - t) ** 2).mean())
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    state = sess.get_state()
    for name in names:
        np.testing.assert_allclose(state[name], weights[name], rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("kind", KINDS)
def test_a_torch_exported_ceil_mode_pool_trains_through_generated_artifacts(kind: str, tmp_path: Any) -> None:
    from onnxtrain.training import artifacts
    from onnxtrain.training.api import CheckpointState, Module, Optimizer

    module, hw = _torch_model(kind)
    body = _exported(module, hw)
    names = [t.name for t in body.graph.initializer]
    artifacts.generate_artifacts(body, requires_grad=names, loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path)
    for f in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        _check_model(onnx.load(os.path.join(tmp_path, f)), f)
    state = CheckpointState.load_checkpoint(os.path.join(tmp_path, "checkpoint"))
    m = Module(os.path.join(tmp_path, "training_model.onnx"), state,
               os.path.join(tmp_path, "eval_model.onnx"))
    opt = Optimizer(os.path.join(tmp_path, "optimizer_model.onnx"), m)
    opt.set_learning_rate(LR)
    data = _data(hw)
    losses = []
    for x, t in data:
        losses.append(float(np.asarray(m(x, t)).reshape(-1)[0]))
        opt.step()
        m.lazy_reset_grad()
    want, weights = _torch_steps(module, data, lambda y, t: ((y - t) ** 2).mean())
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    got = {n: np.array(p.data) for n, p in state.parameters}
    for name in names:
        np.testing.assert_allclose(got[name], weights[name], rtol=1e-4, atol=1e-6, err_msg=name)
    m.eval()  # the eval model's loss at the trained weights
    x, t = data[0]
    with torch.no_grad():
        y = module(torch.tensor(x, dtype=torch.float64))
        ref = ((y - torch.tensor(t, dtype=torch.float64)) ** 2).mean().item()
    np.testing.assert_allclose(float(np.asarray(m(x, t)).reshape(-1)[0]), ref, rtol=1e-5)


# ---- hand-written: a MaxPool's Indices as an output, an LpPool (ceil_mode from opset 18), a kernel narrower
# than the stride (no end pad makes ONNX's ceil count right: the rewrite takes floor's) ----------------------

# name → (kernel, strides, pads (begin = end), H, W): the run's window counts, and ONNX's inference's
GEOMETRIES = {
    "k2s2p1": ([2, 2], [2, 2], [1, 1], 3, 5),  # 2×3 (ONNX: 3×4)
    "k1x3s2": ([1, 3], [2, 2], [0, 1], 6, 7),  # 3×4 (ONNX: 4×4): random_models seed 98's MaxPool
    "k1x3s2-overhang": ([1, 3], [2, 2], [0, 1], 6, 8),  # 3×5 (ONNX 4×5), W's last window overhangs its pad
}


def _hand_model(op: str, geometry: str, w1: np.ndarray, w2: np.ndarray, extra: dict) -> onnx.ModelProto:
    """loss = mean((Flatten(pool(tanh(x · W1))) @ W2 − t)²); a MaxPool's Indices are an output too."""
    k, s, p, h, w = GEOMETRIES[geometry]
    pool = {"kernel_shape": k, "strides": s, "pads": p * 2, "ceil_mode": 1, **extra}
    outs = ["p", "idx"] if op == "MaxPool" else ["p"]
    nodes = [helper.make_node("Mul", ["x", "W1"], ["xw"]), helper.make_node("Tanh", ["xw"], ["a"]),
             helper.make_node(op, ["a"], outs, name="pool", **pool),
             helper.make_node("Flatten", ["p"], ["f"], axis=1),
             helper.make_node("MatMul", ["f", "W2"], ["y"]),
             helper.make_node("Sub", ["y", "t"], ["d"]), helper.make_node("Mul", ["d", "d"], ["d2"]),
             helper.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0)]
    outputs = [helper.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, [])]
    if op == "MaxPool":
        outputs.append(helper.make_tensor_value_info("idx", onnx.TensorProto.INT64, None))
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3, h, w]),
                     helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, ["N", 2])],
        outputs, [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def _torch_pool(op: str, geometry: str, a: Any, extra: dict) -> Any:
    k, s, p = GEOMETRIES[geometry][:3]
    if op == "MaxPool":
        return F.max_pool2d(a, k, s, p, ceil_mode=True)
    if op == "AveragePool":
        return F.avg_pool2d(a, k, s, p, ceil_mode=True, count_include_pad=bool(extra["count_include_pad"]))
    # p = 2 over zero pads: the window sums of a², whatever part of the window overhangs the pads
    return F.avg_pool2d(a * a, k, s, p, ceil_mode=True, count_include_pad=True, divisor_override=1).sqrt()


POOLS = {"max": ("MaxPool", {}), "lp": ("LpPool", {"p": 2}), "avg": ("AveragePool", {"count_include_pad": 0}),
         "avg-with-pads": ("AveragePool", {"count_include_pad": 1})}
# (an AveragePool counting pads, on "k1x3s2-overhang", reads its input through a Slice instead)
HAND_CASES = [(pool, geometry) for geometry in GEOMETRIES for pool in POOLS]


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
@pytest.mark.parametrize(("pool", "geometry"), HAND_CASES)
def test_a_hand_written_ceil_mode_pool_trains_on_the_legacy_session(pool: str, geometry: str,
                                                                    backend: str) -> None:
    op, extra = POOLS[pool]
    h, w = GEOMETRIES[geometry][3:]
    rng = np.random.default_rng(5)
    out = _torch_pool(op, geometry, torch.ones(1, 3, h, w, dtype=torch.float64), extra).shape
    w1 = rng.standard_normal((1, 3, 1, 1)).astype(np.float32)
    w2 = (0.3 * rng.standard_normal((3 * out[2] * out[3], 2))).astype(np.float32)
    model = _hand_model(op, geometry, w1, w2, extra)
    _check_model(build_gradient_model(model, "loss", ["W1", "W2"]), "the gradient model")
    sess = onnxtrain.TrainingSession(model.SerializeToString(), params("SGDOptimizer"),
                                     backend_options(backend))
    t1 = torch.tensor(w1.astype(np.float64), requires_grad=True)
    t2 = torch.tensor(w2.astype(np.float64), requires_grad=True)
    opt = torch.optim.SGD([t1, t2], lr=LR)
    for n in (2, 1):
        x = rng.standard_normal((n, 3, h, w)).astype(np.float32)
        t = rng.standard_normal((n, 2)).astype(np.float32)
        fetch = ["loss", "idx"] if op == "MaxPool" else ["loss"]
        got = sess.run(fetch, {"x": x, "t": t, "Learning_Rate": np.array([LR], np.float32)})
        opt.zero_grad()
        a = torch.tanh(torch.tensor(x, dtype=torch.float64) * t1)
        p = _torch_pool(op, geometry, a, extra)
        loss = ((p.flatten(1) @ t2 - torch.tensor(t, dtype=torch.float64)) ** 2).mean()
        if op == "MaxPool":  # torch's are per (n, c) plane; ONNX's over the whole tensor
            k, s, pads = GEOMETRIES[geometry][:3]
            _, idx = F.max_pool2d(a, k, s, pads, ceil_mode=True, return_indices=True)
            plane = torch.arange(n * 3, dtype=torch.int64).reshape(n, 3, 1, 1) * (h * w)
            np.testing.assert_array_equal(got[1], (idx + plane).numpy())
        loss.backward()
        opt.step()
        np.testing.assert_allclose(float(got[0]), loss.item(), rtol=1e-5)
        state = sess.get_state()
        np.testing.assert_allclose(state["W1"], t1.detach().numpy(), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(state["W2"], t2.detach().numpy(), rtol=1e-4, atol=1e-6)


def test_a_ceil_mode_pool_that_is_a_graph_output_gets_its_declared_shape_fixed() -> None:
    """torch's exporter declares a ceil_mode pool's output with ONNX's count (3 on the last axis of
    ``max_pool3d(kernel 3, stride 3, padding 1)`` over 5 columns) where torch keeps 2 windows. The pool is
    read with the pads that make ONNX count 2; the graph output's declaration was left at 3, so the gradient
    graph of any loss over it failed onnx.checker's full check. Now it declares 2, and the gradient equals
    torch's."""
    torch = pytest.importorskip("torch")
    x = torch.randn(1, 2, 3, 6, 5, dtype=torch.float64)

    class Pool(torch.nn.Module):
        def forward(self, a: Any) -> Any:
            return torch.nn.functional.max_pool3d(a, 3, padding=1, ceil_mode=True)

    buffer = io.BytesIO()
    torch.onnx.export(Pool(), (x,), buffer, dynamo=False, opset_version=17, input_names=["x"],
                      output_names=["y"])
    model = onnx.load_from_string(buffer.getvalue())
    want_shape = tuple(Pool()(x).shape)
    assert [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim][-1] == 3  # the export's
    w = np.random.default_rng(4).uniform(0.5, 1.5, want_shape)
    model.graph.initializer.append(numpy_helper.from_array(w, "w"))
    model.graph.node.extend([helper.make_node("Mul", ["y", "w"], ["p"]),
                             helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0)])
    model.graph.output.append(helper.make_tensor_value_info("loss", onnx.TensorProto.DOUBLE, []))
    gmodel = build_gradient_model(model, "loss", ["x"])
    onnx.checker.check_model(gmodel, full_check=True)
    y = next(o for o in gmodel.graph.output if o.name == "y")
    assert tuple(d.dim_value for d in y.type.tensor_type.shape.dim) == want_shape
    xt = x.clone().requires_grad_(True)
    (want,) = torch.autograd.grad((Pool()(xt) * torch.from_numpy(w)).sum(), [xt])
    got = onnxtrain.InferenceSession(gmodel.SerializeToString()).run(["x_grad"], {"x": x.numpy()})[0]
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=0)
