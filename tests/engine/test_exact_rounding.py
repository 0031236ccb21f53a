"""Transcendental float32 steps that decide a discrete result are correctly rounded (exact_rounding.py).

The oracle is the C library's double-precision function (Python's ``math``) rounded to float32 once, and
float32 IEEE arithmetic after it: independent of numpy's SIMD loops, which are one ulp off on 10-48 % of
float32 inputs on AVX-512 hosts (on other hosts they may be right already, and the value tests pass
either way; the structural tests hold everywhere).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.engine.exact_rounding import deciding_sources, rounds_exactly, zero_slots
from onnxtrain.engine.plan import Plan

LIBM = {"Log": math.log, "Exp": math.exp, "Tanh": math.tanh, "Sin": math.sin, "Cos": math.cos,
        "Atan": math.atan}


def _model(nodes: list[onnx.NodeProto], outputs: list[tuple[str, int]], inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info(n, t, ["n"]) for n, t in outputs], initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _bucket_model() -> onnx.ModelProto:
    """DeBERTa-v2's relative-position bucket: ceil(log(x) / log(3.5) · 1) as int64, log(3.5) a constant
    (torch folds it at export), and the log itself as an output."""
    den = helper.make_tensor("den", TensorProto.FLOAT, [], [float(np.float32(math.log(3.5)))])
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    nodes = [helper.make_node("Log", ["x"], ["lx"]), helper.make_node("Div", ["lx", "den"], ["q"]),
             helper.make_node("Mul", ["q", "one"], ["m"]), helper.make_node("Ceil", ["m"], ["c"]),
             helper.make_node("Cast", ["c"], ["bucket"], to=TensorProto.INT64)]
    return _model(nodes, [("lx", TensorProto.FLOAT), ("bucket", TensorProto.INT64)], [den, one])


@pytest.mark.parametrize("fuse", [True, False])
def test_bucket_of_a_log_is_the_correctly_rounded_ones(fuse):
    x = np.concatenate([np.arange(1, 257, dtype=np.float32) / np.float32(2),
                        np.random.default_rng(0).uniform(0.5, 300, 4000).astype(np.float32)])
    lx, bucket = Plan(_bucket_model(), fuse=fuse).run({"x": x}, ["lx", "bucket"])
    want_lx = np.array([math.log(float(v)) for v in x], dtype=np.float32)
    np.testing.assert_array_equal(lx, want_lx)  # bit for bit
    den = np.float32(math.log(3.5))
    want = np.array([math.ceil(np.float32(np.float32(v) / den) * np.float32(1)) for v in want_lx])
    np.testing.assert_array_equal(bucket, want)
    assert bucket[6] == 1  # x = 3.5: log(3.5) / log(3.5) is 1 exactly; numpy's float32 log made it 2 here


@pytest.mark.parametrize("op", sorted(LIBM))
def test_each_source_op_is_rounded_once_before_a_floor(op):
    x = np.random.default_rng(1).uniform(-3, 3, 5000).astype(np.float32)
    if op == "Log":
        x = np.abs(x) + np.float32(0.01)
    nodes = [helper.make_node(op, ["x"], ["y"]), helper.make_node("Floor", ["y"], ["f"])]
    y, f = Plan(_model(nodes, [("y", TensorProto.FLOAT), ("f", TensorProto.FLOAT)])).run({"x": x}, ["y", "f"])
    want = np.array([LIBM[op](float(v)) for v in x], dtype=np.float32)
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(f, np.floor(want))


def test_float64_and_unmarked_steps_keep_numpys_ufunc():
    """Only float32 inputs take the float64 route; a Log whose result meets no discrete step stays
    numpy's float32 ufunc (the same bits as np.log), as do steps past a MatMul or a reduction."""
    x = np.random.default_rng(2).uniform(0.1, 9, 3000).astype(np.float32)
    nodes = [helper.make_node("Log", ["x"], ["y"]), helper.make_node("Add", ["y", "y"], ["z"])]
    (z,) = Plan(_model(nodes, [("z", TensorProto.FLOAT)])).run({"x": x}, ["z"])
    np.testing.assert_array_equal(z, np.log(x) + np.log(x))
    nodes = [helper.make_node("Log", ["x"], ["y"]), helper.make_node("Floor", ["y"], ["f"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["n"])],
                              [helper.make_tensor_value_info("f", TensorProto.DOUBLE, ["n"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    (f,) = Plan(model).run({"x": x.astype(np.float64)})
    np.testing.assert_array_equal(f, np.floor(np.log(x.astype(np.float64))))


def _raw(nodes: list[onnx.NodeProto]) -> list[tuple]:
    """(node, fn, attrs, input slots, output slots) as the plan builds them, fn left out."""
    from onnxtrain.ir.attrs import parse_attributes

    slots: dict[str, int] = {}
    raw = []
    for n in nodes:
        ins = [slots.setdefault(i, len(slots)) for i in n.input]
        outs = [slots.setdefault(o, len(slots)) for o in n.output]
        raw.append((n, None, parse_attributes(n, 17), ins, outs))
    return raw


@pytest.mark.parametrize("chain, marked", [
    ([("Exp", ["x"], ["a"]), ("Floor", ["a"], ["b"])], {0}),
    ([("Exp", ["x"], ["a"]), ("Add", ["a", "x"], ["b"])], set()),
    ([("Tanh", ["x"], ["a"]), ("Reshape", ["a", "s"], ["b"]), ("Less", ["b", "x"], ["c"])], {0}),
    ([("Log", ["x"], ["a"]), ("MatMul", ["a", "w"], ["b"]), ("Round", ["b"], ["c"])], set()),
    ([("Log", ["x"], ["a"]), ("ReduceSum", ["a"], ["b"]), ("Ceil", ["b"], ["c"])], set()),
    ([("Sin", ["x"], ["a"]), ("Cast", ["a"], ["b"], {"to": TensorProto.DOUBLE}), ("Floor", ["b"], ["c"])],
     {0}),
    ([("Sin", ["x"], ["a"]), ("Cast", ["a"], ["b"], {"to": TensorProto.INT32})], {0}),
    ([("Sin", ["x"], ["a"]), ("Cast", ["a"], ["b"], {"to": TensorProto.FLOAT16})], set()),
    ([("Exp", ["x"], ["a"]), ("Log", ["a"], ["b"]), ("Mul", ["b", "x"], ["c"]), ("Equal", ["c", "x"], ["d"])],
     {0, 1}),
    ([("Exp", ["x"], ["a"]), ("IsNaN", ["a"], ["b"])], set()),
])
def test_which_steps_are_marked(chain, marked):
    nodes = [helper.make_node(op, ins, outs, **(rest[0] if rest else {})) for op, ins, outs, *rest in chain]
    assert deciding_sources(_raw(nodes)) == marked


def test_marked_step_stays_out_of_elementwise_clusters():
    plan = Plan(_bucket_model(), fuse=True)
    logs = [st for st in plan.steps if st.node.op_type == "Log"]
    assert len(logs) == 1 and rounds_exactly(logs[0].fn)


@pytest.mark.parametrize("fuse", [True, False])
def test_a_numpy_scalar_between_steps_is_rounded_once_too(fuse):
    """A Gather of one element of a vector hands the next step a numpy float32 scalar, not a 0-d array: the
    marked Log rounds it once all the same."""
    x = np.random.default_rng(3).uniform(0.5, 300, 400).astype(np.float32)
    idx = helper.make_tensor("i", TensorProto.INT64, [], [0])
    nodes = [helper.make_node("Gather", ["x", "i"], ["g"]), helper.make_node("Log", ["g"], ["l"]),
             helper.make_node("Floor", ["l"], ["f"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info("l", TensorProto.FLOAT, [])], initializer=[idx])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    plan = Plan(model, fuse=fuse)
    got = np.array([plan.run({"x": x[k:k + 1]})[0] for k in range(len(x))])
    want = np.array([math.log(float(v)) for v in x], dtype=np.float32)
    np.testing.assert_array_equal(got, want)


def test_two_equal_marked_steps_are_still_one_step():
    """Two Logs of the same input, each before a discrete step, are one common subexpression: the plan runs
    the float64 route once, as it ran one float32 Log before the steps were marked."""
    x = np.random.default_rng(4).uniform(0.5, 300, 3000).astype(np.float32)
    nodes = [helper.make_node("Log", ["x"], ["a"]), helper.make_node("Log", ["x"], ["b"]),
             helper.make_node("Floor", ["a"], ["fa"]), helper.make_node("Ceil", ["b"], ["fb"])]
    plan = Plan(_model(nodes, [("fa", TensorProto.FLOAT), ("fb", TensorProto.FLOAT)]), fuse=True)
    assert [st.node.op_type for st in plan.steps].count("Log") == 1
    fa, fb = plan.run({"x": x})
    want = np.array([math.log(float(v)) for v in x], dtype=np.float32)
    np.testing.assert_array_equal(fa, np.floor(want))
    np.testing.assert_array_equal(fb, np.ceil(want))


@pytest.mark.parametrize("chain", [
    [("Log", ["x"], ["a"]), ("Split", ["a"], ["b", "c"], {"axis": 0}), ("Floor", ["c"], ["d"])],
    [("Exp", ["x"], ["a"]), ("Sum", ["a", "x", "x"], ["b"]), ("Ceil", ["b"], ["c"])],
    [("Exp", ["x"], ["a"]), ("Mean", ["a", "x"], ["b"]), ("Round", ["b"], ["c"])],
    [("Log", ["x"], ["a"]), ("ReduceMax", ["a"], ["b"]), ("Floor", ["b"], ["c"])],
    [("Log", ["x"], ["a"]), ("ReduceMin", ["a"], ["b"]), ("Less", ["b", "x"], ["c"])],
    [("Tanh", ["x"], ["a"]), ("Pad", ["a", "p"], ["b"]), ("Floor", ["b"], ["c"])],
    [("Sin", ["x"], ["a"]), ("GatherElements", ["a", "i"], ["b"]), ("Floor", ["b"], ["c"])],
    [("Sin", ["x"], ["a"]), ("GatherND", ["a", "i"], ["b"]), ("Floor", ["b"], ["c"])],
])
def test_elementwise_and_data_movement_steps_with_several_inputs_or_outputs_pass_it_on(chain):
    """The README's 'through elementwise and data-movement steps': a Split (one of its outputs reaching the
    discrete step), a Sum or Mean of several inputs, a ReduceMax/ReduceMin (which pick one of the values), a
    Pad, a GatherElements or GatherND."""
    nodes = [helper.make_node(op, ins, outs, **(rest[0] if rest else {})) for op, ins, outs, *rest in chain]
    assert deciding_sources(_raw(nodes)) == {0}


def test_a_log_split_before_a_floor_is_rounded_once():
    x = np.random.default_rng(5).uniform(0.5, 300, 4000).astype(np.float32)
    nodes = [helper.make_node("Log", ["x"], ["a"]), helper.make_node("Split", ["a", "sizes"], ["b", "c"]),
             helper.make_node("Floor", ["c"], ["d"])]
    sizes = helper.make_tensor("sizes", TensorProto.INT64, [2], [1000, 3000])
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4000])],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [3000]),
                               helper.make_tensor_value_info("d", TensorProto.FLOAT, [3000])],
                              initializer=[sizes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    c, d = Plan(model).run({"x": x})
    want = np.array([math.log(float(v)) for v in x[1000:]], dtype=np.float32)
    np.testing.assert_array_equal(c, want)
    np.testing.assert_array_equal(d, np.floor(want))


def test_a_recomputed_tanh_before_a_relu_keeps_the_runs_bits():
    """A Tanh shifted before a Relu is marked in a training graph (the Relu's gradient compares its output
    with 0, and the shift's sign depends on the Tanh's last bit). With recompute_checkpoints the backward
    reads a recomputed copy of the Tanh and the forward's own copy meets no comparison: both copies are
    computed alike, so the recomputed run keeps the plain one's losses and weights bit for bit, as recompute
    does without marked steps."""
    import warnings

    from onnx import numpy_helper

    from onnxtrain import TrainingParameters, TrainingSession

    rng = np.random.default_rng(6)
    w1 = numpy_helper.from_array(rng.standard_normal((16, 64)).astype(np.float32) * 0.5, "W1")
    w2 = numpy_helper.from_array(rng.standard_normal((64, 4)).astype(np.float32) * 0.3, "W2")
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Tanh", ["h"], ["t0"]),
             helper.make_node("Constant", [], ["c"], value_float=0.25),
             helper.make_node("Add", ["t0", "c"], ["t"]),
             helper.make_node("Relu", ["t"], ["r"]), helper.make_node("MatMul", ["r", "W2"], ["o"]),
             helper.make_node("Sub", ["o", "y"], ["d"]), helper.make_node("Mul", ["d", "d"], ["s"]),
             helper.make_node("ReduceMean", ["s"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, 16]),
                                           helper.make_tensor_value_info("y", TensorProto.FLOAT, [32, 4])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              initializer=[w1, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)

    def run(**options) -> tuple[list[float], dict]:
        p = TrainingParameters()
        p.loss_output_name, p.training_optimizer_name = "loss", "SGDOptimizer"
        for k, v in options.items():
            setattr(p, k, v)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sess = TrainingSession(model.SerializeToString(), p)
        feeds = np.random.default_rng(7)
        losses = [float(sess.run(["loss"], {"x": feeds.standard_normal((32, 16)).astype(np.float32),
                                            "y": feeds.standard_normal((32, 4)).astype(np.float32),
                                            "Learning_Rate": np.array([0.05], np.float32)})[0])
                  for _ in range(6)]
        return losses, sess.get_state()

    plain, recomputed = run(), run(recompute_checkpoints=["h"])
    assert plain[0] == recomputed[0]
    for name, value in plain[1].items():
        np.testing.assert_array_equal(recomputed[1][name], value, err_msg=name)


def _zero(name: str) -> onnx.NodeProto:
    zero = helper.make_tensor(name, TensorProto.FLOAT, [], [0.0])
    return helper.make_node("Constant", [], [name], value=zero)


@pytest.mark.parametrize("chain, marked", [
    # the numpy loops keep the correctly rounded value's sign and zeros: testing the sign of the source's
    # result, moved, clamped or negated only (a ReLU, Abs or LeakyRelu gradient's mask), decides nothing
    ([("Tanh", ["x"], ["a"]), ("Relu", ["a"], ["r"]), ("Greater", ["r", "z"], ["m"])], set()),
    ([("Sinh", ["x"], ["a"]), ("Neg", ["a"], ["n"]), ("Reshape", ["n", "s"], ["r"]),
      ("Less", ["z", "r"], ["m"])], set()),
    ([("Atan", ["x"], ["a"]), ("Abs", ["a"], ["n"]), ("Sign", ["n"], ["m"])], set()),
    # a shift or a scale before the test, or a threshold other than a constant 0, decides
    ([("Tanh", ["x"], ["a"]), ("Add", ["a", "b"], ["s"]), ("Greater", ["s", "z"], ["m"])], {0}),
    ([("Tanh", ["x"], ["a"]), ("Relu", ["a"], ["r"]), ("Greater", ["r", "b"], ["m"])], {0}),
    ([("Log", ["x"], ["a"]), ("Sub", ["a", "b"], ["s"]), ("Sign", ["s"], ["m"])], {0}),
    # rounding to integers decides whatever the path
    ([("Exp", ["x"], ["a"]), ("Relu", ["a"], ["r"]), ("Floor", ["r"], ["m"])], {0}),
])
def test_a_sign_test_of_the_sources_own_sign_does_not_mark_it(chain, marked):
    nodes = [_zero("z")] + [helper.make_node(op, ins, outs) for op, ins, outs in chain]
    raw = _raw(nodes)
    assert deciding_sources(raw[1:], zero_slots(raw, {})) == marked


def test_a_tanh_relu_training_step_keeps_numpys_tanh():
    """A Tanh-Relu MLP's training graph: the Relu's gradient tests the sign of the Tanh's clamped output,
    which numpy's float32 tanh gets right, so the Tanh stays numpy's ufunc (reviewed: 1.14x the step when
    it was marked)."""
    from onnxtrain.autodiff import build_gradient_model

    w = onnx.numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Tanh", ["h"], ["t"]),
             helper.make_node("Relu", ["t"], ["r"]), helper.make_node("Abs", ["r"], ["a"]),
             helper.make_node("LeakyRelu", ["a"], ["l"]),
             helper.make_node("ReduceSum", ["l"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [w])
    model = build_gradient_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                                 "loss", ["w"])
    tanhs = [st for st in Plan(model, fuse=False).steps if st.node.op_type == "Tanh"]
    assert len(tanhs) == 1 and not rounds_exactly(tanhs[0].fn)


def test_looking_for_zero_constants_copies_no_large_constant():
    """The Constant nodes are looked at for zeros in the values the plan already parsed: a 32 MiB Constant
    is held once while the plan is built, not converted a second time (which doubled the build's peak)."""
    import tracemalloc

    n = 8 << 20
    big = onnx.numpy_helper.from_array(np.ones(n, np.float32), "c")
    nodes = [helper.make_node("Constant", [], ["c"], value=big), helper.make_node("Add", ["c", "x"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    tracemalloc.start()
    try:
        plan = Plan(model, fuse=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1.5 * 4 * n, f"{peak / 2**20:.0f} MiB at the build's peak for a 32 MiB Constant"
    np.testing.assert_array_equal(plan.run({"x": np.array([2.0], np.float32)})[0][:3], [3.0, 3.0, 3.0])


@pytest.mark.parametrize("attr, value, found", [
    ("value", helper.make_tensor("t", TensorProto.FLOAT, [2], [0.0, -0.0]), True),
    ("value", helper.make_tensor("t", TensorProto.FLOAT, [2], [0.0, 1e-30]), False),
    ("value", helper.make_tensor("t", TensorProto.FLOAT, [65], [0.0] * 65), False),  # not looked at
    ("value_float", 0.0, True), ("value_float", -0.0, True), ("value_float", 1e-40, False),
    ("value_int", 0, True), ("value_int", 3, False),
    ("value_floats", [0.0], False),  # (not looked at: a comparison with it marks, as it did before)
])
def test_zero_constants_of_each_constant_form(attr, value, found):
    """A Constant counts as zeros only when onnx.reference computes all zeros for it."""
    from onnx.reference import ReferenceEvaluator

    node = helper.make_node("Constant", [], ["z"], **{attr: value})
    assert (zero_slots(_raw([node]), {}) == {0}) is found
    if found:
        out = helper.make_tensor_value_info("z", TensorProto.UNDEFINED, None)
        graph = helper.make_graph([node], "g", [], [out])
        (z,) = ReferenceEvaluator(helper.make_model(graph)).run(None, {})
        assert not np.any(z)


@pytest.mark.parametrize("to, marked", [(TensorProto.FLOAT16, {0}), (TensorProto.BFLOAT16, {0}),
                                        (TensorProto.DOUBLE, set()), (TensorProto.FLOAT, set())])
def test_a_cast_to_a_narrower_float_before_a_sign_test_marks_the_source(to, marked):
    """A Cast to float16 or bfloat16 keeps signs but not zeros: two float32 neighbours (a correctly rounded
    value and one an ulp off) can fall on either side of the half-float's smallest step, so the test of its
    sign depends on the source's last bit. A Cast to float32 or float64 keeps every value."""
    import ml_dtypes

    half = {TensorProto.FLOAT16: np.float16, TensorProto.BFLOAT16: ml_dtypes.bfloat16}.get(to)
    if half is not None:  # numpy's own casts, the oracle of what the step does to two neighbours
        edge = np.float32(2.0 ** -25 if half is np.float16 else 2.0 ** -134)
        pair = np.array([edge, np.nextafter(edge, np.float32(1))], np.float32)
        assert np.all(pair > 0) and list(pair.astype(half) > 0) == [False, True]
    chain = [("Exp", ["x"], ["a"]), ("Cast", ["a"], ["h"], {"to": to}), ("Relu", ["h"], ["r"]),
             ("Greater", ["r", "z"], ["m"])]
    nodes = [_zero("z")] + [helper.make_node(op, ins, outs, **(rest[0] if rest else {}))
                            for op, ins, outs, *rest in chain]
    raw = _raw(nodes)
    assert deciding_sources(raw[1:], zero_slots(raw, {})) == marked
