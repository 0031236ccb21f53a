"""Bias gradients summed right after their input is made (onnxtrain/engine/fusion/early_sums.py).

The gradient graph of a two-layer MLP with a cross-entropy loss comes from autodiff: each Gemm's gradient is
two products and then the bias's ``ReduceSum`` of dY. The fused plan must run each sum right after the step
making dY and give the same bits as the unfused plan (``Plan(fuse=False)``), with NaN and ±inf among the
values; torch's float64 autograd is the independent oracle for the values.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine.fusion import early_sums
from onnxtrain.engine.plan import Plan

SIZES = (7, 6, 5)  # inputs, hidden, classes


def _weights(dtype) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    i, h, c = SIZES
    return {"w1": rng.standard_normal((h, i)).astype(dtype), "b1": rng.standard_normal(h).astype(dtype),
            "w2": rng.standard_normal((c, h)).astype(dtype), "b2": rng.standard_normal(c).astype(dtype)}


def _model(dtype) -> onnx.ModelProto:
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], transB=1),
             helper.make_node("SoftmaxCrossEntropyLoss", ["y", "t"], ["loss"], reduction="mean")]
    inits = [numpy_helper.from_array(v, k) for k, v in _weights(dtype).items()]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", et, ["N", SIZES[0]]),
                                         helper.make_tensor_value_info("t", onnx.TensorProto.INT64, ["N"])],
                          [helper.make_tensor_value_info("loss", et, [])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _grad(dtype) -> onnx.ModelProto:
    return build_gradient_model(_model(dtype), "loss", ["w1", "b1", "w2", "b2"])


def _feeds(n: int, dtype, special: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, SIZES[0])).astype(dtype)
    if special and n > 2:
        x[0, 1], x[1, 2], x[2, 0] = np.nan, np.inf, -np.inf
    return {"x": x, "t": rng.integers(0, SIZES[2], n).astype(np.int64)}


def _bits(a) -> tuple:
    a = np.asarray(a)
    return a.dtype.str, a.shape, a.tobytes()


def _torch_grads(f: dict[str, np.ndarray], dtype) -> list[np.ndarray]:
    w = {k: torch.tensor(v.astype(np.float64), requires_grad=True) for k, v in _weights(dtype).items()}
    x = torch.tensor(f["x"].astype(np.float64))
    y = torch.relu(x @ w["w1"].T + w["b1"]) @ w["w2"].T + w["b2"]
    loss = torch.nn.functional.cross_entropy(y, torch.tensor(f["t"]))
    loss.backward()
    return [loss.detach().numpy()] + [w[k].grad.numpy() for k in ("w1", "b1", "w2", "b2")]


def test_each_bias_sum_follows_the_step_making_its_input() -> None:
    plan = Plan(_grad(np.float32))
    sums = [k for k, st in enumerate(plan.steps) if st.node.op_type == "ReduceSum"]
    assert len(sums) == 2
    made_by = {s: k for k, st in enumerate(plan.steps) for s in st.outputs}
    for k in sums:
        assert made_by[plan.steps[k].inputs[0]] == k - 1
        assert plan.steps[k + 1].node.op_type == "Gemm"  # the products now come after it


@pytest.mark.parametrize("n", [1, 3, 64])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_same_bits_as_the_unfused_plan(n: int, dtype) -> None:
    g = _grad(dtype)
    fused, plain = Plan(g), Plan(g, fuse=False)
    for special in (False, True):
        f = _feeds(n, dtype, special)
        got = fused.run(dict(f))
        assert [_bits(v) for v in got] == [_bits(v) for v in plain.run(dict(f))]
        if not special:
            tol = 1e-5 if dtype == np.float32 else 1e-12
            for a, b in zip(got, _torch_grads(f, dtype)):
                np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def _order_without_the_pass(monkeypatch) -> list[str]:
    monkeypatch.setattr("onnxtrain.engine.fusion.sum_early", lambda plan, steps: steps)
    return [st.node.name for st in Plan(_grad(np.float32)).steps]


def test_the_pass_is_what_moves_the_sums(monkeypatch) -> None:
    moved = [st.node.name for st in Plan(_grad(np.float32)).steps]
    before = _order_without_the_pass(monkeypatch)
    assert sorted(moved) == sorted(before) and moved != before


def test_a_sum_behind_another_kind_of_step_stays(monkeypatch) -> None:
    plan = Plan(_grad(np.float32), fuse=False)
    steps = list(plan.steps)
    k = next(k for k, st in enumerate(steps) if st.node.op_type == "ReduceSum")
    p = next(m for m, st in enumerate(steps) if steps[k].inputs[0] in st.outputs)
    assert p < k - 1
    monkeypatch.setattr(early_sums, "PRODUCTS", frozenset())  # nothing counts as a product: nothing moves
    assert early_sums.sum_early(plan, steps) == steps


def _row_bias_grad(rows: int) -> onnx.ModelProto:
    """``loss = sum(Gemm(2x, w, b)^2)`` with a per-row bias ``b`` (rows, 1) of a 2-column Gemm: the bias's
    gradient sums dY over axis 1, half as large as dY."""
    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array(np.array(2.0, np.float32), "s"),
             numpy_helper.from_array(rng.standard_normal((2, 2)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((rows, 1)).astype(np.float32), "b")]
    nodes = [helper.make_node("Mul", ["x", "s"], ["x2"]), helper.make_node("Gemm", ["x2", "w", "b"], ["h"]),
             helper.make_node("ReduceSumSquare", ["h"], ["loss"], keepdims=0)]
    f32 = onnx.TensorProto.FLOAT
    g = helper.make_graph(nodes, "rows", [helper.make_tensor_value_info("x", f32, [rows, 2])],
                          [helper.make_tensor_value_info("loss", f32, [])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    return build_gradient_model(m, "loss", ["w", "b", "x"])


def test_a_large_sum_stays_and_the_peak_with_it(monkeypatch) -> None:
    rows = 1 << 14
    g = _row_bias_grad(rows)
    x = np.random.default_rng(6).standard_normal((rows, 2)).astype(np.float32)
    fused = Plan(g)
    got = fused.run({"x": x})
    monkeypatch.setattr("onnxtrain.engine.fusion.sum_early", lambda plan, steps: steps)
    plain = Plan(g)
    want = plain.run({"x": x})
    assert [_bits(v) for v in got] == [_bits(v) for v in want]
    assert fused.peak_bytes == plain.peak_bytes
    assert [st.node.name for st in fused.steps] == [st.node.name for st in plain.steps]
    # the values: d/db sum((2x w + b)^2) = 2 (2x w + b) summed over the row, in float64
    init = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in g.graph.initializer}
    h = 2 * x.astype(np.float64) @ init["w"] + init["b"]
    names = [o.name for o in g.graph.output]
    np.testing.assert_allclose(got[names.index("b_grad")], (2 * h).sum(axis=1, keepdims=True),
                               rtol=1e-4, atol=1e-4)
