"""Graph rewrites for onnxruntime (onnxtrain/engine/ort_rewrites.py): same values as the graph given,
computed by onnxruntime itself on both graphs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.engine.backends import make_plan
from onnxtrain.engine.ort_rewrites import rewrite_for_onnxruntime
from onnxtrain.ir.graphs import node_reads

ort = pytest.importorskip("onnxruntime")


def pool_model(c: int = 3, h: int = 8, w: int = 8, elem: int = TensorProto.FLOAT, opset: int = 17,
               **attrs) -> onnx.ModelProto:
    """X (dynamic batch) → MaxPool → (Y, Indices), both graph outputs."""
    attrs = {"kernel_shape": [2, 2], "strides": [2, 2], **attrs}
    node = helper.make_node("MaxPool", ["x"], ["y", "i"], name="pool", **attrs)
    g = helper.make_graph([node], "pool", [helper.make_tensor_value_info("x", elem, ["N", c, h, w])],
                          [helper.make_tensor_value_info("y", elem, None),
                           helper.make_tensor_value_info("i", TensorProto.INT64, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)
    return onnx.shape_inference.infer_shapes(model)


def run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


@pytest.mark.parametrize("shape,kernel,elem,opset", [
    ((4, 3, 8, 8), [2, 2], TensorProto.FLOAT, 17),
    ((1, 6, 28, 28), [2, 2], TensorProto.FLOAT, 13),
    ((3, 2, 9, 6), [3, 2], TensorProto.FLOAT, 11),
    ((2, 2, 6, 6), [3, 3], TensorProto.DOUBLE, 21),
    ((2, 2, 8, 6), [4, 2], TensorProto.FLOAT, 17),  # four rows: the offset from the table
])
def test_tiling_max_pool_indices_by_argmax_equal_onnxruntimes_own(shape, kernel, elem, opset) -> None:
    """Windows that tile the input: the Indices come from ArgMax, equal to MaxPool's own (ties included:
    the first maximum in row-major window order), for several batch sizes of one graph, at opsets 11-21."""
    model = pool_model(*shape[1:], elem=elem, opset=opset, kernel_shape=kernel, strides=kernel)
    new = rewrite_for_onnxruntime(model)
    onnx.checker.check_model(new, full_check=True)
    ops = [n.op_type for n in new.graph.node]
    assert "ArgMax" in ops and len(new.graph.node[0].output) == 1, ops
    read = {i for n in new.graph.node for i in n.input}
    assert [t.name for t in new.graph.initializer if t.name not in read] == []  # onnxruntime would warn
    rng = np.random.default_rng(0)
    for batch in (shape[0], 1, 5):
        x = np.maximum(rng.standard_normal((batch, *shape[1:])), 0)  # ReLU'd: windows of tied zeros
        x = x.astype(helper.tensor_dtype_to_np_dtype(elem))
        want, got = run(model, x), run(new, x)
        for a, b in zip(want, got):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("attrs,size", [
    ({"kernel_shape": [3, 3], "strides": [2, 2]}, 9),  # overlapping windows
    ({"pads": [1, 1, 1, 1]}, 8),
    ({}, 9),  # the last row and column are in no window
    ({"ceil_mode": 1}, 9),
    ({"dilations": [2, 2], "strides": [2, 2]}, 8),
    ({"storage_order": 1}, 8),
    ({"auto_pad": "SAME_UPPER"}, 8),
    ({"opset": 10}, 8),  # no Range before opset 11
])
def test_other_pools_are_left_alone(attrs, size) -> None:
    model = pool_model(h=size, w=size, **attrs)
    assert rewrite_for_onnxruntime(model) is model


def test_pools_without_indices_or_static_sizes_are_left_alone() -> None:
    no_indices = pool_model()
    del no_indices.graph.node[0].output[1:]
    del no_indices.graph.output[1:]
    assert rewrite_for_onnxruntime(no_indices) is no_indices
    dynamic = pool_model()
    dynamic.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "H"
    del dynamic.graph.value_info[:]
    assert rewrite_for_onnxruntime(dynamic) is dynamic


def test_new_names_do_not_clash_with_the_graphs() -> None:
    model = pool_model()
    clash = helper.make_node("Identity", ["x"], ["i/argmax_split"], name="Transpose")
    model.graph.node.append(clash)
    out = helper.make_tensor_value_info("i/argmax_split", TensorProto.FLOAT, ["N", 3, 8, 8])
    model.graph.output.append(out)
    new = rewrite_for_onnxruntime(model)
    onnx.checker.check_model(new, full_check=True)
    values = [o for n in new.graph.node for o in n.output] + [t.name for t in new.graph.initializer]
    assert len(values) == len(set(values))
    names = [n.name for n in new.graph.node]
    assert len(names) == len(set(names))
    x = np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32)
    for a, b in zip(run(model, x), run(new, x)):
        np.testing.assert_array_equal(a, b)


def test_the_onnxruntime_plan_runs_the_rewritten_graph_unless_optimisations_are_off() -> None:
    from onnxtrain import SessionOptions

    model = pool_model()
    plan = make_plan(model, "onnxruntime")
    assert "ArgMax" in [n.op_type for n in plan.onnxruntime_model.graph.node]
    assert plan.model is model  # the interface stays the graph given
    so = SessionOptions()
    so.graph_optimization_level = 0  # ORT_DISABLE_ALL
    assert make_plan(model, "onnxruntime", options=so).onnxruntime_model is model
    x = np.random.default_rng(2).standard_normal((3, 3, 8, 8)).astype(np.float32)
    for a, b in zip(plan.run({"x": x}), run(model, x)):
        np.testing.assert_array_equal(a, b)


def test_unused_indices_are_dropped() -> None:
    """Indices nothing reads (and no graph output): the pool simply runs without them, whatever the
    windows."""
    model = pool_model(kernel_shape=[3, 3], strides=[2, 2], h=9, w=9)
    del model.graph.output[1:]
    new = rewrite_for_onnxruntime(model)
    onnx.checker.check_model(new, full_check=True)
    assert [n.op_type for n in new.graph.node] == ["MaxPool"] and list(new.graph.node[0].output) == ["y"]
    x = np.random.default_rng(3).standard_normal((2, 3, 9, 9)).astype(np.float32)
    np.testing.assert_array_equal(run(model, x)[0], run(new, x)[0])


def where_model(
    elem: int = TensorProto.FLOAT, zero: float = 0.0, zero_first: bool = False
) -> onnx.ModelProto:
    """dx = Where(x > 0, dy, 0) (or Where(x <= 0, 0, dy)): the ReLU gradient, zero a constant initializer."""
    np_t = helper.tensor_dtype_to_np_dtype(elem)
    cmp = helper.make_node("LessOrEqual" if zero_first else "Greater", ["x", "z"], ["m"])
    where = helper.make_node("Where", ["m", "z", "dy"] if zero_first else ["m", "dy", "z"], ["dx"], name="w")
    g = helper.make_graph(
        [cmp, where],
        "relu_grad",
        [
            helper.make_tensor_value_info("x", elem, ["N", 5]),
            helper.make_tensor_value_info("dy", elem, ["N", 5]),
        ],
        [helper.make_tensor_value_info("dx", elem, ["N", 5])],
        [onnx.numpy_helper.from_array(np.array(zero, np_t), "z")],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


@pytest.mark.parametrize(
    "elem,zero_first",
    [
        (TensorProto.FLOAT, False),
        (TensorProto.FLOAT, True),
        (TensorProto.DOUBLE, False),
        (TensorProto.FLOAT16, False),
    ],
)
def test_where_with_a_zero_becomes_a_mask_multiply(elem: int, zero_first: bool) -> None:
    model = where_model(elem, zero_first=zero_first)
    new = rewrite_for_onnxruntime(model)
    onnx.checker.check_model(new, full_check=True)
    ops = [n.op_type for n in new.graph.node]
    # the check reads the masked operand (float16: its product by 0, whose sum cannot overflow)
    check = ["Mul", "ReduceSum"] if elem == TensorProto.FLOAT16 else ["ReduceSum", "Sub"]
    assert "Where" not in ops and ops[-4:] == [*check, "IsNaN", "If"], ops
    assert new.graph.node[-4].input[0] == "dy"
    fast = branch_ops(new.graph.node[-1], "else_branch")
    assert fast == ["Not", "Cast", "Mul"] if zero_first else ["Cast", "Mul"], fast
    rng = np.random.default_rng(3)
    np_t = helper.tensor_dtype_to_np_dtype(elem)
    x = rng.standard_normal((7, 5)).astype(np_t)
    x[0] = 0  # the boundary: x = 0 is masked by Greater
    dy = rng.standard_normal((7, 5)).astype(np_t)
    feeds = {"x": x, "dy": dy}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )[0]
    got = ort.InferenceSession(new.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[
        0
    ]
    np.testing.assert_array_equal(got, want)  # -0 where a negative dy is masked: equal to +0
    _same_non_finite_values(model, new, feeds, "dy", x > 0 if not zero_first else x > 0)


@pytest.mark.parametrize("elem", [TensorProto.FLOAT, TensorProto.FLOAT16])
def test_the_where_check_tells_finite_from_not(elem: int) -> None:
    """The If's condition is false for finite values (for float16, 131,075 ones, whose float16 sum
    overflows: the fast form stays) and true for one inf or NaN among them."""
    new = rewrite_for_onnxruntime(where_model(elem))
    bad = next(n.output[0] for n in new.graph.node if n.op_type == "IsNaN")
    new.graph.output.append(helper.make_tensor_value_info(bad, TensorProto.BOOL, []))
    np_t = helper.tensor_dtype_to_np_dtype(elem)
    x = np.ones((26215, 5), np_t)
    sess = ort.InferenceSession(new.SerializeToString(), providers=["CPUExecutionProvider"])
    for value, want in ((None, False), (np.inf, True), (np.nan, True)):
        dy = np.ones((26215, 5), np_t)
        if value is not None:
            dy[7, 3] = value
        dx, flag = sess.run(None, {"x": x, "dy": dy})
        assert bool(flag) == want, (value, flag)
        np.testing.assert_array_equal(dx, dy)  # every x > 0: dy itself


def branch_ops(node: onnx.NodeProto, branch: str) -> list[str]:
    """The op types of an If node's ``then_branch`` or ``else_branch``."""
    return [n.op_type for n in next(a.g for a in node.attribute if a.name == branch).node]


def _same_non_finite_values(model: onnx.ModelProto, new: onnx.ModelProto, feeds: dict, name: str,
                            kept: np.ndarray) -> None:
    """``new`` gives ``model``'s values (onnxruntime running the Where, the oracle) when ``feeds[name]``
    holds non-finite values: masked inf or NaN (0·inf and 0·NaN would be NaN; the fast form falls back to
    the Where), unmasked inf of one sign (the fast form's own values), unmasked inf of both signs."""
    masked, unmasked = np.argwhere(~kept), np.argwhere(kept)
    assert len(masked) > 1 and len(unmasked) > 1
    cases = {"masked inf": [(masked[0], np.inf)], "masked nan": [(masked[1], np.nan)],
             "unmasked inf": [(unmasked[0], np.inf)],
             "unmasked ±inf": [(unmasked[0], np.inf), (unmasked[1], -np.inf)]}
    for case, values in cases.items():
        fed = {k: v.copy() for k, v in feeds.items()}
        for at, v in values:
            fed[name][tuple(at)] = v
        want = run_feeds(model, fed)
        np.testing.assert_array_equal(run_feeds(new, fed), want, err_msg=case)
        assert not np.isfinite(want).all() or case.startswith("masked"), case


def test_where_with_another_constant_stays() -> None:
    for zero in (1.0, -0.0):
        model = where_model(zero=zero)
        assert rewrite_for_onnxruntime(model) is model


def test_where_of_a_zero_and_an_infinite_constant_stays() -> None:
    """Where(mask, -inf, 0), the bias of ONNX's Attention body: as a Mul it would give 0·inf = NaN."""
    for fill_first in (True, False):
        model = where_model()
        fill = onnx.numpy_helper.from_array(np.array(-np.inf, np.float32), "inf")
        model.graph.initializer.append(fill)
        where = model.graph.node[1]
        where.input[1:] = ["inf", "z"] if fill_first else ["z", "inf"]
        new = rewrite_for_onnxruntime(model)
        assert "Mul" not in [n.op_type for n in new.graph.node]
        x = np.array([[-1, 0, 1, 2, -3]] * 2, np.float32)
        feeds = {"x": x, "dy": np.zeros_like(x)}
        sess = ort.InferenceSession(new.SerializeToString(), providers=["CPUExecutionProvider"])
        got = sess.run(None, feeds)
        want = np.where(x > 0, *((-np.inf, 0.0) if fill_first else (0.0, -np.inf))).astype(np.float32)
        np.testing.assert_array_equal(got[0], want)


def test_the_fallback_where_keeps_its_zero() -> None:
    """The Constant zero of a gradient's Where is read by the If's fallback Where once the Where is a Mul:
    it stays, and the rewritten graph is valid."""
    zero = helper.make_node("Constant", [], ["zero"], value=onnx.numpy_helper.from_array(np.float32(0)))
    cmp = helper.make_node("Greater", ["x", "x0"], ["m"])
    where = helper.make_node("Where", ["m", "dy", "zero"], ["dx"])
    g = helper.make_graph(
        [zero, cmp, where],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3]) for n in ("x", "x0", "dy")],
        [helper.make_tensor_value_info("dx", TensorProto.FLOAT, [3])],
    )
    new = rewrite_for_onnxruntime(
        helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    )
    assert [n.op_type for n in new.graph.node] == ["Constant", "Greater", "ReduceSum", "Sub", "IsNaN", "If"]
    assert branch_ops(new.graph.node[-1], "else_branch") == ["Cast", "Mul"]
    then = next(a.g for a in new.graph.node[-1].attribute if a.name == "then_branch")
    assert [(n.op_type, n.input[2]) for n in then.node] == [("Where", "zero")]  # the fallback
    onnx.checker.check_model(new, full_check=True)


def causal_model(elem: int, fill: float, fill_first: bool) -> onnx.ModelProto:
    """scores [N, H, T, T] masked by a causal mask [1, 1, T, T] made at run time (the strict upper triangle
    of a fed block of ones): Where with a constant infinite fill, as torch exports attention masks."""
    np_t = helper.tensor_dtype_to_np_dtype(elem)
    nodes = [
        helper.make_node("Constant", [], ["k"], value=onnx.numpy_helper.from_array(np.array(fill, np_t))),
        helper.make_node("Trilu", ["ones", "one"], ["upper"], upper=1),
        helper.make_node("Cast", ["upper"], ["blocked"], to=TensorProto.BOOL),
        helper.make_node("Not", ["blocked"], ["keep"]),
        helper.make_node("Where", ["blocked", "k", "s"] if fill_first else ["keep", "s", "k"], ["y"]),
    ]
    g = helper.make_graph(
        nodes, "causal",
        [helper.make_tensor_value_info("s", elem, ["N", 2, "T", "T"]),
         helper.make_tensor_value_info("ones", elem, [1, 1, "T", "T"])],
        [helper.make_tensor_value_info("y", elem, ["N", 2, "T", "T"])],
        [onnx.numpy_helper.from_array(np.array(1, np.int64), "one")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


@pytest.mark.parametrize("elem,fill,fill_first", [
    (TensorProto.FLOAT, -np.inf, False),
    (TensorProto.FLOAT, -np.inf, True),
    (TensorProto.DOUBLE, np.inf, False),
    (TensorProto.FLOAT16, -np.inf, True),
])
def test_where_with_an_infinite_fill_becomes_an_add(elem: int, fill: float, fill_first: bool) -> None:
    """Where(mask, -inf, x) runs as Add(x, Where(mask, -inf, 0)): the Where on the mask's shape only, the
    values onnxruntime gives for the original graph (finite x), for several sequence lengths."""
    model = causal_model(elem, fill, fill_first)
    new = rewrite_for_onnxruntime(model)
    onnx.checker.check_model(new, full_check=True)
    check = ["Mul", "ReduceSum"] if elem == TensorProto.FLOAT16 else ["ReduceSum", "Sub"]
    assert [n.op_type for n in new.graph.node][-4:] == [*check, "IsNaN", "If"]
    assert branch_ops(new.graph.node[-1], "else_branch") == ["Where", "Add"]
    read = {i for n in new.graph.node for i in node_reads(n)}  # the fast branch reads the zero
    assert [t.name for t in new.graph.initializer if t.name not in read] == []
    np_t = helper.tensor_dtype_to_np_dtype(elem)
    rng = np.random.default_rng(4)
    for t in (1, 5, 8):
        feeds = {"s": rng.standard_normal((3, 2, t, t)).astype(np_t), "ones": np.ones((1, 1, t, t), np_t)}
        want = run_feeds(model, feeds)
        got = run_feeds(new, feeds)
        np.testing.assert_array_equal(got, want)
        assert np.isinf(want).any() or t == 1
    # a masked NaN or opposite infinity gets the fill, an unmasked infinity stays (the fast form's values
    # unless they hold a NaN, then the Where's)
    blocked = np.broadcast_to(np.triu(np.ones((t, t), bool), 1), feeds["s"].shape)
    _same_non_finite_values(model, new, feeds, "s", ~blocked)


def test_where_with_a_finite_fill_stays() -> None:
    model = causal_model(TensorProto.FLOAT, -1e9, False)
    assert [n.op_type for n in rewrite_for_onnxruntime(model).graph.node][-1] == "Where"


def run_feeds(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


@pytest.mark.parametrize("optimised", [True, False])
def test_inference_batch_norm_loses_outputs_nothing_reads(optimised: bool) -> None:
    """onnxruntime-training's eval model keeps the running-statistics outputs of an inference-mode
    BatchNormalization, which onnxruntime refuses to load: dropped (also with its optimisations off), the
    onnxruntime plan gives the numpy engine's values."""
    from onnxtrain import SessionOptions

    rng = np.random.default_rng(4)
    inits = [onnx.numpy_helper.from_array(v.astype(np.float32), n) for n, v in (
        ("scale", 1 + 0.1 * rng.standard_normal(3)), ("bias", rng.standard_normal(3)),
        ("mean", rng.standard_normal(3)), ("var", 1 + rng.uniform(size=3)))]
    node = helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y", "m", "v"],
                            training_mode=0)
    g = helper.make_graph([node], "bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 4])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    with pytest.raises(Exception, match="Training_mode = False"):
        run(model, np.zeros((1, 3, 4), np.float32))
    new = rewrite_for_onnxruntime(model, optimise=optimised)
    onnx.checker.check_model(new, full_check=True)
    assert list(new.graph.node[0].output) == ["y"]
    so = SessionOptions()
    if not optimised:
        so.graph_optimization_level = 0
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    got = make_plan(model, "onnxruntime", options=so).run({"x": x})[0]
    np.testing.assert_allclose(got, make_plan(model).run({"x": x})[0], rtol=1e-6, atol=1e-6)
    # read by a node, or a graph output: left as it is (onnxruntime then names the node)
    model.graph.output.append(helper.make_tensor_value_info("m", TensorProto.FLOAT, [3]))
    assert rewrite_for_onnxruntime(model) is model
    # before opset 14 the outputs set the mode: left as they are
    model.graph.output.pop()
    model.opset_import[0].version = 13
    del model.graph.node[0].attribute[:]
    assert rewrite_for_onnxruntime(model) is model
