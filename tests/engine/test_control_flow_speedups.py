"""The per-iteration path of Scan and Loop (onnxtrain/engine/control_flow.py): scan inputs sliced as read-only
views where the slice is contiguous (a copy by ``np.ascontiguousarray`` where it is strided), scan outputs
written into arrays of the known count as the iterations give them, bodies that never write into their
inputs (no donation reaches a body's steps), and the shapes of a loop of no iteration found by shape
inference from the body's inputs. Each result is checked bit for bit against a plain numpy loop or against
the same graph's run without the speed-up's conditions."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.engine import EngineError, Plan

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def tensor(name: str, elem: int = F, shape=None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def model_of(nodes, inputs, outputs, inits=(), opset: int = 17) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def scan_model(in_axis: int, in_dir: int, out_axis: int, out_dir: int, rank: int) -> onnx.ModelProto:
    """s' = s + tanh(x_t * 2); y_t = s' * x_t; z_t = x_t (Identity: a view of the input's slice)."""
    body = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["m"]), helper.make_node("Tanh", ["m"], ["th"]),
         helper.make_node("Add", ["s", "th"], ["s2"]), helper.make_node("Mul", ["s2", "x"], ["y"]),
         helper.make_node("Identity", ["x"], ["z"])],
        "body", [tensor("s", F, [None] * (rank - 1)), tensor("x", F, [None] * (rank - 1))],
        [tensor(n, F, [None] * (rank - 1)) for n in ("s2", "y", "z")],
        initializer=[helper.make_tensor("two", F, [], [2.0])])
    node = helper.make_node("Scan", ["s0", "xs"], ["sT", "ys", "zs"], body=body, num_scan_inputs=1,
                            scan_input_axes=[in_axis], scan_input_directions=[in_dir],
                            scan_output_axes=[out_axis, out_axis], scan_output_directions=[out_dir, out_dir])
    return model_of([node], [tensor("s0", F, [None] * (rank - 1)), tensor("xs", F, [None] * rank)],
                    [tensor(n, F, None) for n in ("sT", "ys", "zs")])


def scan_by_hand(s0, xs, in_axis, in_dir, out_axis, out_dir):
    steps = xs.shape[in_axis]
    s, ys, zs = s0, [], []
    for t in range(steps):
        x = np.take(xs, steps - 1 - t if in_dir else t, axis=in_axis)
        s = s + np.tanh(x * np.float32(2.0))
        ys.append(s * x)
        zs.append(x)
    if out_dir:
        ys, zs = ys[::-1], zs[::-1]
    return s, np.stack(ys, axis=out_axis), np.stack(zs, axis=out_axis)


LAYOUTS = ["contiguous", "reversed", "transposed"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("in_axis,in_dir,out_axis,out_dir", [(0, 0, 0, 0), (1, 1, 1, 1), (1, 0, -1, 1),
                                                             (2, 1, 0, 0)])
def test_scan_slices_give_the_values_of_copies_and_leave_the_input_alone(layout, in_axis, in_dir, out_axis,
                                                                          out_dir) -> None:
    rng = np.random.default_rng(in_axis * 4 + in_dir)
    base = rng.standard_normal((5, 6, 7)).astype(np.float32)
    xs = {"contiguous": base, "reversed": base[::-1, ::-1], "transposed": base.transpose(2, 0, 1)}[layout]
    s_shape = tuple(d for k, d in enumerate(xs.shape) if k != in_axis)
    s0 = rng.standard_normal(s_shape).astype(np.float32)
    kept, kept_s0 = xs.copy(), s0.copy()
    model = scan_model(in_axis, in_dir, out_axis, out_dir, 3)
    got = Plan(model).run({"s0": s0, "xs": xs})
    want = scan_by_hand(s0, xs, in_axis, in_dir, out_axis, out_dir)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(xs, kept)
    np.testing.assert_array_equal(s0, kept_s0)
    for a in got:  # every output is an array of its own, as when each slice was a copy
        assert a.flags.writeable and not np.may_share_memory(a, base)


def test_a_state_that_is_a_slice_comes_back_as_a_copy() -> None:
    """The body passes its scan input's slice on as the state: the final state is the last slice, an array
    of its own (writeable, not the caller's memory)."""
    body = helper.make_graph([helper.make_node("Identity", ["x"], ["s2"]),
                              helper.make_node("Neg", ["s"], ["y"])], "body",
                             [tensor("s", F, [3]), tensor("x", F, [3])],
                             [tensor("s2", F, [3]), tensor("y", F, [3])])
    node = helper.make_node("Scan", ["s0", "xs"], ["sT", "ys"], body=body, num_scan_inputs=1)
    model = model_of([node], [tensor("s0", F, [3]), tensor("xs", F, [4, 3])], [tensor("sT"), tensor("ys")])
    xs = np.arange(12, dtype=np.float32).reshape(4, 3)
    s, ys = Plan(model).run({"s0": np.ones(3, np.float32), "xs": xs})
    np.testing.assert_array_equal(s, xs[3])
    np.testing.assert_array_equal(ys, -np.concatenate([np.ones((1, 3), np.float32), xs[:3]]))
    assert s.flags.writeable and not np.may_share_memory(s, xs)
    s[:] = 0
    assert xs[3, 0] == 9.0


def donation_model(captured: bool) -> onnx.ModelProto:
    """A Scan whose body's elementwise chain reads a large value at its last use (its plan may let such a
    chain write into the value when a run donates it), next to an outer update of a donated ``w``; the outer
    inputs are ordered so that ``w``'s slot number is the body's slot of that value."""
    big = [256, 512]  # 131,072 elements: big enough for the chain's donation program
    src = "c" if captured else "x"
    body = helper.make_graph(
        [helper.make_node("Mul", [src, "two"], ["m"]), helper.make_node("Add", ["m", "one"], ["p"]),
         helper.make_node("Tanh", ["p"], ["y"]), helper.make_node("Add", ["s", "y"], ["s2"])],
        "body", [tensor("s", F, big), tensor("x", F, big)], [tensor("s2", F, big), tensor("y", F, big)],
        initializer=[helper.make_tensor("two", F, [], [2.0]), helper.make_tensor("one", F, [], [1.0])])
    nodes = [helper.make_node("Scan", ["s0", "xs"], ["sT", "ys"], body=body, num_scan_inputs=1),
             helper.make_node("Mul", ["w", "three"], ["w3"]),
             helper.make_node("Add", ["w3", "one_o"], ["w4"])]
    names = [("s0", big), ("xs", [3, *big]), ("w", big), ("c", big)] if captured else \
        [("s0", big), ("w", big), ("xs", [3, *big])]
    return model_of(nodes, [tensor(n, F, s) for n, s in names], [tensor(n) for n in ("sT", "ys", "w4")],
                    [helper.make_tensor("three", F, [], [3.0]), helper.make_tensor("one_o", F, [], [1.0])])


@pytest.mark.parametrize("captured", [False, True], ids=["scan-input", "captured"])
def test_a_donated_run_does_not_let_a_body_write_into_its_inputs(captured: bool) -> None:
    """A body's plan names its values by slots of its own: a donation of the outer run (the outer plan's
    slot numbers) must not reach its steps. Before, the captured value ``c`` was overwritten."""
    model = donation_model(captured)
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal([d.dim_value for d in v.type.tensor_type.shape.dim]).astype(np.float32)
             for n, v in ((v.name, v) for v in model.graph.input)}
    plan = Plan(model)
    body_plan = next(st.fn for st in plan.steps if st.node.op_type == "Scan").bodies["body"].plan
    body_slot = body_plan.slot["c" if captured else "x"]
    assert plan.slot["w"] == body_slot and body_slot in body_plan._reusable  # the case this test is about
    want = Plan(model).run({k: v.copy() for k, v in feeds.items()})
    kept = {k: v.copy() for k, v in feeds.items()}
    got = plan.run(dict(feeds), donate=["w"])
    for k in feeds:
        if k != "w":
            np.testing.assert_array_equal(feeds[k], kept[k], err_msg=k)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def loop_model(with_cond: bool) -> onnx.ModelProto:
    """h' = h * 0.5 + i; outputs per iteration: h' and i (a scalar); stops after 3 when ``with_cond``."""
    body = helper.make_graph(
        [helper.make_node("Cast", ["i"], ["fi"], to=F), helper.make_node("Mul", ["h", "half"], ["hh"]),
         helper.make_node("Add", ["hh", "fi"], ["h2"]), helper.make_node("Identity", ["h2"], ["y"]),
         helper.make_node("Identity", ["i"], ["iy"]), helper.make_node("Less", ["i", "two"], ["go"])],
        "body", [tensor("i", I64, []), tensor("c", TensorProto.BOOL, []), tensor("h", F, [2, 3])],
        [tensor("go", TensorProto.BOOL, []), tensor("h2", F, [2, 3]), tensor("y", F, [2, 3]),
         tensor("iy", I64, [])],
        initializer=[helper.make_tensor("half", F, [], [0.5]), helper.make_tensor("two", I64, [], [2])])
    node = helper.make_node("Loop", ["M", "cond" if with_cond else "", "h0"], ["hT", "ys", "is"], body=body)
    ins = [tensor("M", I64, []), tensor("h0", F, [2, 3])]
    if with_cond:
        ins.insert(1, tensor("cond", TensorProto.BOOL, []))
    return model_of([node], ins, [tensor("hT"), tensor("ys"), tensor("is", I64)])


@pytest.mark.parametrize("with_cond", [False, True], ids=["trip-count", "condition"])
@pytest.mark.parametrize("trips", [0, 1, 5])
def test_loop_scan_outputs_equal_a_numpy_loop(with_cond: bool, trips: int) -> None:
    h0 = np.random.default_rng(trips).standard_normal((2, 3)).astype(np.float32)
    feeds = {"M": np.array(trips, np.int64), "h0": h0}
    if with_cond:
        feeds["cond"] = np.array(True)
    h, ys, its = Plan(loop_model(with_cond)).run(feeds)
    want_h, want_ys, want_is = h0, [], []
    for i in range(trips):
        want_h = want_h * np.float32(0.5) + np.float32(i)
        want_ys.append(want_h)
        want_is.append(np.int64(i))
        if with_cond and not i < 2:
            break
    np.testing.assert_array_equal(h, want_h)
    assert ys.shape == (len(want_ys), 2, 3) and ys.dtype == np.float32
    assert its.shape == (len(want_is),) and its.dtype == np.int64
    if want_ys:
        np.testing.assert_array_equal(ys, np.stack(want_ys))
        np.testing.assert_array_equal(its, np.array(want_is))


def test_a_scan_output_that_changes_shape_is_still_an_error() -> None:
    """NonZero of each slice: the per-step outputs differ in shape, which a stacked output cannot hold."""
    body = helper.make_graph([helper.make_node("NonZero", ["x"], ["nz"]),
                              helper.make_node("Identity", ["s"], ["s2"])], "body",
                             [tensor("s", F, [1]), tensor("x", F, [3])],
                             [tensor("s2", F, [1]), tensor("nz", I64, [1, None])])
    node = helper.make_node("Scan", ["s0", "xs"], ["sT", "nzs"], body=body, num_scan_inputs=1)
    model = model_of([node], [tensor("s0", F, [1]), tensor("xs", F, [2, 3])],
                     [tensor("sT"), tensor("nzs", I64)])
    xs = np.array([[1, 0, 1], [1, 1, 1]], np.float32)
    with pytest.raises(EngineError, match="changes shape between iterations"):
        Plan(model).run({"s0": np.zeros(1, np.float32), "xs": xs})
    same = np.array([[1, 0, 1], [0, 1, 1]], np.float32)  # two nonzeros in each row: one shape
    _, nzs = Plan(model).run({"s0": np.zeros(1, np.float32), "xs": same})
    np.testing.assert_array_equal(nzs, [[[0, 2]], [[1, 2]]])


def test_scan_of_no_steps_gives_outputs_the_shapes_the_body_would() -> None:
    """The body's outputs are declared with unknown dims; with no step, shape inference on the body (its
    inputs typed as the states and a slice of the scan input, its captured weight's shape) gives them:
    ys is (B, 0, H) and not (0, 0, 0)."""
    body = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["s", "xw"], ["s2"]),
         helper.make_node("Identity", ["s2"], ["y"])],
        "body", [tensor("s", F, [None, None]), tensor("x", F, [None, None])],
        [tensor("s2", F, [None, None]), tensor("y", F, [None, None])])
    node = helper.make_node("Scan", ["s0", "xs"], ["sT", "ys"], body=body, num_scan_inputs=1,
                            scan_input_axes=[1], scan_output_axes=[1])
    model = model_of([node], [tensor("s0", F, ["B", 5]), tensor("xs", F, ["B", "T", 4]),
                              tensor("W", F, [4, 5])], [tensor("sT"), tensor("ys")])
    w = np.ones((4, 5), np.float32)
    s0 = np.ones((3, 5), np.float32)
    s, ys = Plan(model).run({"s0": s0, "xs": np.zeros((3, 0, 4), np.float32), "W": w})
    np.testing.assert_array_equal(s, s0)
    assert ys.shape == (3, 0, 5) and ys.dtype == np.float32
    _, ys = Plan(model).run({"s0": s0, "xs": np.ones((3, 2, 4), np.float32), "W": w})
    assert ys.shape == (3, 2, 5)


def test_loop_of_no_iteration_gives_outputs_the_shapes_the_body_would() -> None:
    body = helper.make_graph(
        [helper.make_node("Concat", ["h", "h"], ["hh"], axis=1), helper.make_node("Identity", ["h"], ["h2"])],
        "body", [tensor("i", I64, []), tensor("c", TensorProto.BOOL, []), tensor("h", F, [None, None])],
        [tensor("c", TensorProto.BOOL, []), tensor("h2", F, [None, None]), tensor("hh", F, [None, None])])
    node = helper.make_node("Loop", ["M", "", "h0"], ["hT", "ys"], body=body)
    model = model_of([node], [tensor("M", I64, []), tensor("h0", F, [2, 3])], [tensor("hT"), tensor("ys")])
    h0 = np.ones((2, 3), np.float32)
    h, ys = Plan(model).run({"M": np.array(0, np.int64), "h0": h0})
    np.testing.assert_array_equal(h, h0)
    assert ys.shape == (0, 2, 6)
