"""Control flow (If, Loop, Scan, SequenceMap) and sequence/optional values, against onnxruntime,
onnx.reference and torch: exported models, hand-built graphs with nested bodies reading outer values,
liveness and errors."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from torch import nn

import onnxtrain
from onnxtrain.engine import EngineError, Plan, UnsupportedOpError
from tests import models
from tests.engine.graphs import scan_over_pairs

F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def tensor(name: str, elem: int = F, shape=None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def model_of(nodes, inputs, outputs, inits=(), opset: int = 17) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8  # onnxruntime's inference package reads it
    onnx.checker.check_model(m, full_check=True)
    return m


def oracles(model: onnx.ModelProto, feeds: dict, reference: bool = True) -> tuple[list, list]:
    """onnxruntime's and onnx.reference's outputs (onnxruntime's twice when ``reference`` is False)."""
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = s.run(None, feeds)
    return want, ReferenceEvaluator(model).run(None, feeds) if reference else want


def assert_same(got, want, rtol: float = 1e-6) -> None:
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w, rtol)
        return
    assert got.dtype == np.asarray(want).dtype and got.shape == np.shape(want)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-7)


def export(module: nn.Module, args: tuple, names: list[str], dynamic: dict) -> onnx.ModelProto:
    return models.export_torchscript(module, args, names, ["y"], dynamic)


# ---- models exported by torch --------------------------------------------------------------------------
class LoopThenBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        h = self.lin(x)
        for _ in range(n):
            h = torch.tanh(self.lin(h)) + x
        if h.sum() > 0:  # noqa: SIM108 - scripted: an if statement exports as an If node
            h = h * 2
        else:
            h = h - 1
        return h


def test_scripted_loop_and_if_match_torch_and_onnxruntime() -> None:
    torch.manual_seed(0)
    module = torch.jit.script(LoopThenBranch())
    model = export(module, (torch.randn(3, 4), 2), ["x", "n"], {"x": {0: "batch"}})
    assert {"Loop", "If"} <= {n.op_type for n in model.graph.node}
    sess = onnxtrain.InferenceSession(model.SerializeToString())
    rng = np.random.default_rng(0)
    branches = set()
    for n, shift in ((0, 3.0), (1, -3.0), (3, 3.0), (4, -3.0)):
        x = (rng.standard_normal((5, 4)) + shift).astype(np.float32)
        feeds = {"x": x, "n": np.array(n, np.int64)}
        want_ort, _ = oracles(model, feeds)
        (got,) = sess.run(None, feeds)
        with torch.no_grad():
            t = module(torch.from_numpy(x), n).numpy()
        np.testing.assert_allclose(got, want_ort[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, t, rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            h = module.lin(torch.from_numpy(x))
            for _ in range(n):
                h = torch.tanh(module.lin(h)) + torch.from_numpy(x)
        branches.add(bool(h.sum() > 0))
    assert branches == {True, False}  # both branches ran


def test_embedding_bag_export_runs() -> None:
    """nn.EmbeddingBag exports as a Loop over the bags with an If for empty ones."""
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(10, 3, mode="mean")
    ids = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
    model = export(
        bag, (ids, torch.tensor([0, 4])), ["ids", "offsets"], {"ids": {0: "n"}, "offsets": {0: "b"}}
    )
    assert "Loop" in {n.op_type for n in model.graph.node}
    sess = onnxtrain.InferenceSession(model.SerializeToString())
    for offsets in ([0, 4], [0, 1, 5, 6], [0]):
        feeds = {"ids": ids.numpy(), "offsets": np.array(offsets, np.int64)}
        (got,) = sess.run(None, feeds)
        want_ort, _ = oracles(model, feeds)
        with torch.no_grad():
            t = bag(ids, torch.tensor(offsets)).numpy()
        np.testing.assert_allclose(got, want_ort[0], rtol=1e-6)
        np.testing.assert_allclose(got, t, rtol=1e-6, atol=1e-7)


# ---- hand-built graphs -----------------------------------------------------------------------------------
def nested_model() -> onnx.ModelProto:
    """A Loop whose body holds an If; both branches read values of the loop body and of the main graph.

    y, scan = Loop(n, cond)(acc = x): acc ← (acc·w if i is even else acc + bias) with w, bias outer values;
    the body stops once sum(acc) exceeds ``limit`` and stacks each acc as a scan output."""
    two = numpy_helper.from_array(np.array(2, np.int64), "two")
    zero = numpy_helper.from_array(np.array(0, np.int64), "zero")
    then_g = helper.make_graph(
        [helper.make_node("Mul", ["acc_in", "w"], ["t_out"])], "then", [], [tensor("t_out", F, [3])]
    )
    else_g = helper.make_graph(
        [helper.make_node("Add", ["acc_in", "bias"], ["e_out"])], "else", [], [tensor("e_out", F, [3])]
    )
    body = helper.make_graph(
        [
            helper.make_node("Mod", ["i", "two"], ["r"]),
            helper.make_node("Equal", ["r", "zero"], ["even"]),
            helper.make_node(
                "If", ["even"], ["acc_out"], name="choose", then_branch=then_g, else_branch=else_g
            ),
            helper.make_node("ReduceSum", ["acc_out"], ["total"], keepdims=0),
            helper.make_node("Less", ["total", "limit"], ["go"]),
            helper.make_node("Identity", ["acc_out"], ["scan_out"]),
        ],
        "body",
        [tensor("i", I64, []), tensor("c", B, []), tensor("acc_in", F, [3])],
        [tensor("go", B, []), tensor("acc_out", F, [3]), tensor("scan_out", F, [3])],
        [two, zero],
    )
    loop = helper.make_node("Loop", ["n", "cond", "x"], ["y", "scan"], name="outer_loop", body=body)
    return model_of(
        [helper.make_node("Neg", ["x0"], ["x"]), loop],
        [
            tensor("x0", F, [3]),
            tensor("n", I64, []),
            tensor("cond", B, []),
            tensor("w", F, [3]),
            tensor("bias", F, [3]),
            tensor("limit", F, []),
        ],
        [tensor("y", F, [3]), tensor("scan", F, ["steps", 3])],
    )


@pytest.mark.parametrize("n, cond, limit", [(0, True, 1e9), (5, True, 1e9), (9, True, 40.0), (4, False, 1e9)])
def test_nested_if_in_loop_reads_outer_values(n: int, cond: bool, limit: float) -> None:
    model = nested_model()
    feeds = {
        "x0": np.array([-1.0, -2.0, -0.5], np.float32),
        "n": np.array(n, np.int64),
        "cond": np.array(cond),
        "w": np.array([1.5, 2.0, 1.25], np.float32),
        "bias": np.array([0.5, -1.0, 2.0], np.float32),
        "limit": np.array(limit, np.float32),
    }
    got = onnxtrain.InferenceSession(model).run(None, feeds)
    # onnx.reference cannot stack the scan output of a loop that ran no iteration
    want_ort, want_ref = oracles(model, feeds, reference=n > 0 and cond)
    for g, a, b in zip(got, want_ort, want_ref):
        assert_same(g, a)
        assert_same(g, b)
    expected_steps = 0 if not cond else n if limit > 1e8 else None
    if expected_steps is not None:
        assert got[1].shape == (expected_steps, 3)


def test_loop_without_trip_count_is_a_while_loop() -> None:
    body = helper.make_graph(
        [helper.make_node("Mul", ["v", "v"], ["v2"]), helper.make_node("Less", ["v2", "stop"], ["go"])],
        "body",
        [tensor("i", I64, []), tensor("c", B, []), tensor("v", F, [])],
        [tensor("go", B, []), tensor("v2", F, [])],
    )
    model = model_of(
        [helper.make_node("Loop", ["", "cond", "v0"], ["v"], body=body)],
        [tensor("cond", B, []), tensor("v0", F, []), tensor("stop", F, [])],
        [tensor("v", F, [])],
    )
    feeds = {"cond": np.array(True), "v0": np.array(1.1, np.float32), "stop": np.array(1e6, np.float32)}
    (got,) = onnxtrain.InferenceSession(model).run(None, feeds)
    assert_same(got, oracles(model, feeds)[0][0])
    assert got > 1e6


@pytest.mark.parametrize(
    "in_dir, out_dir, in_axis, out_axis", [(0, 0, 0, 0), (1, 0, 1, 0), (0, 1, 1, -1), (1, 1, -1, 1)]
)
def test_scan_directions_and_axes(in_dir: int, out_dir: int, in_axis: int, out_axis: int) -> None:
    """A running sum over a scan axis, the scanned input also read from the main graph (a capture)."""
    node = scan_over_pairs(
        [
            helper.make_node("Add", ["s_in", "x_t"], ["s_out"]),
            helper.make_node("Mul", ["s_out", "scale"], ["y_t"]),
        ],
        scan_input_directions=[in_dir],
        scan_output_directions=[out_dir],
        scan_input_axes=[in_axis],
        scan_output_axes=[out_axis],
    )
    xs_shape = [4, 2] if in_axis == 0 else [2, 4]
    model = model_of(
        [node],
        [tensor("s0", F, [2]), tensor("xs", F, xs_shape), tensor("scale", F, [2])],
        [tensor("s", F, [2]), tensor("ys", F, ["a", "b"])],
    )
    rng = np.random.default_rng(1)
    feeds = {
        "s0": rng.standard_normal(2).astype(np.float32),
        "xs": rng.standard_normal(xs_shape).astype(np.float32),
        "scale": np.array([2.0, -1.0], np.float32),
    }
    got = onnxtrain.InferenceSession(model).run(None, feeds)
    # the same sums in numpy (onnx.reference's Scan takes axis 0 and the forward direction only)
    x = np.moveaxis(feeds["xs"], in_axis, 0)[:: -1 if in_dir else 1]
    state, ys = feeds["s0"], []
    for t in range(len(x)):
        state = state + x[t]
        ys.append(state * feeds["scale"])
    want_np = [state, np.stack(ys[:: -1 if out_dir else 1], axis=out_axis)]
    want_ort, _ = oracles(model, feeds, reference=False)
    for g, a, b in zip(got, want_ort, want_np):
        assert_same(g, a)
        assert_same(g, b)


def test_scan_of_no_steps() -> None:
    """A scan input of length 0 along its axis: the states pass through, and each scan output is an empty
    stack along its own axis (onnxruntime 1.31 crashes on this case: checked by its shape alone)."""
    node = scan_over_pairs(
        [
            helper.make_node("Add", ["s_in", "x_t"], ["s_out"]),
            helper.make_node("Identity", ["s_out"], ["y_t"]),
        ],
        scan_input_axes=[1],
        scan_output_axes=[1],
    )
    model = model_of(
        [node],
        [tensor("s0", F, [2]), tensor("xs", F, [2, "t"])],
        [tensor("s", F, [2]), tensor("ys", F, [2, "t"])],
    )
    s0 = np.array([1.0, 2.0], np.float32)
    s, ys = onnxtrain.InferenceSession(model).run(None, {"s0": s0, "xs": np.zeros((2, 0), np.float32)})
    np.testing.assert_array_equal(s, s0)
    assert ys.shape == (2, 0) and ys.dtype == np.float32


def test_sequences_and_sequence_map(tmp_path) -> None:
    """SplitToSequence → SequenceMap (a body reading an outer value) → SequenceInsert/Erase/At/Length →
    ConcatFromSequence, with a sequence input and a sequence output."""
    body = helper.make_graph(
        [
            helper.make_node("Mul", ["e", "k"], ["e2"]),
            helper.make_node("ReduceSum", ["e2"], ["tot"], keepdims=0),
        ],
        "body",
        [tensor("e", F, ["r", 2])],
        [tensor("e2", F, ["r", 2]), tensor("tot", F, [])],
    )
    seq_f = helper.make_tensor_sequence_value_info
    nodes = [
        helper.make_node("SplitToSequence", ["x", "sizes"], ["parts"], axis=0),
        helper.make_node("SequenceMap", ["parts"], ["scaled", "sums"], body=body),
        helper.make_node("SequenceInsert", ["scaled", "extra", "pos"], ["ins"]),
        helper.make_node("SequenceErase", ["ins"], ["erased"]),
        helper.make_node("SequenceAt", ["erased", "pos"], ["at"]),
        helper.make_node("SequenceLength", ["given"], ["n_given"]),
        helper.make_node("ConcatFromSequence", ["sums"], ["stacked"], axis=0, new_axis=1),
        helper.make_node("ConcatFromSequence", ["given"], ["joined"], axis=1),
    ]
    model = model_of(
        nodes,
        [
            tensor("x", F, [5, 2]),
            tensor("sizes", I64, [2]),
            tensor("extra", F, [1, 2]),
            tensor("pos", I64, []),
            tensor("k", F, []),
            seq_f("given", F, [2, None]),
        ],
        [
            seq_f("erased", F, ["r", 2]),
            tensor("at", F, ["r", 2]),
            tensor("n_given", I64, []),
            tensor("stacked", F, [2]),
            tensor("joined", F, [2, None]),
        ],
    )
    rng = np.random.default_rng(2)
    feeds = {
        "x": rng.standard_normal((5, 2)).astype(np.float32),
        "sizes": np.array([2, 3], np.int64),
        "extra": np.ones((1, 2), np.float32),
        "pos": np.array(-1, np.int64),
        "k": np.array(3.0, np.float32),
        "given": [rng.standard_normal((2, j)).astype(np.float32) for j in (1, 3)],
    }
    sess = onnxtrain.InferenceSession(model)
    assert sess.get_inputs()[-1].type == "seq(tensor(float))"
    assert sess.get_outputs()[0].type == "seq(tensor(float))"
    got = sess.run(None, feeds)
    # the same in numpy (onnx.reference's SequenceMap cannot read values of the main graph)
    x, k = feeds["x"], feeds["k"]
    scaled = [x[:2] * k, x[2:] * k]
    sums = [np.sum(p, dtype=np.float32) for p in scaled]
    # inserted before the last element (position -1), then the last element erased
    kept = [scaled[0], feeds["extra"]]
    want_np = [kept, kept[-1], np.array(2, np.int64), np.stack(sums), np.concatenate(feeds["given"], 1)]
    want_ort, _ = oracles(model, feeds, reference=False)
    for g, a, b in zip(got, want_ort, want_np):
        assert_same(g, a)
        assert_same(g, b)
    with pytest.raises(TypeError, match="'given'.*sequence"):
        sess.run(None, {**feeds, "given": feeds["x"]})
    # profiling a run whose values include ragged sequences (a sequence's "shape" is its length)
    so = onnxtrain.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "seq_")
    profiled = onnxtrain.InferenceSession(model, so)
    for g, a in zip(profiled.run(None, feeds), got):
        assert_same(g, a)
    with open(profiled.end_profiling()) as f:
        names = [e["name"] for e in json.load(f) if e["cat"] == "Node"]
    assert len(names) == len(model.graph.node) + 2 * 2  # and the map's two body nodes for each part
    assert names.count("SequenceMap_1/ReduceSum_1_kernel_time") == 2  # unnamed: <op>_<index>


def test_optional_values() -> None:
    nodes = [
        helper.make_node("OptionalHasElement", ["maybe"], ["has"]),
        helper.make_node(
            "If",
            ["has"],
            ["y"],
            then_branch=helper.make_graph(
                [helper.make_node("OptionalGetElement", ["maybe"], ["v"])], "t", [], [tensor("v", F, [2])]
            ),
            else_branch=helper.make_graph(
                [helper.make_node("Identity", ["fallback"], ["f"])], "e", [], [tensor("f", F, [2])]
            ),
        ),
    ]
    opt = helper.make_tensor_type_proto(F, [2])
    model = model_of(
        nodes,
        [helper.make_value_info("maybe", helper.make_optional_type_proto(opt)), tensor("fallback", F, [2])],
        [tensor("y", F, [2])],
        opset=18,
    )
    sess = onnxtrain.InferenceSession(model)
    assert sess.get_inputs()[0].type == "optional(tensor(float))"
    fallback = np.array([7.0, 8.0], np.float32)
    given = np.array([1.0, 2.0], np.float32)
    assert_same(sess.run(None, {"maybe": given, "fallback": fallback})[0], given)
    assert_same(sess.run(None, {"maybe": None, "fallback": fallback})[0], fallback)
    ref = ReferenceEvaluator(model)
    assert_same(
        sess.run(None, {"maybe": None, "fallback": fallback})[0],
        ref.run(None, {"maybe": None, "fallback": fallback})[0],
    )


# ---- liveness --------------------------------------------------------------------------------------------
def test_values_read_by_a_body_live_until_the_node_and_no_longer() -> None:
    """``big`` is read only inside the If's branches: it must survive until the If runs, then be freed."""
    then_g = helper.make_graph(
        [helper.make_node("ReduceSum", ["big"], ["t"], keepdims=0)], "t", [], [tensor("t", F, [])]
    )
    else_g = helper.make_graph(
        [helper.make_node("ReduceMax", ["big"], ["e"], keepdims=0)], "e", [], [tensor("e", F, [])]
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["big"]),
        helper.make_node("Exp", ["x"], ["other"]),
        helper.make_node("If", ["c"], ["s"], name="branch", then_branch=then_g, else_branch=else_g),
        helper.make_node("ReduceSum", ["other"], ["o"], keepdims=0),
        helper.make_node("Add", ["s", "o"], ["y"]),
    ]
    model = model_of(nodes, [tensor("x", F, [1000]), tensor("c", B, [])], [tensor("y", F, [])])
    plan = Plan(model, fuse=False)
    big = plan.slot["big"]
    (k,) = [i for i, st in enumerate(plan.steps) if st.node.op_type == "If"]
    assert big in plan.steps[k].inputs and big in plan.steps[k].free
    assert all(big not in st.free for st in plan.steps[:k])
    x = np.linspace(-1, 1, 1000, dtype=np.float32)
    for c in (True, False):
        got = plan.run({"x": x, "c": np.array(c)})[0]
        np.testing.assert_allclose(got, oracles(model, {"x": x, "c": np.array(c)})[0][0], rtol=1e-6)


def test_peak_bytes_count_what_a_body_holds() -> None:
    """Each iteration makes a 4 MB temporary and keeps only its sum: the plan's peak includes it once."""
    body = helper.make_graph(
        [
            helper.make_node("Expand", ["one", "shape"], ["big"]),
            helper.make_node("ReduceSum", ["big"], ["part"], keepdims=0),
            helper.make_node("Add", ["acc", "part"], ["acc_out"]),
        ],
        "body",
        [tensor("i", I64, []), tensor("c", B, []), tensor("acc", F, [])],
        [tensor("c", B, []), tensor("acc_out", F, [])],
    )
    loop = helper.make_node("Loop", ["n", "", "zero"], ["total"], body=body)
    inits = [
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array([1 << 20], np.int64), "shape"),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
    ]
    model = model_of([loop], [tensor("n", I64, [])], [tensor("total", F, [])], inits)
    plan = Plan(model)
    (total,) = plan.run({"n": np.array(3, np.int64)})
    assert total == 3 * (1 << 20)
    assert 4 << 20 <= plan.peak_bytes < 5 << 20
    plan.run({"n": np.array(0, np.int64)})
    assert plan.peak_bytes < 1 << 10


def test_profiling_traces_the_nodes_of_bodies(tmp_path) -> None:
    """Each body node run is an event named under its control-flow node (nested bodies too)."""
    so = onnxtrain.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "trace_")
    sess = onnxtrain.InferenceSession(nested_model(), so)
    feeds = {
        "x0": np.ones(3, np.float32),
        "n": np.array(3, np.int64),
        "cond": np.array(True),
        "w": np.ones(3, np.float32),
        "bias": np.ones(3, np.float32),
        "limit": np.array(1e9, np.float32),
    }
    sess.run(None, feeds)
    with open(sess.end_profiling()) as f:
        names = [e["name"].removesuffix("_kernel_time") for e in json.load(f) if e["cat"] == "Node"]
    assert names.count("outer_loop") == 1 and names.count("outer_loop/choose") == 3
    # iterations 0 and 2 take the then branch (Mul), iteration 1 the else branch (Add); an unnamed node is
    # named by its op and index in its graph, as onnxruntime names it
    assert names.count("outer_loop/choose/Mul_0") == 2 and names.count("outer_loop/choose/Add_0") == 1


# ---- errors ----------------------------------------------------------------------------------------------
def if_model(then_nodes, cond_shape=(), out="t", extra_inputs=()) -> onnx.ModelProto:
    then_g = helper.make_graph(then_nodes, "then", [], [tensor(out, F, None)])
    else_g = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["e"])], "else", [], [tensor("e", F, None)]
    )
    node = helper.make_node("If", ["c"], ["y"], name="the_if", then_branch=then_g, else_branch=else_g)
    g = helper.make_graph(
        [node],
        "g",
        [tensor("c", B, list(cond_shape)), tensor("x", F, [4]), *extra_inputs],
        [tensor("y", F, None)],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_errors_name_the_node() -> None:
    x = np.arange(4, dtype=np.float32)
    # a body op without a kernel: both nodes named
    m = if_model([helper.make_node("Frobnicate", ["x"], ["t"], name="inner", domain="com.example")])
    m.opset_import.append(helper.make_opsetid("com.example", 1))
    with pytest.raises(UnsupportedOpError, match=r"the_if.*If.*then_branch.*inner.*Frobnicate"):
        onnxtrain.InferenceSession(m)
    # a body that reads a value no graph produces
    with pytest.raises(EngineError, match=r"the_if.*If.*read by its body 'ghost'"):
        onnxtrain.InferenceSession(if_model([helper.make_node("Add", ["x", "ghost"], ["t"])]))
    # a failure inside a body at run time
    shape = numpy_helper.from_array(np.array([3, 3], np.int64), "bad_shape")
    m = if_model(
        [
            helper.make_node("Constant", [], ["s"], value=shape),
            helper.make_node("Reshape", ["x", "s"], ["t"], name="bad_reshape"),
        ]
    )
    sess = onnxtrain.InferenceSession(m)
    with pytest.raises(EngineError, match=r"the_if.*then_branch.*bad_reshape.*Reshape"):
        sess.run(None, {"c": np.array(True), "x": x})
    np.testing.assert_array_equal(sess.run(None, {"c": np.array(False), "x": x})[0], x)
    # a condition of two values
    sess = onnxtrain.InferenceSession(if_model([helper.make_node("Identity", ["x"], ["t"])], cond_shape=(2,)))
    with pytest.raises(EngineError, match=r"the_if.*If.*condition must hold a single value"):
        sess.run(None, {"c": np.array([True, False]), "x": x})
    # a branch with the wrong number of outputs
    then_g = helper.make_graph(
        [helper.make_node("Split", ["x"], ["a", "b"])],  # opset 17: no num_outputs (an invalid node)
        "then",
        [],
        [tensor("a", F, None), tensor("b", F, None)],
    )
    m = if_model([])
    next(a for a in m.graph.node[0].attribute if a.name == "then_branch").g.CopyFrom(then_g)
    with pytest.raises(EngineError, match=r"the_if.*then_branch has 2 outputs, the node 1"):
        Plan(m)


def test_scan_of_opset_8_matches_onnxruntime() -> None:
    # opset 8: a batch axis on states and scan inputs, per-entry sequence_lens, a reversed scan input;
    # scan outputs are zero past an entry's length
    body = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["xw"]), helper.make_node("Add", ["s", "xw"], ["s2"]),
         helper.make_node("Sub", ["s2", "x"], ["o"])],
        "b",
        [tensor("s", F, [2]), tensor("x", F, [2]), tensor("w", F, [2])],
        [tensor("s2", F, [2]), tensor("o", F, [2])],
    )
    node = helper.make_node("Scan", ["lens", "s0", "xs", "ws"], ["s", "os"], num_scan_inputs=2,
                            directions=[0, 1], body=body)
    m = model_of([node], [tensor("lens", I64, [3]), tensor("s0", F, [3, 2]), tensor("xs", F, [3, 4, 2]),
                          tensor("ws", F, [3, 4, 2])], [tensor("s", F, [3, 2]), tensor("os", F, [3, 4, 2])],
                 opset=8)
    rng = np.random.default_rng(0)
    feeds = {"s0": rng.standard_normal((3, 2)).astype(np.float32),
             "xs": rng.standard_normal((3, 4, 2)).astype(np.float32),
             "ws": rng.standard_normal((3, 4, 2)).astype(np.float32)}
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    for lens in ([4, 2, 1], [4, 4, 4]):
        f = {**feeds, "lens": np.array(lens, np.int64)}
        for ours, theirs in zip(Plan(m).run(f), sess.run(None, f)):
            np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    # sequence_lens omitted: every entry runs the whole sequence
    node.input[0] = ""
    m_all = model_of([node], list(m.graph.input)[1:], list(m.graph.output), opset=8)
    np.testing.assert_allclose(Plan(m_all).run(feeds)[1],
                               sess.run(None, {**feeds, "lens": np.array([4, 4, 4], np.int64)})[1],
                               rtol=1e-6, atol=1e-6)


def test_gradient_through_a_scan_of_opset_8_is_a_clear_error() -> None:
    """onnx's version converter drops Scan-8's batch axis from the declared shapes without squeezing the
    data, so the gradient builder refuses such models by name instead of building a wrong graph."""
    from onnxtrain.autodiff import build_gradient_model
    from onnxtrain.autodiff.builder import GradientError

    body = helper.make_graph(
        [helper.make_node("Add", ["s", "x"], ["s2"]), helper.make_node("Identity", ["s2"], ["o"])],
        "b", [tensor("s", F, [2]), tensor("x", F, [2])], [tensor("s2", F, [2]), tensor("o", F, [2])])
    node = helper.make_node("Scan", ["", "s0", "xs"], ["s", "os"], num_scan_inputs=1, body=body,
                            name="scan8")
    red = helper.make_node("ReduceSum", ["os"], ["loss"], keepdims=0)
    m = model_of([node, red], [tensor("s0", F, [1, 2]), tensor("xs", F, [1, 3, 2])],
                 [tensor("loss", F, []), tensor("s", F, [1, 2])], opset=8)
    with pytest.raises(GradientError, match="scan8.*opset 9"):
        build_gradient_model(m, "loss", ["xs"])
