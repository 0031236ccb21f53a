"""The ReLU gradient under a max pool on the pooled positions (engine/fusion/pooled_relu_grad.py): the same
bits as the unfused steps, gradients against torch autograd in float64, and the pools it must leave alone."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxtrain.autodiff.builder import build_gradient_model
from onnxtrain.engine import fusion
from onnxtrain.engine.plan import Plan

F = TensorProto.FLOAT


def ops(plan: Plan) -> list[str]:
    return [st.node.op_type for st in plan.steps]


def pooled_shape(shape: tuple[int, ...], dtype: int, pool: dict) -> tuple[int, ...]:
    """The shape of MaxPool(Relu(x)) for an x of ``shape``, by running it."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("MaxPool", ["r"], ["p"], **pool)]
    g = helper.make_graph(nodes, "p", [helper.make_tensor_value_info("x", dtype, list(shape))],
                          [helper.make_tensor_value_info("p", dtype, [])])
    probe = Plan(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    return probe.run({"x": np.zeros(shape, helper.tensor_dtype_to_np_dtype(dtype))})[0].shape


def relu_pool_grad(shape: tuple[int, ...], dtype: int = F, *, mask_out: bool = False,
                   unpool_shape: bool = False, **pool: object) -> onnx.ModelProto:
    """g = Where(Relu(x) > 0, MaxUnpool(d, I), 0) with (p, I) = MaxPool(Relu(x)): the gradient the
    builder writes for a ReLU under a max pool, with the pooled gradient ``d`` an input."""
    np_dt = helper.tensor_dtype_to_np_dtype(dtype)
    unpool_in = ["d", "i"] + (["rshape"] if unpool_shape else [])
    nodes = [
        helper.make_node("Constant", [], ["zero"],
                         value=numpy_helper.from_array(np.zeros((), np_dt), "zero")),
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("MaxPool", ["r"], ["p", "i"], **pool),
        *([helper.make_node("Shape", ["r"], ["rshape"])] if unpool_shape else []),
        helper.make_node("MaxUnpool", unpool_in, ["u"], kernel_shape=pool["kernel_shape"],
                         strides=pool.get("strides", [1] * len(pool["kernel_shape"]))),
        helper.make_node("Greater", ["r", "zero"], ["m"]),
        helper.make_node("Where", ["m", "u", "zero"], ["g"]),
    ]
    pooled = pooled_shape(shape, dtype, pool)
    outs = [helper.make_tensor_value_info("g", dtype, list(shape)),
            helper.make_tensor_value_info("p", dtype, list(pooled))]
    if mask_out:
        outs.append(helper.make_tensor_value_info("m", TensorProto.BOOL, list(shape)))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", dtype, list(shape)),
                                       helper.make_tensor_value_info("d", dtype, list(pooled))], outs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def edge_feeds(model: onnx.ModelProto, np_dt, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """x with ties at zero (after the ReLU), exact ties among positives, -0.0, NaN and inf; d with -0.0,
    inf and NaN."""
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = rng.standard_normal(shape).astype(np_dt)
    flat = x.reshape(-1)
    flat[::7] = 1.5  # exact ties among positive values
    flat[3::11] = -0.0
    flat[5] = np.nan
    flat[17] = np.inf
    flat[29] = -np.inf
    dshape = [d.dim_value for d in model.graph.input[1].type.tensor_type.shape.dim]
    d = rng.standard_normal(dshape).astype(np_dt)
    dflat = d.reshape(-1)
    dflat[::5] = -0.0
    dflat[1] = np.inf
    dflat[2] = np.nan
    return {"x": x, "d": d}


def same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    it = {2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize]
    np.testing.assert_array_equal(a.view(it), b.view(it))


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT16, F, TensorProto.DOUBLE])
@pytest.mark.parametrize("shape,pool", [
    ((2, 3, 8, 8), {"kernel_shape": [2, 2], "strides": [2, 2]}),
    ((2, 2, 9, 11), {"kernel_shape": [3, 3], "strides": [3, 4]}),  # strides beyond the kernel: gaps
    ((3, 2, 10), {"kernel_shape": [2], "strides": [2]}),  # 1-D
    ((1, 2, 4, 6, 6), {"kernel_shape": [2, 3, 3], "strides": [2, 3, 3]}),  # 3-D
])
def test_fused_step_has_the_unfused_bits(dtype: int, shape: tuple[int, ...], pool: dict) -> None:
    np_dt = helper.tensor_dtype_to_np_dtype(dtype)
    model = relu_pool_grad(shape, dtype, **pool)
    onnx.checker.check_model(model, full_check=True)
    fused, plain = Plan(model), Plan(model, fuse=False)
    assert ops(fused).count("PooledReluGrad") == 1
    assert "MaxUnpool" not in ops(fused) and "Where" not in ops(fused)
    f = edge_feeds(model, np_dt, np.random.default_rng(len(shape) * dtype))
    with np.errstate(invalid="ignore"):
        pooled = plain.run(f)[1]
        live = np.flatnonzero(pooled > 0)
        f["d"].reshape(-1)[live[:2]] = [np.nan, -np.inf]  # in windows the select keeps
        (got, p), want = fused.run(f), plain.run(f)[0]
    same_bits(got, want)
    same_bits(p, pooled)
    r = np.maximum(f["x"], 0)
    assert (got[~(r > 0)] == 0).all()  # zero where R ≤ 0 or is NaN
    assert np.isnan(got).sum() == 1 and np.isneginf(got).sum() == 1  # d's values in kept windows
    assert (got != 0).sum() <= pooled.size  # at most one value a window


@pytest.mark.parametrize("pool,why", [
    ({"kernel_shape": [3, 3], "strides": [2, 2]}, "overlapping windows"),
    ({"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 1, 1, 1]}, "padding"),
    ({"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}, "ceil mode"),
    ({"kernel_shape": [2, 2], "strides": [2, 2], "dilations": [2, 2]}, "dilations"),
])
def test_pools_it_leaves_alone(pool: dict, why: str) -> None:
    model = relu_pool_grad((2, 3, 9, 9), **pool)
    assert "PooledReluGrad" not in ops(Plan(model)), why


def test_a_mask_read_elsewhere_is_not_fused() -> None:
    model = relu_pool_grad((2, 3, 8, 8), mask_out=True, kernel_shape=[2, 2], strides=[2, 2])
    fused = Plan(model)
    assert "PooledReluGrad" not in ops(fused)
    f = edge_feeds(model, np.float32, np.random.default_rng(3))
    with np.errstate(invalid="ignore"):
        for a, b in zip(fused.run(f), Plan(model, fuse=False).run(f)):
            np.testing.assert_array_equal(a, b)


def test_an_odd_size_the_unpool_does_not_restore_runs_the_original_steps() -> None:
    """A 9 × 9 activation pooled 2 × 2 unpools to 8 × 8: the original select cannot broadcast the two and
    fails; the fused step sees the shapes differ and runs the original steps, which fail the same way. Given
    the activation's shape, the unpool restores it and the fused step answers."""
    model = relu_pool_grad((2, 3, 9, 9), kernel_shape=[2, 2], strides=[2, 2])
    f = edge_feeds(model, np.float32, np.random.default_rng(4))
    assert "PooledReluGrad" in ops(Plan(model))
    with np.errstate(invalid="ignore"):
        for plan in (Plan(model), Plan(model, fuse=False)):
            with pytest.raises(Exception, match="broadcast|shape"):
                plan.run(f)
        model = relu_pool_grad((2, 3, 9, 9), unpool_shape=True, kernel_shape=[2, 2], strides=[2, 2])
        fused = Plan(model)
        assert "PooledReluGrad" in ops(fused)
        got, want = fused.run(f)[0], Plan(model, fuse=False).run(f)[0]
    assert got.shape == (2, 3, 9, 9)
    same_bits(got, want)


def relu_pool_loss(shape: tuple[int, ...], dtype: int, **pool: object) -> onnx.ModelProto:
    """loss = Σ w · MaxPool(Relu(x)) with its gradient graph for x, as the builder writes it."""
    np_dt = helper.tensor_dtype_to_np_dtype(dtype)
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], **pool),
             helper.make_node("Mul", ["p", "w"], ["pw"]),
             helper.make_node("ReduceSum", ["pw"], ["loss"], keepdims=0)]
    w = np.random.default_rng(7).standard_normal(pooled_shape(shape, dtype, pool)).astype(np_dt)
    g = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", dtype, list(shape))],
                          [helper.make_tensor_value_info("loss", dtype, [])],
                          [numpy_helper.from_array(w, "w")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return build_gradient_model(model, "loss", ["x"])


def without_this_pass(model: onnx.ModelProto, monkeypatch: pytest.MonkeyPatch) -> Plan:
    """The model's plan with every fusion but this one."""
    with monkeypatch.context() as m:
        m.setattr(fusion, "fuse_pooled_relu_grads", lambda plan, steps: steps)
        return Plan(model)


@pytest.mark.parametrize("dtype,pool", [
    (F, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),  # ResNet's stem: overlapping
    (F, {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    (F, {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [2, 2, 2, 2]}),  # windows wholly in the padding
    (TensorProto.DOUBLE, {"kernel_shape": [2, 2], "strides": [2, 2]}),
    (TensorProto.FLOAT16, {"kernel_shape": [3, 3], "strides": [1, 1]}),
])
def test_scatter_form_has_the_unfused_bits(dtype: int, pool: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pools the builder takes back by a scatter-add (overlapping or padded windows, types other than
    float32): the same fusion, the same bits as the plan without it, edge values included."""
    np_dt = helper.tensor_dtype_to_np_dtype(dtype)
    model = relu_pool_loss((2, 3, 9, 9), dtype, **pool)
    onnx.checker.check_model(model, full_check=True)
    fused = Plan(model)
    assert "PooledReluGrad" in ops(fused) and "ScatterElements" not in ops(fused)
    plain = without_this_pass(model, monkeypatch)
    assert "ScatterElements" in ops(plain) and "PooledReluGrad" not in ops(plain)
    x = np.random.default_rng(dtype).standard_normal((2, 3, 9, 9)).astype(np_dt)
    flat = x.reshape(-1)
    flat[::7] = 1.5  # ties among positive values (overlapping windows share their maxima)
    flat[3::11] = -0.0
    flat[17] = np.inf
    flat[29] = -np.inf
    for feed in (x, np.where(np.arange(x.size).reshape(x.shape) == 40, np.nan, x).astype(np_dt)):
        with np.errstate(invalid="ignore", over="ignore"):
            got, want = fused.run({"x": feed})[1], plain.run({"x": feed})[1]
        same_bits(got, want)
        assert (got[~(np.maximum(feed, 0) > 0)] == 0).all()


def test_a_scatter_at_index_minus_one_runs_the_original_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hand-written scatter of the pooled gradient without the builder's zeroing of the windows wholly in
    the padding (index -1: the last element): the value sent there is masked by R's last element, not by the
    window's -inf, so the fused step must run the original steps."""
    nodes = [
        helper.make_node("Constant", [], ["zero"],
                         value=numpy_helper.from_array(np.zeros((), np.float32), "z")),
        helper.make_node("Constant", [], ["flat"], value=numpy_helper.from_array(np.array([-1]), "f")),
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("MaxPool", ["r"], ["p", "i"], kernel_shape=[2, 2], strides=[2, 2],
                         pads=[2, 2, 2, 2]),
        helper.make_node("Shape", ["r"], ["rshape"]),
        helper.make_node("Size", ["r"], ["n"]),
        helper.make_node("Reshape", ["n", "flat"], ["n1"]),
        helper.make_node("ConstantOfShape", ["n1"], ["zeros"]),
        helper.make_node("Reshape", ["i", "flat"], ["fi"]),
        helper.make_node("Reshape", ["d", "flat"], ["fd"]),
        helper.make_node("ScatterElements", ["zeros", "fi", "fd"], ["s"], axis=0, reduction="add"),
        helper.make_node("Reshape", ["s", "rshape"], ["u"]),
        helper.make_node("Greater", ["r", "zero"], ["m"]),
        helper.make_node("Where", ["m", "u", "zero"], ["g"]),
    ]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [1, 1, 4, 4]),
                                       helper.make_tensor_value_info("d", F, [1, 1, 4, 4])],
                          [helper.make_tensor_value_info("g", F, [1, 1, 4, 4])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    fused, plain = Plan(model), without_this_pass(model, monkeypatch)
    assert "PooledReluGrad" in ops(fused)
    x = np.arange(1, 17, dtype=np.float32).reshape(1, 1, 4, 4)  # every R > 0, the last one too
    got, want = fused.run({"x": x, "d": np.ones((1, 1, 4, 4), np.float32)})[0], plain.run(
        {"x": x, "d": np.ones((1, 1, 4, 4), np.float32)})[0]
    same_bits(got, want)
    assert got[0, 0, -1, -1] > 1  # the windows in the padding sent their 1s to the last element


torch = pytest.importorskip("torch")


def test_relu_pool_block_gradient_against_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """loss = Σ w · MaxPool(Relu(Conv(x))) in float32 with static shapes (the builder's MaxUnpool form): the
    gradient graph run fused, against torch autograd in float64 on the same values."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((4, 2, 12, 12)).astype(np.float32)
    wc = rng.standard_normal((3, 2, 3, 3)).astype(np.float32)
    w = rng.standard_normal((4, 3, 5, 5)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "wc"], ["c"]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Mul", ["p", "w"], ["pw"]),
             helper.make_node("ReduceSum", ["pw"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", F, list(x.shape))],
                          [helper.make_tensor_value_info("loss", F, [])],
                          [numpy_helper.from_array(wc, "wc"), numpy_helper.from_array(w, "w")])
    model = build_gradient_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]),
                                 "loss", ["x", "wc"])
    onnx.checker.check_model(model, full_check=True)
    plan = Plan(model)
    assert "PooledReluGrad" in ops(plan) and "MaxUnpool" not in ops(plan)
    names = [o.name for o in model.graph.output]
    out = dict(zip(names, plan.run({"x": x})))
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    twc = torch.tensor(wc, dtype=torch.float64, requires_grad=True)
    loss = (torch.nn.functional.max_pool2d(torch.relu(torch.nn.functional.conv2d(tx, twc)), 2)
            * torch.tensor(w, dtype=torch.float64)).sum()
    loss.backward()
    np.testing.assert_allclose(out["loss"], loss.item(), rtol=1e-5)
    np.testing.assert_allclose(out["x_grad"], tx.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["wc_grad"], twc.grad.numpy(), rtol=1e-5, atol=1e-4)
    # the same plan without this one pass (the others reorder the weight gradient's sums)
    without = without_this_pass(model, monkeypatch)
    assert "MaxUnpool" in ops(without) and "PooledReluGrad" not in ops(without)
    plain = dict(zip(names, without.run({"x": x})))
    for k in ("x_grad", "wc_grad"):
        same_bits(out[k], plain[k])


def test_overlapping_pool_gradient_against_torch() -> None:
    """ResNet's stem pool (3×3, stride 2, pad 1) after a ReLU, fused in its scatter form: the gradient
    against torch autograd in float64 (distinct values: no ties to break differently)."""
    model = relu_pool_loss((2, 4, 11, 11), TensorProto.DOUBLE, kernel_shape=[3, 3], strides=[2, 2],
                           pads=[1, 1, 1, 1])
    plan = Plan(model)
    assert "PooledReluGrad" in ops(plan)
    x = np.random.default_rng(12).standard_normal((2, 4, 11, 11))
    loss, grad = plan.run({"x": x})
    w = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "w"))
    tx = torch.tensor(x, requires_grad=True)
    want = (torch.nn.functional.max_pool2d(torch.relu(tx), 3, 2, 1) * torch.tensor(w)).sum()
    want.backward()
    np.testing.assert_allclose(loss, want.item(), rtol=1e-12)
    np.testing.assert_allclose(grad, tx.grad.numpy(), rtol=1e-12, atol=1e-14)


def test_a_scatter_into_rows_of_several_values_is_left_to_its_steps() -> None:
    # the scatter form with a 2-D target: along axis 0 of (M, K) the j-th value goes to flat position
    # I[j]·K, not I[j], so masking it by its own window's pooled value is wrong; the original steps run
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("Constant", [], ["zeros"],
                         value=numpy_helper.from_array(np.zeros((4, 2), np.float32))),
        helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(np.zeros((), np.float32))),
        helper.make_node("Constant", [], ["s21"], value=numpy_helper.from_array(np.array([2, 1], np.int64))),
        helper.make_node("MaxPool", ["x"], ["p", "i"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Reshape", ["i", "s21"], ["fi"]),
        helper.make_node("ScatterElements", ["zeros", "fi", "d"], ["s"], axis=0, reduction="add"),
        helper.make_node("Shape", ["x"], ["xshape"]),
        helper.make_node("Reshape", ["s", "xshape"], ["u"]),
        helper.make_node("Greater", ["x", "zero"], ["m"]),
        helper.make_node("Where", ["m", "u", "zero"], ["g"]),
    ]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, [1, 1, 2, 4]),
                                       helper.make_tensor_value_info("d", f, [2, 1])],
                          [helper.make_tensor_value_info("g", f, [1, 1, 2, 4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m, full_check=True)
    fused, plain = Plan(m), Plan(m, fuse=False)
    assert "PooledReluGrad" in ops(fused)
    feeds = {"x": np.array([[[[0, 5, -1, 7], [0, 0, 0, 0]]]], np.float32),
             "d": np.array([[10], [20]], np.float32)}
    got, want = fused.run(feeds)[0], plain.run(feeds)[0]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, ReferenceEvaluator(m).run(None, feeds)[0])
