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
    """(node, fn, attrs, input slots, output slots) as the plan builds them, fn left out: a control-flow
    node's inputs, then the values its bodies capture."""
    from onnxtrain.ir.attrs import parse_attributes
    from onnxtrain.ir.graphs import body_reads

    slots: dict[str, int] = {}
    raw = []
    for n in nodes:
        ins = [slots.setdefault(i, len(slots)) for i in (*n.input, *body_reads(n))]
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


_SELU_A, _SELU_G = float(np.float32(1.6732632423543772)), float(np.float32(1.0507009873554805))
_GELU_C, _GELU_K = math.sqrt(float(np.float32(2 / math.pi))), float(np.float32(0.044715))  # the ONNX body's


def _sigmoid(x: float) -> float:
    e = math.exp(-abs(x))
    return 1 / (1 + e) if x >= 0 else e / (1 + e)


def _softplus(x: float) -> float:
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


# the formula ops' definitions in double precision (each within a few double ulps: rounded to float32 they
# are the correctly rounded values but for ties), with the tails written without cancellation
FORMULAS = {
    ("Sigmoid", ()): lambda x: _sigmoid(x) if x > -88.72284 else 0.0,  # float32's exp(-x) overflows below
    ("Erf", ()): math.erf,
    ("Softplus", ()): _softplus,
    ("Elu", ()): lambda x: math.expm1(x) if x < 0 else x,
    ("Elu", (("alpha", 0.3),)): lambda x: float(np.float32(0.3)) * math.expm1(x) if x < 0 else x,
    ("Selu", ()): lambda x: _SELU_G * _SELU_A * math.expm1(x) if x <= 0 else _SELU_G * x,
    ("Celu", (("alpha", 2.0),)): lambda x: 2.0 * math.expm1(x / 2.0) if x < 0 else x,
    ("Mish", ()): lambda x: x * math.tanh(_softplus(x)),
    ("Gelu", ()): lambda x: 0.5 * x * math.erfc(-x / math.sqrt(2)),
    ("Gelu", (("approximate", "tanh"),)): lambda x: x * _sigmoid(2 * _GELU_C * (x + _GELU_K * x ** 3)),
}
# inputs over the op's range, its negative tail (where float32 formulas lose digits to cancellation: Gelu is
# -0.0 below -6), and float32 neighbours of a few values
_FORMULA_X = {"Sigmoid": (-104, 20), "Erf": (-4, 4), "Softplus": (-104, 20), "Elu": (-18, 3),
              "Selu": (-18, 3), "Celu": (-30, 3), "Mish": (-30, 12), "Gelu": (-13, 6)}


def _formula_inputs(op: str) -> np.ndarray:
    lo, hi = _FORMULA_X[op]
    rng = np.random.default_rng(8)
    steps = np.arange(-50, 50, dtype=np.float32) * np.float32(2e-7)
    near = np.float32([-3.5, -1.25, 0.75, 2.0])[:, None] + steps
    return np.concatenate([rng.uniform(lo, hi, 4000), rng.uniform(lo, 0, 1000), near.reshape(-1),
                           [0.0, -0.0]]).astype(np.float32)


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("op, attrs", sorted(FORMULAS, key=str))
def test_each_formula_source_is_rounded_once_before_a_floor(op, attrs, fuse):
    """Sigmoid, Erf, Softplus, the Elu family, Mish and Gelu compute exp, expm1, log1p, tanh or erf in
    float32 (one ulp off or more, several roundings after it): before a Floor of 1000·y, y is the
    correctly rounded value of the op's definition."""
    x = _formula_inputs(op)
    thousand = helper.make_tensor("k", TensorProto.FLOAT, [], [1000.0])
    nodes = [helper.make_node(op, ["x"], ["y"], **dict(attrs)), helper.make_node("Mul", ["y", "k"], ["m"]),
             helper.make_node("Floor", ["m"], ["f"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n"]) for n in "yf"],
                              initializer=[thousand])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    onnx.checker.check_model(model, full_check=True)
    with np.errstate(under="ignore"):
        want = np.array([FORMULAS[op, attrs](float(v)) for v in x]).astype(np.float32)
    y, f = Plan(model, fuse=fuse).run({"x": x}, ["y", "f"])
    np.testing.assert_array_equal(y.view(np.int32), want.view(np.int32))  # bit for bit, -0.0 included
    np.testing.assert_array_equal(f, np.floor(want * np.float32(1000)))


@pytest.mark.parametrize("v", [-4.5, -1.25, 0.75])
@pytest.mark.parametrize("op, attrs", sorted(FORMULAS, key=str))
def test_a_formula_source_of_a_scalar_is_rounded_once(op, attrs, v):
    """A 0-d input (a scalar score, a one-element Gather) takes the float64 route too: the correctly rounded
    value, as for an array (Gelu's tail below -3 included)."""
    scalar = helper.make_tensor_value_info
    nodes = [helper.make_node(op, ["x"], ["y"], **dict(attrs)), helper.make_node("Floor", ["y"], ["f"])]
    graph = helper.make_graph(nodes, "g", [scalar("x", TensorProto.FLOAT, [])],
                              [scalar(n, TensorProto.FLOAT, []) for n in "yf"])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    onnx.checker.check_model(model, full_check=True)
    want = np.float32(FORMULAS[op, attrs](float(np.float32(v))))
    y, f = Plan(model).run({"x": np.array(v, np.float32)}, ["y", "f"])
    assert y.shape == () and y.dtype == np.float32
    assert y.view(np.int32) == want.view(np.int32) and f == np.floor(want)


def test_a_formula_source_is_not_rounded_when_nothing_decides():
    """An Erf and a Sigmoid whose results meet only continuous steps keep the engine's float32 kernels."""
    from onnxtrain.engine.kernels.activation import sigmoid
    from onnxtrain.engine.kernels.elementwise import erf

    x = np.random.default_rng(9).uniform(-4, 4, 3000).astype(np.float32)
    nodes = [helper.make_node("Erf", ["x"], ["e"]), helper.make_node("Sigmoid", ["x"], ["s"]),
             helper.make_node("Add", ["e", "s"], ["z"])]
    (z,) = Plan(_model(nodes, [("z", TensorProto.FLOAT)]), fuse=False).run({"x": x})
    np.testing.assert_array_equal(z, erf(x) + sigmoid(x))


@pytest.mark.parametrize("chain, marked", [
    ([("Sigmoid", ["x"], ["a"]), ("Greater", ["a", "b"], ["c"])], {0}),
    ([("Erf", ["x"], ["a"]), ("Round", ["a"], ["c"])], {0}),
    ([("Exp", ["x"], ["a"]), ("Softplus", ["a"], ["s"]), ("Floor", ["s"], ["c"])], {0, 1}),
    ([("Elu", ["x"], ["a"]), ("Add", ["a", "b"], ["s"]), ("Cast", ["s"], ["c"], {"to": TensorProto.INT64})],
     {0}),
    ([("Mish", ["x"], ["a"]), ("Gelu", ["a"], ["g"]), ("Less", ["g", "b"], ["c"])], {0, 1}),
    ([("Selu", ["x"], ["a"]), ("Celu", ["a"], ["g"]), ("Sign", ["g"], ["c"])], {0, 1}),
    # no transcendental in their float32 kernels: not sources, but a source's error passes through them
    ([("HardSwish", ["x"], ["a"]), ("Floor", ["a"], ["c"])], set()),
    ([("Exp", ["x"], ["a"]), ("Softsign", ["a"], ["s"]), ("Floor", ["s"], ["c"])], {0}),
    ([("Tanh", ["x"], ["a"]), ("HardSigmoid", ["a"], ["s"]), ("Less", ["s", "b"], ["c"])], {0}),
    ([("Sigmoid", ["x"], ["a"]), ("LeakyRelu", ["a"], ["s"]), ("HardSwish", ["s"], ["h"]),
      ("Round", ["h"], ["c"])], {0}),
    ([("Sigmoid", ["x"], ["a"]), ("MatMul", ["a", "w"], ["m"]), ("Floor", ["m"], ["c"])], set()),
])
def test_which_formula_steps_are_marked(chain, marked):
    nodes = [helper.make_node(op, ins, outs, **(rest[0] if rest else {})) for op, ins, outs, *rest in chain]
    assert deciding_sources(_raw(nodes)) == marked


@pytest.mark.parametrize("chain, marked", [
    # numpy's ufuncs keep the correctly rounded sign and zeros; these float32 formulas do not: a test of
    # their sign decides, but for Sigmoid's (0 from -88.7 down in both routes, positive above)
    ([("Sigmoid", ["x"], ["a"]), ("Greater", ["a", "z"], ["m"])], set()),
    ([("Softplus", ["x"], ["a"]), ("Relu", ["a"], ["r"]), ("Sign", ["r"], ["m"])], {0}),
    ([("Tanh", ["x"], ["a"]), ("Relu", ["a"], ["r"]), ("Greater", ["r", "z"], ["m"])], set()),
])
def test_a_formula_sources_sign_test_marks_it(chain, marked):
    nodes = [_zero("z")] + [helper.make_node(op, ins, outs) for op, ins, outs in chain]
    raw = _raw(nodes)
    assert deciding_sources(raw[1:], zero_slots(raw, {})) == marked


@pytest.mark.parametrize("fuse", [True, False])
def test_a_rounded_sigmoid_keeps_the_zeros_of_float32s_overflowing_exp(fuse):
    """Below -88.72284 float32's exp(-x) overflows and Sigmoid is 0, as torch's float32 sigmoid is, though
    its value is a positive subnormal down to -103.97: the float64 route keeps those zeros (a subnormal's few
    bits are no better: log of the correctly rounded sigmoid(-100) is -99.98, above torch's
    binary-cross-entropy clamp at -100 where the exact log is below it), and is the correctly rounded value
    above them."""
    import torch

    edge = np.float32(-88.72284)
    x = np.concatenate([[np.nextafter(edge, np.float32(0)), edge, np.nextafter(edge, np.float32(-np.inf))],
                        np.float32([-88.5, -88.72, -90, -100, -103.9, -200])]).astype(np.float32)
    nodes = [helper.make_node("Sigmoid", ["x"], ["y"]), helper.make_node("Floor", ["y"], ["f"])]
    (y,) = Plan(_model(nodes, [("y", TensorProto.FLOAT), ("f", TensorProto.FLOAT)]), fuse=fuse).run(
        {"x": x}, ["y"])
    np.testing.assert_array_equal(y == 0, torch.sigmoid(torch.from_numpy(x)).numpy() == 0)
    assert list(y == 0) == [False, True, True, False, False, True, True, True, True]
    above = y > 0
    np.testing.assert_array_equal(y[above], np.float32([_sigmoid(float(v)) for v in x[above]]))


@pytest.mark.parametrize("chain, marked", [
    ([("Exp", ["x"], ["a"]), ("ArgMax", ["a"], ["i"])], {0}),
    ([("Tanh", ["x"], ["a"]), ("Reshape", ["a", "s"], ["r"]), ("ArgMin", ["r"], ["i"])], {0}),
    ([("Log", ["x"], ["a"]), ("Mul", ["a", "b"], ["m"]), ("TopK", ["m", "k"], ["v", "i"])], {0}),
    ([("Sigmoid", ["x"], ["a"]), ("Hardmax", ["a"], ["h"])], {0}),
    # an ArgMax of a Softmax: the walk stops at the Softmax (a sum over the axis, as ReduceSum) and marks
    # nothing, as before
    ([("Exp", ["x"], ["a"]), ("Softmax", ["a"], ["p"]), ("ArgMax", ["p"], ["i"])], set()),
    ([("Exp", ["x"], ["a"]), ("MatMul", ["a", "w"], ["m"]), ("ArgMax", ["m"], ["i"])], set()),
])
def test_an_index_picked_among_a_sources_values_marks_it(chain, marked):
    """ArgMax, ArgMin, TopK and Hardmax compare values with each other: one ulp flips the index picked
    between two values that are equal or neighbours."""
    nodes = [helper.make_node(op, ins, outs) for op, ins, outs in chain]
    assert deciding_sources(_raw(nodes)) == marked


def _neighbour_pairs() -> np.ndarray:
    """Rows of two float32 neighbours, in both orders: their exps are equal or neighbours."""
    x = np.random.default_rng(10).uniform(-10, 10, 3000).astype(np.float32)
    up = np.nextafter(x, np.float32(np.inf))
    return np.concatenate([np.stack([x, up], 1), np.stack([up, x], 1)])


@pytest.mark.parametrize("fuse", [True, False])
def test_argmax_argmin_and_topk_of_an_exp_pick_as_the_correctly_rounded_values(fuse):
    """Between two neighbours' exps, ArgMax, ArgMin and TopK pick as they do on the correctly rounded
    values (the first of equal ones); numpy's float32 exp orders some pairs otherwise on this host."""
    x = _neighbour_pairs()
    k = helper.make_tensor("k", TensorProto.INT64, [1], [1])
    nodes = [helper.make_node("Exp", ["x"], ["e"]),
             helper.make_node("ArgMax", ["e"], ["hi"], axis=1, keepdims=0),
             helper.make_node("ArgMin", ["e"], ["lo"], axis=1, keepdims=0),
             helper.make_node("TopK", ["e", "k"], ["v", "top"], axis=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2])],
                              [helper.make_tensor_value_info("hi", TensorProto.INT64, ["n"]),
                               helper.make_tensor_value_info("lo", TensorProto.INT64, ["n"]),
                               helper.make_tensor_value_info("top", TensorProto.INT64, ["n", 1])],
                              initializer=[k])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    hi, lo, top = Plan(model, fuse=fuse).run({"x": x})
    want = np.array([[math.exp(float(v)) for v in row] for row in x]).astype(np.float32)
    np.testing.assert_array_equal(hi, np.argmax(want, 1))
    np.testing.assert_array_equal(lo, np.argmin(want, 1))
    np.testing.assert_array_equal(top[:, 0], np.argmax(want, 1))


def _body(nodes: list[onnx.NodeProto], inputs: list[str], outputs: list[str]) -> onnx.GraphProto:
    """A body graph of float32 values (a Loop's iteration count and condition named as they are)."""
    types = {"i": TensorProto.INT64, "cond": TensorProto.BOOL, "cond_out": TensorProto.BOOL}
    return helper.make_graph(nodes, "body", [helper.make_tensor_value_info(n, types.get(n, TensorProto.FLOAT),
                                                                           None) for n in inputs],
                             [helper.make_tensor_value_info(n, types.get(n, TensorProto.FLOAT), None)
                              for n in outputs])


def _if(then_nodes: list[onnx.NodeProto], then_out: str, else_out: str = "x") -> onnx.NodeProto:
    else_branch = _body([helper.make_node("Identity", [else_out], ["e"])], [], ["e"])
    return helper.make_node("If", ["c"], ["o"], then_branch=_body(then_nodes, [], [then_out]),
                            else_branch=else_branch)


def _loop(body_nodes: list[onnx.NodeProto], carried: list[str], inputs: list[str], outputs: list[str],
          outer: list[str]) -> onnx.NodeProto:
    """A Loop of trip count ``n`` and condition ``c`` carrying ``outer`` as ``carried``."""
    body = _body(body_nodes, ["i", "cond", *carried], ["cond_out", *outputs])
    return helper.make_node("Loop", ["n", "c", *outer], [f"{o}_final" for o in outputs], body=body)


_COND = [helper.make_node("Identity", ["cond"], ["cond_out"])]


@pytest.mark.parametrize("case, marked", [
    # a value an If's branch captures, rounded to an integer in the branch
    ("if_captured_floor", {0}),
    # ... only added to in the branch, then rounded after the If: through the branch's output
    ("if_captured_then_floor_after", {0}),
    ("if_captured_continuous_only", set()),
    # a Loop's carried value compared in the body; carried on once before it is (the next iteration's input)
    ("loop_carried_compared", {0}),
    ("loop_carried_on_then_compared", {0}),
    ("loop_carried_continuous_only", set()),
    # a Scan's scanned input rounded in the body
    ("scan_input_floor", {0}),
    # a Relu's gradient mask in a branch: the source's own sign tested, as outside a body
    ("if_captured_sign_test", set()),
    # a body within a body
    ("nested_if_floor", {0}),
])
def test_a_value_passed_into_a_body_that_decides_there_marks_its_source(case, marked):
    """The walk follows a source's result into If, Loop and Scan bodies: a value a body captures, a Loop's
    carried value (and around the loop to the next iteration), a Scan's input; and through the bodies'
    outputs to the steps after the node."""
    exp = helper.make_node("Exp", ["x"], ["a"])
    floor_a = [helper.make_node("Floor", ["a"], ["t"])]
    add_a = [helper.make_node("Add", ["a", "a"], ["t"])]
    if case == "if_captured_floor":
        nodes = [exp, _if(floor_a, "t")]
    elif case == "if_captured_then_floor_after":
        nodes = [exp, _if(add_a, "t"), helper.make_node("Floor", ["o"], ["f"])]
    elif case == "if_captured_continuous_only":
        nodes = [exp, _if(add_a, "t"), helper.make_node("Add", ["o", "o"], ["f"])]
    elif case == "loop_carried_compared":
        body = [*_COND, helper.make_node("Less", ["v", "w"], ["m"]),
                helper.make_node("Identity", ["v"], ["v2"])]
        nodes = [exp, _loop(body, ["v"], [], ["v2"], ["a"])]
    elif case == "loop_carried_on_then_compared":
        body = [*_COND, helper.make_node("Identity", ["v"], ["v_next"]),
                helper.make_node("Identity", ["v"], ["u_next"]), helper.make_node("Ceil", ["u"], ["m"])]
        nodes = [exp, _loop(body, ["v", "u"], [], ["v_next", "u_next"], ["a", "x"])]
    elif case == "loop_carried_continuous_only":
        body = [*_COND, helper.make_node("Mul", ["v", "v"], ["v_next"])]
        nodes = [exp, _loop(body, ["v"], [], ["v_next"], ["a"]),
                 helper.make_node("Add", ["v_next_final", "x"], ["f"])]
    elif case == "scan_input_floor":
        body = _body([helper.make_node("Add", ["s", "e"], ["s2"]), helper.make_node("Floor", ["e"], ["f"])],
                     ["s", "e"], ["s2", "f"])
        nodes = [exp, helper.make_node("Scan", ["x", "a"], ["sf", "fs"], body=body, num_scan_inputs=1)]
    elif case == "if_captured_sign_test":
        nodes = [exp, _zero("z"), _if([helper.make_node("Relu", ["a"], ["r"]),
                                       helper.make_node("Greater", ["r", "z"], ["t"])], "t")]
    else:
        inner = _if(floor_a, "t")
        inner.output[0] = "io"
        nodes = [exp, _if([inner], "io")]
    assert deciding_sources(_raw(nodes), zero_slots(_raw(nodes), {})) == marked


@pytest.mark.parametrize("fuse", [True, False])
def test_a_log_floored_in_a_loop_body_is_rounded_once(fuse):
    """A Log's result carried into a Loop whose body floors it (DeBERTa's bucket, computed per step of a
    loop): the logs carried through are the correctly rounded ones, and so are the floors (inputs near
    e**k, whose logs are near integers)."""
    near = np.float32([math.e ** k for k in range(1, 6)])[:, None]
    x = np.concatenate([np.random.default_rng(11).uniform(0.5, 300, 2000).astype(np.float32),
                        (near + near * np.float32(2e-7) * np.arange(-60, 60, dtype=np.float32)).ravel()])
    body = [*_COND, helper.make_node("Floor", ["v"], ["fl"]), helper.make_node("Identity", ["v"], ["v2"])]
    loop = helper.make_node("Loop", ["n", "c", "l"], ["v_final", "fl_scan"],
                            body=_body(body, ["i", "cond", "v"], ["cond_out", "v2", "fl"]))
    nodes = [helper.make_node("Log", ["x"], ["l"]), loop]
    n = helper.make_tensor("n", TensorProto.INT64, [], [2])
    c = helper.make_tensor("c", TensorProto.BOOL, [], [True])
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info("v_final", TensorProto.FLOAT, ["n"]),
                               helper.make_tensor_value_info("fl_scan", TensorProto.FLOAT, [2, "n"])],
                              initializer=[n, c])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    v, fl = Plan(model, fuse=fuse).run({"x": x})
    want = np.array([math.log(float(v)) for v in x], dtype=np.float32)
    np.testing.assert_array_equal(v, want)
    np.testing.assert_array_equal(fl, np.stack([np.floor(want)] * 2))


@pytest.mark.parametrize("fuse", [True, False])
def test_a_log_an_if_branch_captures_and_floors_is_rounded_once(fuse):
    """The plan's own control-flow step (its captures after its inputs): a Log's result captured by an If's
    branch that floors it is the correctly rounded one."""
    near = np.float32([math.e ** k for k in range(1, 6)])[:, None]
    x = (near + near * np.float32(2e-7) * np.arange(-60, 60, dtype=np.float32)).ravel()
    branch = _body([helper.make_node("Floor", ["l"], ["t"])], [], ["t"])
    other = _body([helper.make_node("Identity", ["l"], ["e"])], [], ["e"])
    nodes = [helper.make_node("Log", ["x"], ["l"]),
             helper.make_node("If", ["c"], ["o"], then_branch=branch, else_branch=other)]
    c = helper.make_tensor("c", TensorProto.BOOL, [], [True])
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info("l", TensorProto.FLOAT, ["n"]),
                               helper.make_tensor_value_info("o", TensorProto.FLOAT, ["n"])], initializer=[c])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    plan = Plan(model, fuse=fuse)
    assert [rounds_exactly(st.fn) for st in plan.steps if st.node.op_type == "Log"] == [True]
    lx, o = plan.run({"x": x})
    want = np.array([math.log(float(v)) for v in x], dtype=np.float32)
    np.testing.assert_array_equal(lx, want)
    np.testing.assert_array_equal(o, np.floor(want))
