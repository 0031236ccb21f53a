"""Exact rounding (exact_rounding.py) of sources inside If, Loop and Scan bodies whose results leave the body
(or go around a Loop) and decide after it; of a source read by MaxPool's Indices; of a nested control-flow
node read at the model's opset; and the sign tests of a Sigmoid, which decide nothing.

The oracle is the C library's double-precision log and exp (Python's ``math``) rounded to float32 once, then
float32 IEEE arithmetic; each value test also shows that numpy's float32 route floors some of its inputs
differently on this host (AVX-512: its SIMD log and exp are one ulp off on 10-48 % of inputs).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.engine.exact_kernels import sigmoid64
from onnxtrain.engine.exact_rounding import deciding_sources, rounds_exactly, zero_slots
from onnxtrain.engine.plan import Plan


def _told_apart(numpy_differs: bool) -> None:
    """After a test's oracle checks: skip (reporting it) where this host's numpy float32 route gives the
    oracle's results on the test's inputs, so that the test could not tell a marked step from an unmarked one
    here (numpy's SIMD log and exp are one ulp off on 10-48 % of inputs on AVX-512 hosts, correctly rounded
    on others)."""
    if not numpy_differs:
        pytest.skip("numpy's float32 route matches the oracle on these inputs here: nothing told apart")


def _near_powers_of_e() -> np.ndarray:
    """float32 inputs around e**1 .. e**8 (their logs near integers), a few hundred ulps apart."""
    near = np.float32([math.e ** k for k in range(1, 9)])[:, None]
    return (near + near * np.float32(2e-7) * np.arange(-200, 200, dtype=np.float32)).ravel()


def _libm_log(x: np.ndarray) -> np.ndarray:
    return np.array([math.log(float(v)) for v in x.ravel()], dtype=np.float32).reshape(x.shape)


def _body(nodes: list[onnx.NodeProto], inputs: list[tuple[str, int]], outputs: list[tuple[str, int]]
          ) -> onnx.GraphProto:
    return helper.make_graph(nodes, "body", [helper.make_tensor_value_info(n, t, None) for n, t in inputs],
                             [helper.make_tensor_value_info(n, t, None) for n, t in outputs])


def _model(nodes: list[onnx.NodeProto], outputs: list[tuple[str, int, list]], inits=(), opset: int = 17,
           x_shape: list | None = None) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape or ["n"])],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs], initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _marked(plan: Plan, op: str) -> list[bool]:
    """Whether each ``op`` step of ``plan`` and of its bodies (nested ones too) rounds once, in order."""
    found = []
    for st in plan.steps:
        if st.node.op_type == op:
            found.append(rounds_exactly(st.fn))
        for body in getattr(st.fn, "bodies", {}).values():
            found.extend(_marked(body.plan, op))
    return found


F = TensorProto.FLOAT
_TRUE = helper.make_tensor("c", TensorProto.BOOL, [], [True])


def _if_log_then_floor_after() -> onnx.ModelProto:
    """log(x) computed in an If's then-branch, floored after the If."""
    then = _body([helper.make_node("Log", ["x"], ["l"])], [], [("l", F)])
    other = _body([helper.make_node("Identity", ["x"], ["e"])], [], [("e", F)])
    nodes = [helper.make_node("If", ["c"], ["o"], then_branch=then, else_branch=other),
             helper.make_node("Floor", ["o"], ["f"])]
    return _model(nodes, [("o", F, ["n"]), ("f", F, ["n"])], [_TRUE])


@pytest.mark.parametrize("fuse", [True, False])
def test_a_log_in_an_if_branch_floored_after_the_if_is_rounded_once(fuse):
    x = _near_powers_of_e()
    plan = Plan(_if_log_then_floor_after(), fuse=fuse)
    assert _marked(plan, "Log") == [True]
    o, f = plan.run({"x": x})
    want = _libm_log(x)
    np.testing.assert_array_equal(o, want)
    np.testing.assert_array_equal(f, np.floor(want))
    _told_apart((np.floor(np.log(x)) != np.floor(want)).any())  # numpy's float32 log floors some differently


def test_a_log_in_an_if_branch_left_continuous_after_the_if_keeps_numpys_log():
    then = _body([helper.make_node("Log", ["x"], ["l"])], [], [("l", F)])
    other = _body([helper.make_node("Identity", ["x"], ["e"])], [], [("e", F)])
    nodes = [helper.make_node("If", ["c"], ["o"], then_branch=then, else_branch=other),
             helper.make_node("Add", ["o", "o"], ["f"])]
    plan = Plan(_model(nodes, [("f", F, ["n"])], [_TRUE]))
    assert _marked(plan, "Log") == [False]
    x = _near_powers_of_e()
    np.testing.assert_array_equal(plan.run({"x": x})[0], np.log(x) + np.log(x))


@pytest.mark.parametrize("fuse", [True, False])
def test_a_log_in_a_nested_if_branch_floored_outside_both_is_rounded_once(fuse):
    inner_then = _body([helper.make_node("Log", ["x"], ["l"])], [], [("l", F)])
    inner_else = _body([helper.make_node("Identity", ["x"], ["e"])], [], [("e", F)])
    inner = helper.make_node("If", ["c"], ["io"], then_branch=inner_then, else_branch=inner_else)
    outer_then = _body([inner, helper.make_node("Neg", ["io"], ["no"])], [], [("no", F)])
    outer_else = _body([helper.make_node("Identity", ["x"], ["e2"])], [], [("e2", F)])
    nodes = [helper.make_node("If", ["c"], ["o"], then_branch=outer_then, else_branch=outer_else),
             helper.make_node("Ceil", ["o"], ["f"])]
    plan = Plan(_model(nodes, [("f", F, ["n"])], [_TRUE]), fuse=fuse)
    assert _marked(plan, "Log") == [True]
    x = _near_powers_of_e()
    (f,) = plan.run({"x": x})
    want = np.ceil(-_libm_log(x))
    np.testing.assert_array_equal(f, want)
    _told_apart((np.ceil(-np.log(x)) != want).any())


@pytest.mark.parametrize("fuse", [True, False])
def test_a_log_carried_around_a_loop_and_floored_next_iteration_is_rounded_once(fuse):
    """v_{i+1} = log(v_i) · 3 (no decision in the step that computes it), floor(v_i) a scan output: the
    second iteration floors the first's log."""
    three = helper.make_tensor("three", F, [], [3.0])
    body = _body([helper.make_node("Identity", ["cond"], ["cond_out"]),
                  helper.make_node("Log", ["v"], ["l"]), helper.make_node("Mul", ["l", "three"], ["v2"]),
                  helper.make_node("Floor", ["v"], ["fl"])],
                 [("i", TensorProto.INT64), ("cond", TensorProto.BOOL), ("v", F)],
                 [("cond_out", TensorProto.BOOL), ("v2", F), ("fl", F)])
    n = helper.make_tensor("n", TensorProto.INT64, [], [2])
    nodes = [helper.make_node("Loop", ["n", "c", "x"], ["v_final", "fl_scan"], body=body)]
    plan = Plan(_model(nodes, [("v_final", F, ["n"]), ("fl_scan", F, [2, "n"])], [n, _TRUE, three]),
                fuse=fuse)
    assert _marked(plan, "Log") == [True]
    x = _near_powers_of_e()
    v, fl = plan.run({"x": x})
    v1 = _libm_log(x) * np.float32(3)
    np.testing.assert_array_equal(fl[1], np.floor(v1))
    np.testing.assert_array_equal(v, _libm_log(v1) * np.float32(3))
    _told_apart((np.floor(np.log(x) * np.float32(3)) != np.floor(v1)).any())


@pytest.mark.parametrize("fuse", [True, False])
def test_a_log_in_a_scan_body_as_its_final_state_then_floored_is_rounded_once(fuse):
    """A Scan whose state is the log of its last scanned row, floored after the Scan."""
    body = _body([helper.make_node("Log", ["e"], ["s2"]), helper.make_node("Identity", ["e"], ["y"])],
                 [("s", F), ("e", F)], [("s2", F), ("y", F)])
    zero = helper.make_tensor("zero", F, [], [0.0])
    nodes = [helper.make_node("Mul", ["x", "zero"], ["s0"]),
             helper.make_node("Scan", ["s0", "xs"], ["s_final", "ys"], body=body, num_scan_inputs=1),
             helper.make_node("Floor", ["s_final"], ["r"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["n"]),
                                           helper.make_tensor_value_info("xs", F, [1, "n"])],
                              [helper.make_tensor_value_info("r", F, ["n"])], initializer=[zero])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    plan = Plan(model, fuse=fuse)
    assert _marked(plan, "Log") == [True]
    x = _near_powers_of_e()
    (got,) = plan.run({"x": x, "xs": x[None]})
    want = np.floor(_libm_log(x))
    np.testing.assert_array_equal(got, want)
    _told_apart((np.floor(np.log(x)) != want).any())


def _raw_steps(plan_nodes: list[onnx.NodeProto], opset: int) -> list[tuple]:
    from onnxtrain.engine.registry import Attrs
    from onnxtrain.ir.attrs import parse_attributes
    from onnxtrain.ir.graphs import body_reads

    slots: dict[str, int] = {}
    raw = []
    for n in plan_nodes:
        ins = [slots.setdefault(i, len(slots)) for i in (*n.input, *body_reads(n))]
        outs = [slots.setdefault(o, len(slots)) if o else -1 for o in n.output]
        raw.append((n, None, Attrs(parse_attributes(n, opset), n.op_type, n.name, opset), ins, outs))
    return raw


def test_a_scan8_nested_in_a_body_is_read_at_the_models_opset():
    """Scan-8's first input is its sequence lengths: at opset 8, an If branch's Scan passes the captured
    Exp's result to the body's scanned input, which floors it (read as Scan-9, the same input would be
    the body's third input, which it does not have)."""
    scan_body = _body([helper.make_node("Identity", ["s"], ["s2"]), helper.make_node("Floor", ["e"], ["f"])],
                      [("s", F), ("e", F)], [("s2", F), ("f", F)])
    scan = helper.make_node("Scan", ["", "s0", "a"], ["sf", "fs"], body=scan_body, num_scan_inputs=1)
    then = _body([scan], [], [("fs", F)])
    other = _body([helper.make_node("Identity", ["a"], ["e2"])], [], [("e2", F)])
    nodes = [helper.make_node("Exp", ["x"], ["a"]),
             helper.make_node("If", ["c"], ["o"], then_branch=then, else_branch=other)]
    assert deciding_sources(_raw_steps(nodes, 8)) == {0}


def test_maxpools_indices_of_an_exp_mark_it_and_its_values_pass_the_walk_on():
    exp = helper.make_node("Exp", ["x"], ["a"])

    def pool(*outs: str) -> onnx.NodeProto:
        return helper.make_node("MaxPool", ["a"], list(outs), kernel_shape=[2])

    cases = [
        ([exp, pool("m", "i")], {0}),
        ([exp, pool("m")], set()),
        ([exp, pool("m", "")], set()),
        ([exp, pool("m"), helper.make_node("Floor", ["m"], ["f"])], {0}),
        # the max of exps keeps their signs: a sign test decides nothing
        ([exp, pool("m"), helper.make_node("Sign", ["m"], ["f"])], set()),
    ]
    for nodes, marked in cases:
        assert deciding_sources(_raw_steps(nodes, 17)) == marked, nodes


@pytest.mark.parametrize("fuse", [True, False])
def test_maxpools_indices_over_exps_are_those_of_the_correctly_rounded_exps(fuse):
    """Pairs of neighbouring float32 inputs whose correctly rounded exps are equal or one ulp apart: the
    Indices pick the first of equals, so an exp one ulp off moves them."""
    rng = np.random.default_rng(5)
    a = rng.uniform(-20, 20, 20000).astype(np.float32)
    b = np.nextafter(a, np.float32(np.inf))
    x = np.stack([a, b], 1).reshape(1, 1, -1)  # windows (a, b)
    nodes = [helper.make_node("Exp", ["x"], ["e"]),
             helper.make_node("MaxPool", ["e"], ["m", "i"], kernel_shape=[2], strides=[2])]
    model = _model(nodes, [("i", TensorProto.INT64, [1, 1, a.size])], x_shape=[1, 1, x.shape[2]])
    plan = Plan(model, fuse=fuse)
    assert _marked(plan, "Exp") == [True]
    (i,) = plan.run({"x": x})
    want = np.array([math.exp(float(v)) for v in x.ravel()], dtype=np.float32).reshape(-1, 2)
    np.testing.assert_array_equal(i.ravel(), 2 * np.arange(a.size) + np.argmax(want, 1))
    _told_apart((np.argmax(np.exp(x).reshape(-1, 2), 1) != np.argmax(want, 1)).any())


@pytest.mark.parametrize("chain, marked", [
    ([("Sigmoid", ["x"], ["a"]), ("Greater", ["a", "z"], ["m"])], set()),
    ([("Sigmoid", ["x"], ["a"]), ("Relu", ["a"], ["r"]), ("Sign", ["r"], ["m"])], set()),
    ([("Sigmoid", ["x"], ["a"]), ("Equal", ["a", "z"], ["m"])], set()),
    # a threshold other than 0, or a sign after a step that may round a value to 0: it decides
    ([("Sigmoid", ["x"], ["a"]), ("Greater", ["a", "x"], ["m"])], {1}),
    ([("Sigmoid", ["x"], ["a"]), ("Mul", ["a", "x"], ["p"]), ("Sign", ["p"], ["m"])], {1}),
    # a source before the Sigmoid moves where it becomes 0
    ([("Exp", ["x"], ["e"]), ("Sigmoid", ["e"], ["a"]), ("Greater", ["a", "z"], ["m"])], {1}),
])
def test_a_sign_test_of_a_sigmoids_output_does_not_mark_it(chain, marked):
    nodes = [helper.make_node("Constant", [], ["z"], value_float=0.0)]
    nodes += [helper.make_node(op, ins, outs) for op, ins, outs in chain]
    raw = _raw_steps(nodes, 17)
    assert deciding_sources(raw, zero_slots(raw, {})) == marked


@pytest.mark.parametrize("fuse", [True, False])
def test_the_sign_of_an_unmarked_sigmoid_is_that_of_its_float64_route(fuse):
    """Every float32 in [-110, -80] (Sigmoid's float32 exp(-x) overflows from -88.72284 down, where it is 0
    in both routes; its exact value is a subnormal down to -103.97) and samples elsewhere: ``Sigmoid(x) > 0``
    and ``Sign(Sigmoid(x))`` as the float64 route rounded once gives them."""
    lo, hi = np.float32(-80).view(np.int32), np.float32(-110).view(np.int32)
    x = np.concatenate([np.arange(lo, hi + 1, dtype=np.int32).view(np.float32),
                        np.random.default_rng(6).uniform(-200, 200, 100_000).astype(np.float32),
                        np.float32([np.inf, -np.inf, np.nan, 0.0, -0.0])])
    nodes = [helper.make_node("Constant", [], ["z"], value_float=0.0),
             helper.make_node("Sigmoid", ["x"], ["a"]), helper.make_node("Greater", ["a", "z"], ["g"]),
             helper.make_node("Sign", ["a"], ["s"])]
    plan = Plan(_model(nodes, [("g", TensorProto.BOOL, ["n"]), ("s", F, ["n"])]), fuse=fuse)
    assert _marked(plan, "Sigmoid") == [False]
    g, sign = plan.run({"x": x})
    y64 = sigmoid64([x.astype(np.float64)], {})[0].astype(np.float32)
    np.testing.assert_array_equal(g, y64 > 0)
    np.testing.assert_array_equal(sign, np.sign(y64))
    assert g.sum() == (x > np.float32(-88.72284)).sum()  # 0 from there down
