"""Per-channel work on (N, C, H, W) values: broadcast operands spread over the planes
(engine/kernels/spread.py) and per-channel sums of products (engine/fusion/products.py)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxtrain.engine.kernels.spread import spread_shape
from onnxtrain.engine.plan import Plan
from tests.engine.graphs import model


def ops(plan: Plan) -> list[str]:
    return [st.node.op_type for st in plan.steps]


# operand shape, result shape, the shape it is spread to (None: left as it is)
SPREAD_SHAPES = [
    ((1, 96, 1, 1), (16, 96, 32, 32), (1, 96, 32, 32)),
    ((96, 1, 1), (16, 96, 8, 8), (1, 96, 8, 8)),  # fewer dims: aligned from the right
    ((1, 96, 1, 1), (2, 96, 8, 8), None),  # too few images to pay for the copy
    ((1, 96, 1, 1), (16, 96, 128, 128), None),  # planes long enough for numpy's own loop
    ((1, 1, 1, 1), (16, 96, 8, 8), None),  # one value: numpy's scalar loop
    ((1, 96, 8, 8), (16, 96, 8, 8), None),  # constant along the images only: already long runs
    ((16, 96, 1, 1), (16, 96, 8, 8), None),  # varies with the image
    ((1, 1, 8, 1), (16, 96, 8, 8), (1, 96, 8, 8)),
    ((96,), (16, 8, 96), None),  # varies along the last axis
    ((1, 4, 1, 1), (4, 4, 8, 8), None),  # too few values for the copy to pay
]


@pytest.mark.parametrize("operand, result, want", SPREAD_SHAPES, ids=str)
def test_spread_shape(operand, result, want) -> None:
    assert spread_shape(operand, result) == want


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Greater"])
@pytest.mark.parametrize("swap", [False, True])
def test_binary_ops_with_a_spread_operand_give_numpys_bits(op: str, swap: bool) -> None:
    from onnxtrain.engine.kernels import elementwise

    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 24, 10, 10)).astype(np.float32)  # 38,400 values: spread
    v = rng.standard_normal((1, 24, 1, 1)).astype(np.float32)
    a, b = (v, x) if swap else (x, v)
    ufunc = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Greater": np.greater}[op]
    kinds = {"y": TensorProto.BOOL} if op == "Greater" else None
    got = Plan(model([helper.make_node(op, ["a", "b"], ["y"])], ["a", "b"], ["y"], output_types=kinds),
               fuse=False)
    y = got.run({"a": a, "b": b})[0]
    assert elementwise.spread_operands(a, b)[1 if not swap else 0].shape == (1, 24, 10, 10)  # it spreads
    np.testing.assert_array_equal(y, ufunc(a, b))
    with pytest.raises(Exception, match="broadcast"):  # operands that do not broadcast still fail
        got.run({"a": x, "b": rng.standard_normal((1, 23, 1, 1)).astype(np.float32)})


def batch_norm_like() -> object:
    """x·k + (b − m·k) per channel and a ReLU: one cluster with two per-channel operands."""
    nodes = [
        helper.make_node("Sub", ["x", "m"], ["d"]),
        helper.make_node("Mul", ["d", "k"], ["dk"]),
        helper.make_node("Add", ["dk", "b"], ["z"]),
        helper.make_node("Mul", ["z", "z"], ["y"]),
    ]
    return model(nodes, ["x", "m", "k", "b"], ["y"])


def test_cluster_spreads_per_channel_operands_and_keeps_the_bits() -> None:
    from onnxtrain.engine.fusion.elementwise import Cluster

    fused, plain = Plan(batch_norm_like()), Plan(batch_norm_like(), fuse=False)
    assert ops(fused) == ["FusedElementwise"]
    rng = np.random.default_rng(1)
    for n in (16, 16, 2):  # traced, then run; then a batch too small to spread
        feeds = {"x": rng.standard_normal((n, 12, 14, 14)).astype(np.float32)}
        feeds |= {k: rng.standard_normal((1, 12, 1, 1)).astype(np.float32) for k in ("m", "k", "b")}
        np.testing.assert_array_equal(fused.run(feeds)[0], plain.run(feeds)[0])
    cluster = fused.steps[0].fn
    assert isinstance(cluster, Cluster)
    spread_ops = [op for prog in cluster.programs.values() for op in prog[0]
                  if getattr(op[1], "__name__", "") == "_spread_kernel"]
    assert len(spread_ops) == 3  # m, k and b, each copied out once


def channel_dot_model(reduce: str, opset: int, keepdims: int, product_read_elsewhere: bool = False):
    axes = [0, 2, 3]
    inputs = ["a", "b"]
    nodes = [helper.make_node("Mul", ["a", "b"], ["p"])]
    if opset >= 18 or reduce == "ReduceSum" and opset >= 13:
        nodes.append(helper.make_node("Constant", [], ["axes"], value_ints=axes))
        nodes.append(helper.make_node(reduce, ["p", "axes"], ["s"], keepdims=keepdims))
    else:
        nodes.append(helper.make_node(reduce, ["p"], ["s"], axes=axes, keepdims=keepdims))
    outputs = ["s", "p"] if product_read_elsewhere else ["s"]
    m = model(nodes, inputs, outputs)
    m.opset_import[0].version = opset
    return m


@pytest.mark.parametrize("reduce", ["ReduceSum", "ReduceMean"])
@pytest.mark.parametrize("opset", [11, 18])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_sum_of_a_product_over_all_but_the_channels_is_one_step(reduce: str, opset: int,
                                                                keepdims: int) -> None:
    plan = Plan(channel_dot_model(reduce, opset, keepdims))
    assert "ChannelDot" in ops(plan) and "Mul" not in ops(plan)
    rng = np.random.default_rng(2)
    a = rng.standard_normal((8, 5, 7, 9)).astype(np.float32)
    b = rng.standard_normal((8, 5, 7, 9)).astype(np.float32)
    want = (a.astype(np.float64) * b).sum(axis=(0, 2, 3), keepdims=bool(keepdims))
    if reduce == "ReduceMean":
        want /= 8 * 7 * 9
    got = plan.run({"a": a, "b": b})[0]
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    # broadcast products run unfused, as the plain plan does
    plain = Plan(channel_dot_model(reduce, opset, keepdims), fuse=False)
    for feeds in ({"a": a, "b": b[:1]}, {"a": a[:, :, :1], "b": b}):
        np.testing.assert_array_equal(plan.run(feeds)[0], plain.run(feeds)[0])


def test_a_sum_that_overflows_in_the_fused_order_is_made_by_the_original_steps() -> None:
    # every product is ±1.5e38 (finite); summed in another order than the unfused plan's, a partial sum
    # can pass float32's largest value: the fused step gave inf where the unfused plan gives 3e38
    m = channel_dot_model("ReduceSum", 18, 0)
    plan, plain = Plan(m), Plan(m, fuse=False)
    assert "ChannelDot" in ops(plan)
    signs = np.array([-1, -1, -1, 1, 1, 1, 1, -1, 1, 1, -1, 1, 1, -1, 1, -1], np.float32)
    feeds = {"a": (signs * np.float32(1.5e19)).reshape(1, 1, 1, 16),
             "b": np.full((1, 1, 1, 16), 1e19, np.float32)}
    got = plan.run(feeds)[0]
    np.testing.assert_array_equal(got, plain.run(feeds)[0])
    assert np.isfinite(got).all()
    exact = (feeds["a"].astype(np.float64) * feeds["b"]).sum(axis=(0, 2, 3))
    np.testing.assert_allclose(got, exact, rtol=1e-6)
    feeds["a"][0, 0, 0, 3] = np.nan  # a NaN sum: the unfused plan's own
    np.testing.assert_array_equal(plan.run(feeds)[0], plain.run(feeds)[0])


@pytest.mark.parametrize("axes", [[4, 2, 3], [0, 2, 7], [-5, 2, 3]])
def test_axes_out_of_range_fail_as_in_the_unfused_plan(axes: list[int]) -> None:
    nodes = [helper.make_node("Mul", ["a", "b"], ["p"]),
             helper.make_node("ReduceSum", ["p"], ["s"], axes=axes)]
    m = model(nodes, ["a", "b"], ["s"])
    m.opset_import[0].version = 11
    errors = []
    for plan in (Plan(m), Plan(m, fuse=False)):
        a = np.ones((4, 3, 5, 6), np.float32)
        with pytest.raises(Exception, match="out of range") as e:
            plan.run({"a": a, "b": a})
        errors.append(str(e.value))
    assert errors[0] == errors[1]


def test_a_product_read_elsewhere_is_not_fused() -> None:
    plan = Plan(channel_dot_model("ReduceSum", 18, 1, product_read_elsewhere=True))
    assert "ChannelDot" not in ops(plan)
