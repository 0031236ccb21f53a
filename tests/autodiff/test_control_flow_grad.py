"""Gradients through If (onnxtrain/autodiff/rules/control_flow.py): against torch autograd on a scripted
model and against central differences on nested branches; the gradient graphs run in onnxruntime too."""

from __future__ import annotations

import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto as T
from onnx import helper, numpy_helper
from torch import nn

from onnxtrain.autodiff import GradientError, build_gradient_model
from onnxtrain.ir.graphs import node_reads, subgraphs
from onnxtrain.testing import gradcheck, run_engine
from tests import models
from tests.engine.graphs import scan_over_pairs


class Branchy(nn.Module):
    """A data-dependent branch whose two sides read different weights, and one weight read by both."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)
        self.c = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:  # noqa: SIM108 - scripted: an if statement exports as an If node
            y = torch.tanh(self.b(x)) * h
        else:
            y = h * h - self.c(x)
        return (y * y).mean()


def engine_outputs(gmodel: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    """The gradient model's outputs by name, run on onnxtrain's engine."""
    return dict(zip([o.name for o in gmodel.graph.output], run_engine(gmodel, feeds)))


def ort_outputs(gmodel: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    """The gradient model's outputs by name, run on onnxruntime's inference package."""
    sess = ort.InferenceSession(gmodel.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in gmodel.graph.output], sess.run(None, feeds)))


def export_scripted(module: nn.Module, x: torch.Tensor) -> onnx.ModelProto:
    return models.export_torchscript(module, (x,), ["x"], ["loss"], {"x": {0: "batch"}}, script=True)


@pytest.mark.parametrize("shift", [3.0, -3.0])
def test_if_gradient_matches_torch(shift: float) -> None:
    torch.manual_seed(0)
    module = Branchy()
    # along the direction that raises sum(a(x)) or lowers it, for the branch to take
    toward = module.a.weight.detach().sum(0)
    x = (shift * toward / toward.norm() + 0.1 * torch.randn(5, 4)).float()
    model = export_scripted(module, x)
    assert "If" in {n.op_type for n in model.graph.node}
    names = {t.name for t in model.graph.initializer}
    params = dict(module.named_parameters())
    wrt = sorted(n for n in params if n in names)
    assert len(wrt) == 6, f"initializers {sorted(names)}"
    gmodel = build_gradient_model(model, "loss", wrt)
    onnx.checker.check_model(gmodel, full_check=True)
    got = engine_outputs(gmodel, {"x": x.numpy()})
    from_ort = ort_outputs(gmodel, {"x": x.numpy()})
    loss = module(x)
    loss.backward()
    took_then = bool(module.a(x).sum() > 0)
    assert took_then == (shift > 0)
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5)
    for n in wrt:
        grad = params[n].grad
        want = (
            np.zeros(params[n].shape, np.float32) if grad is None else grad.numpy()
        )  # None: the idle branch
        np.testing.assert_allclose(got[f"{n}_grad"], want, rtol=1e-4, atol=1e-6, err_msg=n)
        np.testing.assert_allclose(from_ort[f"{n}_grad"], want, rtol=1e-4, atol=1e-6, err_msg=n)
    # the weight of the branch not taken gets zeros
    idle = "c" if took_then else "b"
    assert not got[f"{idle}.weight_grad"].any()


def nested_model() -> onnx.ModelProto:
    """y = If(c1){ If(c2){ x·w·u } else { x + w } } else { w·w·x (a branch output read twice) } ;
    loss = sum(y · v): u is read only by the inner If, w at both depths."""
    d = T.DOUBLE

    def vi(name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, d, [3])

    inner_then = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["p"]), helper.make_node("Mul", ["p", "u"], ["it"])],
        "inner_then",
        [],
        [vi("it")],
    )
    inner_else = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["ie"])], "inner_else", [], [vi("ie")]
    )
    outer_then = helper.make_graph(
        [helper.make_node("If", ["c2"], ["ot"], then_branch=inner_then, else_branch=inner_else)],
        "outer_then",
        [],
        [vi("ot")],
    )
    outer_else = helper.make_graph(
        [helper.make_node("Mul", ["w", "w"], ["ww"]), helper.make_node("Mul", ["ww", "x"], ["oe"])],
        "outer_else",
        [],
        [vi("oe")],
    )
    nodes = [
        helper.make_node("If", ["c1"], ["y"], name="outer", then_branch=outer_then, else_branch=outer_else),
        helper.make_node("Mul", ["y", "v"], ["yv"]),
        helper.make_node("ReduceSum", ["yv"], ["loss"], keepdims=0),
    ]
    inits = [
        numpy_helper.from_array(np.array(a), n)
        for n, a in (("w", [1.5, -2.0, 0.25]), ("u", [0.5, 2.0, -1.0]), ("v", [1.0, -3.0, 2.0]))
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [
            vi("x"),
            helper.make_tensor_value_info("c1", T.BOOL, []),
            helper.make_tensor_value_info("c2", T.BOOL, []),
        ],
        [helper.make_tensor_value_info("loss", d, [])],
        inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8  # onnxruntime's inference package reads it
    return m


@pytest.mark.parametrize("c1, c2", [(True, True), (True, False), (False, True)])
def test_nested_if_gradients(c1: bool, c2: bool) -> None:
    model = nested_model()
    feeds = {"x": np.array([0.5, -1.0, 2.0]), "c1": np.array(c1), "c2": np.array(c2)}
    grads = gradcheck(model, "loss", ["w", "u", "v", "x"], feeds)
    x, w, u, v = (
        feeds["x"],
        np.array([1.5, -2.0, 0.25]),
        np.array([0.5, 2.0, -1.0]),
        np.array([1.0, -3.0, 2.0]),
    )
    if c1 and c2:
        want_w, want_u = x * u * v, x * w * v
    elif c1:
        want_w, want_u = v, np.zeros(3)
    else:
        want_w, want_u = 2 * w * x * v, np.zeros(3)
    np.testing.assert_allclose(grads["w"], want_w, rtol=1e-12)
    np.testing.assert_allclose(grads["u"], want_u, rtol=1e-12)
    gmodel = build_gradient_model(model, "loss", ["w", "u"])
    onnx.checker.check_model(gmodel, full_check=True)
    got = ort_outputs(gmodel, feeds)
    np.testing.assert_allclose(got["w_grad"], want_w, rtol=1e-12)
    np.testing.assert_allclose(got["u_grad"], want_u, rtol=1e-12)


# ---- Loop --------------------------------------------------------------------------------------------------
def loop_model(with_cond: bool) -> onnx.ModelProto:
    """acc ← acc·w + i·u for i < n (and, with_cond, while sum(acc) < limit), with a scan output acc·v;
    loss = sum(final acc) + sum(scan): w, u and v are read only inside the body."""
    d = T.DOUBLE
    body = helper.make_graph(
        [
            helper.make_node("Cast", ["i"], ["fi"], to=d),
            helper.make_node("Mul", ["acc", "w"], ["aw"]),
            helper.make_node("Mul", ["fi", "u"], ["iu"]),
            helper.make_node("Add", ["aw", "iu"], ["acc2"]),
            helper.make_node("Mul", ["acc2", "v"], ["s"]),
            helper.make_node("ReduceSum", ["acc2"], ["total"], keepdims=0),
            helper.make_node("Less", ["total", "limit"], ["go"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", T.INT64, []),
            helper.make_tensor_value_info("c", T.BOOL, []),
            helper.make_tensor_value_info("acc", d, [3]),
        ],
        [
            helper.make_tensor_value_info("go", T.BOOL, []),
            helper.make_tensor_value_info("acc2", d, [3]),
            helper.make_tensor_value_info("s", d, [3]),
        ],
    )
    nodes = [
        helper.make_node(
            "Loop", ["n", "c0" if with_cond else "", "x"], ["y", "scan"], name="the_loop", body=body
        ),
        helper.make_node("ReduceSum", ["y"], ["ly"], keepdims=0),
        helper.make_node("ReduceSum", ["scan"], ["ls"], keepdims=0),
        helper.make_node("Add", ["ly", "ls"], ["loss"]),
    ]
    inits = [
        numpy_helper.from_array(np.array(a), name)
        for name, a in (
            ("w", [1.1, -0.9, 0.5]),
            ("u", [0.3, 0.2, -0.4]),
            ("v", [1.0, 2.0, -1.5]),
            ("limit", 1.5),
        )
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", d, [3]),
            helper.make_tensor_value_info("n", T.INT64, []),
            helper.make_tensor_value_info("c0", T.BOOL, []),
        ],
        [helper.make_tensor_value_info("loss", d, [])],
        inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def loop_reference(x, n, w, u, v, limit, with_cond):
    """The same loop in torch, float64: (loss, iterations run)."""
    acc, total, steps = x, 0.0, 0
    for i in range(n):
        acc = acc * w + i * u
        total = total + (acc * v).sum()
        steps += 1
        if with_cond and not bool(acc.sum() < limit):
            break
    return acc.sum() + total, steps


@pytest.mark.parametrize("n, with_cond", [(0, False), (1, False), (4, False), (6, True)])
def test_loop_gradients_match_torch(n: int, with_cond: bool) -> None:
    model = loop_model(with_cond)
    feeds = {"x": np.array([0.5, 1.0, -2.0]), "n": np.array(n, np.int64), "c0": np.array(True)}
    names = ["w", "u", "v", "x"]
    grads = gradcheck(model, "loss", names, feeds)
    inits = {
        t.name: torch.tensor(numpy_helper.to_array(t), requires_grad=True) for t in model.graph.initializer
    }
    x = torch.tensor(feeds["x"], requires_grad=True)
    loss, steps = loop_reference(x, n, inits["w"], inits["u"], inits["v"], inits["limit"], with_cond)
    if with_cond:
        assert 0 < steps < n  # the condition stopped the loop early
    loss.backward()
    want = {"w": inits["w"].grad, "u": inits["u"].grad, "v": inits["v"].grad, "x": x.grad}
    for name in names:
        w = np.zeros(3) if want[name] is None else want[name].numpy()
        np.testing.assert_allclose(grads[name], w, rtol=1e-10, atol=1e-12, err_msg=name)
    gmodel = build_gradient_model(model, "loss", names)
    onnx.checker.check_model(gmodel, full_check=True)
    got = ort_outputs(gmodel, feeds)
    for name in names:
        np.testing.assert_allclose(got[f"{name}_grad"], grads[name], rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_trains(mode: str) -> None:
    """nn.EmbeddingBag exports as a Loop over the bags: the embedding's gradient matches torch's. For sum
    and mean there is no backward loop (onnxtrain.ir.bag_loops): one ScatterND adds every id position's
    share into the table; max keeps the backward Loop, whose iterations scatter their bag's rows straight
    into the table's gradient accumulator. The gradient graph also runs in onnxruntime."""
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(10, 3, mode=mode)
    ids = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
    offsets = torch.tensor([0, 3, 6])

    class Loss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = bag

        def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
            return (self.bag(ids, offsets) ** 2).sum()

    model = models.export_torchscript(Loss(), (ids, offsets), ["ids", "offsets"], ["loss"],
                                      {"ids": {0: "n"}, "offsets": {0: "b"}})
    assert "Loop" in {nd.op_type for nd in model.graph.node}
    (weight,) = [t.name for t in model.graph.initializer if tuple(t.dims) == (10, 3)]
    gmodel = build_gradient_model(model, "loss", [weight])
    onnx.checker.check_model(gmodel, full_check=True)
    back = [nd for nd in gmodel.graph.node if nd.op_type == "Loop" and "Grad" in nd.name]
    assert not back  # (max mode kept its backward loop before, a table-sized copy an iteration)
    assert [nd.op_type for nd in gmodel.graph.node].count("ScatterND") == (2 if mode == "max" else 1)
    layouts = [[0, 3, 6], [0, 1], [0, 3, 3, 6], [0, 8]] if mode == "sum" else [[0, 3, 6], [0, 1], [0, 7]]
    for offs in layouts:
        feeds = {"ids": ids.numpy(), "offsets": np.array(offs, np.int64)}
        got = engine_outputs(gmodel, feeds)
        bag.zero_grad()
        want_loss = Loss()(ids, torch.tensor(offs))
        want_loss.backward()
        np.testing.assert_allclose(got["loss"], want_loss.item(), rtol=1e-5)
        np.testing.assert_allclose(got[f"{weight}_grad"], bag.weight.grad.numpy(), rtol=1e-5, atol=1e-6)
        theirs = ort_outputs(gmodel, feeds)
        np.testing.assert_allclose(theirs[f"{weight}_grad"], got[f"{weight}_grad"], rtol=1e-5, atol=1e-6)
    if mode != "max":
        # offsets out of order, which torch's EmbeddingBag refuses but the exported loop pools as it slices:
        # bags [0, 5), [5, 3) (empty) and [3, 8), overlapping; torch autograd on those slices is the oracle
        feeds = {"ids": ids.numpy(), "offsets": np.array([0, 5, 3], np.int64)}
        with np.errstate(invalid="ignore", divide="ignore"):  # the mean of the empty bag is 0 / 0
            got = engine_outputs(gmodel, feeds)
        table = bag.weight.detach().clone().requires_grad_(True)
        pool = torch.sum if mode == "sum" else torch.mean
        outs = [pool(table[ids[a:b]], 0) for a, b in ((0, 5), (5, 3), (3, 8))]
        want = sum((o ** 2).sum() for o in outs)
        want.backward()
        np.testing.assert_allclose(got["loss"], want.item(), rtol=1e-5)  # NaN for the mean's empty bag
        np.testing.assert_allclose(got[f"{weight}_grad"], table.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", ["include_last_offset", "per_sample_weights", "2d_input"])
def test_embedding_bag_variants_train(variant: str) -> None:
    """The other EmbeddingBag exports: offsets with the last one included and a 2-D input (no offsets)
    still pool bags (onnxtrain.ir.bag_loops); per-sample weights scale the rows inside the body, which
    keeps the backward Loop. The table's gradient matches torch's either way."""
    from onnxtrain.ir.bag_loops import match_bag_loop

    torch.manual_seed(0)
    ids = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
    if variant == "include_last_offset":
        bag = nn.EmbeddingBag(10, 3, mode="sum", include_last_offset=True)
        args, names, call = (ids, torch.tensor([0, 3, 8])), ["ids", "offsets"], lambda b, i, o: b(i, o)
    elif variant == "per_sample_weights":
        bag = nn.EmbeddingBag(10, 3, mode="sum")
        args, names = (ids, torch.tensor([0, 3]), torch.rand(8)), ["ids", "offsets", "w"]
        call = lambda b, i, o, w: b(i, o, per_sample_weights=w)  # noqa: E731
    else:
        bag = nn.EmbeddingBag(10, 3, mode="mean")
        args, names, call = (ids.reshape(2, 4),), ["ids"], lambda b, i: b(i)

    class Loss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = bag

        def forward(self, *a: torch.Tensor) -> torch.Tensor:
            return (call(self.bag, *a) ** 2).sum()

    model = models.export_torchscript(Loss(), args, names, ["loss"], {n: {0: "n"} for n in names})
    (loop,) = [nd for nd in model.graph.node if nd.op_type == "Loop"]
    assert (match_bag_loop(loop) is None) == (variant == "per_sample_weights")
    (weight,) = [t.name for t in model.graph.initializer if tuple(t.dims) == (10, 3)]
    gmodel = build_gradient_model(model, "loss", [weight])
    onnx.checker.check_model(gmodel, full_check=True)
    got = engine_outputs(gmodel, {n: a.numpy() for n, a in zip(names, args)})
    loss = Loss()(*args)
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-6)
    np.testing.assert_allclose(got[f"{weight}_grad"], bag.weight.grad.numpy(), rtol=1e-6, atol=1e-7)


def test_if_inside_loop_gradients() -> None:
    """A Loop whose body holds an If whose branches read values of the body and of the main graph: the
    Loop's backward body differentiates the If through its own rule (central differences, float64)."""
    from onnxtrain.testing import to_float64
    from tests.engine.test_control_flow import nested_model

    model = nested_model()
    g = model.graph
    g.node.extend(
        [
            helper.make_node("ReduceSum", ["y"], ["ly"], keepdims=0),
            helper.make_node("ReduceSum", ["scan"], ["ls"], keepdims=0),
            helper.make_node("Add", ["ly", "ls"], ["loss"]),
        ]
    )
    g.output.append(helper.make_tensor_value_info("loss", T.FLOAT, []))
    feeds = {
        "x0": np.array([-1.0, -2.0, -0.5]),
        "n": np.array(5, np.int64),
        "cond": np.array(True),
        "w": np.array([1.5, 2.0, 1.25]),
        "bias": np.array([0.5, -1.0, 2.0]),
        "limit": np.array(1e9),
    }
    grads = gradcheck(to_float64(model), "loss", ["w", "bias", "x0"], feeds)
    # five iterations: acc_0 = -x0·w, acc_1 = acc_0 + bias, acc_2 = acc_1·w, acc_3 = acc_2 + bias,
    # acc_4 = acc_3·w; loss = sum of every acc_i (the scan) + sum(acc_4) (y). d acc_i / d bias: 0, 1, w,
    # w + 1, w² + w, so d loss / d bias = (2 + 3w + w²) + (w² + w)
    w = feeds["w"]
    np.testing.assert_allclose(grads["bias"], 2 + 4 * w + 2 * w * w, rtol=1e-9)


def test_to_float64_converts_the_bodies_too() -> None:
    """``to_float64`` turns the float32 values declared in control-flow bodies (nested: an If in a Loop) to
    float64 too, so that the bodies' nodes are of one type with the main graph's; its run equals
    onnx.reference's."""
    from onnx.reference import ReferenceEvaluator

    from onnxtrain.engine import compile_model
    from onnxtrain.ir.graphs import named_subgraphs
    from onnxtrain.testing import to_float64
    from tests.engine.test_control_flow import nested_model

    model = to_float64(nested_model())

    def declared(g: onnx.GraphProto) -> set[int]:
        kinds = {v.type.tensor_type.elem_type for v in (*g.input, *g.output, *g.value_info)}
        for n in g.node:
            for _, body in named_subgraphs(n):
                kinds |= declared(body)
        return kinds

    assert T.FLOAT not in declared(model.graph) and T.DOUBLE in declared(model.graph)
    feeds = {"x0": np.array([-1.0, -2.0, -0.5]), "n": np.array(5, np.int64), "cond": np.array(True),
             "w": np.array([1.5, 2.0, 1.25]), "bias": np.array([0.5, -1.0, 2.0]), "limit": np.array(1e9)}
    got = compile_model(model).run(feeds)
    want = ReferenceEvaluator(model).run(None, feeds)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-12)


def test_to_float64_converts_sequences_and_default_float_outputs() -> None:
    """Sequence-typed declarations (a Loop appending to a list) and a SequenceEmpty whose dtype is left out
    (float32 by default) become float64 too: onnxruntime (the oracle) loads the result, which it refused
    before ("Input element type of 11 does not match existing output type of 1"), and both run it to the
    float64 values, not float32-rounded ones."""
    from onnxtrain.engine import compile_model
    from onnxtrain.testing import to_float64

    vi, seq = helper.make_tensor_value_info, helper.make_tensor_sequence_value_info
    body = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["co"]), helper.make_node("SequenceInsert", ["s", "x"], ["so"])],
        "body", [vi("i", T.INT64, []), vi("c", T.BOOL, []), seq("s", T.FLOAT, None)],
        [vi("co", T.BOOL, []), seq("so", T.FLOAT, None)])
    g = helper.make_graph([helper.make_node("SequenceEmpty", [], ["e"]),
                           helper.make_node("Loop", ["n", "", "e"], ["seq"], body=body),
                           helper.make_node("ConcatFromSequence", ["seq"], ["y"], axis=0)], "g",
                          [vi("x", T.FLOAT, [2]), vi("n", T.INT64, [])], [vi("y", T.FLOAT, None)])
    model = to_float64(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    feeds = {"x": np.array([1.0, 1 / 3]), "n": np.array(2, np.int64)}
    want = np.concatenate([feeds["x"], feeds["x"]])
    cpu = ["CPUExecutionProvider"]
    got_ort = ort.InferenceSession(model.SerializeToString(), providers=cpu).run(None, feeds)[0]
    got = compile_model(model).run(feeds)[0]
    for y in (got_ort, got):
        assert y.dtype == np.float64
        np.testing.assert_array_equal(y, want)


def test_to_float64_gives_constant_of_shape_a_float64_value() -> None:
    """ConstantOfShape without a value makes float32 zeros: converted, it makes float64 ones of the model's
    type, which onnxruntime (the oracle) loads and runs to float64 as the engine does."""
    from onnxtrain.engine import compile_model
    from onnxtrain.testing import to_float64

    g = helper.make_graph([helper.make_node("Shape", ["x"], ["s"]),
                           helper.make_node("ConstantOfShape", ["s"], ["z"]),
                           helper.make_node("Add", ["x", "z"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", T.FLOAT, [3])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [3])])
    model = to_float64(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    x = np.array([1.0, 1 / 3, -2.5])
    cpu = ["CPUExecutionProvider"]
    want = ort.InferenceSession(model.SerializeToString(), providers=cpu).run(None, {"x": x})[0]
    got = compile_model(model).run({"x": x})[0]
    assert want.dtype == got.dtype == np.float64
    np.testing.assert_array_equal(got, x)
    np.testing.assert_array_equal(want, x)


# ---- Scan --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "in_dir, out_dir, in_axis, out_axis", [(0, 0, 0, 0), (1, 0, 1, 0), (0, 1, 1, -1), (1, 1, -1, 1)]
)
def test_scan_gradients(in_dir: int, out_dir: int, in_axis: int, out_axis: int) -> None:
    """A running product-sum over a scan axis (state ← state·scale + x_t, output state·v): gradients of the
    initial state, the scanned input and the outer values the body reads, over axes and directions,
    against central differences in float64, and the gradient graph run in onnxruntime."""
    d = T.DOUBLE
    node = scan_over_pairs(
        [
            helper.make_node("Mul", ["s_in", "scale"], ["ss"]),
            helper.make_node("Add", ["ss", "x_t"], ["s_out"]),
            helper.make_node("Mul", ["s_out", "v"], ["y_t"]),
        ],
        d,
        name="the_scan",
        scan_input_directions=[in_dir],
        scan_output_directions=[out_dir],
        scan_input_axes=[in_axis],
        scan_output_axes=[out_axis],
    )
    xs_shape = [4, 2] if in_axis == 0 else [2, 4]
    ys_shape = [4, 2] if out_axis == 0 else [2, 4]
    weights = numpy_helper.from_array(np.arange(8.0).reshape(ys_shape) / 7 - 0.5, "weights")
    nodes = [
        node,
        helper.make_node("Mul", ["ys", "weights"], ["wy"]),
        helper.make_node("ReduceSum", ["wy"], ["l1"], keepdims=0),
        helper.make_node("ReduceSum", ["s"], ["l2"], keepdims=0),
        helper.make_node("Add", ["l1", "l2"], ["loss"]),
    ]
    inits = [
        numpy_helper.from_array(np.array([0.9, -1.1]), "scale"),
        numpy_helper.from_array(np.array([1.5, 0.5]), "v"),
        weights,
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("s0", d, [2]), helper.make_tensor_value_info("xs", d, xs_shape)],
        [helper.make_tensor_value_info("loss", d, [])],
        inits,
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    rng = np.random.default_rng(3)
    feeds = {"s0": rng.standard_normal(2), "xs": rng.standard_normal(xs_shape)}
    _check_gradients(model, feeds, ["s0", "xs", "scale", "v"])


def _check_gradients(model: onnx.ModelProto, feeds: dict, names: list[str]) -> None:
    """The gradients of ``names`` against central differences in float64, and the gradient graph (checked
    in full) giving them in onnxruntime."""
    grads = gradcheck(model, "loss", names, feeds)
    gmodel = build_gradient_model(model, "loss", names)
    onnx.checker.check_model(gmodel, full_check=True)
    assert not _unread_constants(gmodel.graph)  # onnxruntime warns of each, removing it
    got = ort_outputs(gmodel, feeds)
    for n in names:
        np.testing.assert_allclose(got[f"{n}_grad"], grads[n], rtol=1e-10, atol=1e-12, err_msg=n)


def _unread_constants(graph: onnx.GraphProto) -> list[str]:
    """The Constant outputs and initializers of ``graph``'s bodies (nested too) that nothing reads."""
    unread: list[str] = []
    for body in (b for n in graph.node for b in subgraphs(n)):
        read = {r for n in body.node for r in node_reads(n)} | {o.name for o in body.output}
        made = [n.output[0] for n in body.node if n.op_type == "Constant"]
        made += [t.name for t in body.initializer]
        unread += [m for m in made if m not in read] + _unread_constants(body)
    return unread


def test_scan_gradient_with_untyped_body_inputs() -> None:
    """A body that declares neither its inputs' nor its outputs' types (as ONNX's LinearAttention body
    does): the state's type comes from its start, a scanned input's from the outer input without its scan
    axis, which the body's MatMul gradients need. Against central differences in float64 and onnxruntime."""
    d = T.DOUBLE

    def untyped(name: str) -> onnx.ValueInfoProto:
        return helper.make_value_info(name, onnx.TypeProto())

    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["s_in", "x_t"], ["sx"]),
            helper.make_node("Tanh", ["sx"], ["s_out"]),
            helper.make_node("MatMul", ["s_out", "w"], ["y_t"]),
        ],
        "body",
        [untyped("s_in"), untyped("x_t")],
        [untyped("s_out"), untyped("y_t")],
    )
    scan = helper.make_node("Scan", ["s0", "xs"], ["s", "ys"], num_scan_inputs=1, body=body,
                            scan_input_axes=[1])
    g = helper.make_graph(
        [
            scan,
            helper.make_node("ReduceSum", ["ys"], ["l1"], keepdims=0),
            helper.make_node("ReduceSum", ["s"], ["l2"], keepdims=0),
            helper.make_node("Add", ["l1", "l2"], ["loss"]),
        ],
        "g",
        [helper.make_tensor_value_info("s0", d, [2, 3]), helper.make_tensor_value_info("xs", d, [3, 4, 3])],
        [helper.make_tensor_value_info("loss", d, [])],
        [numpy_helper.from_array(np.linspace(-1, 1, 6).reshape(3, 2), "w")],
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    rng = np.random.default_rng(5)
    feeds = {"s0": rng.standard_normal((2, 3)), "xs": rng.standard_normal((3, 4, 3)) * 0.7}
    _check_gradients(model, feeds, ["s0", "xs", "w"])


# ---- sequences ---------------------------------------------------------------------------------------------
class ListRNN(nn.Module):
    """TorchScript's list pattern: a loop appends each new state to a list, then torch.stack."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.rec = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.size(1), 3)
        outs: list[torch.Tensor] = []
        for t in range(x.size(0)):
            h = torch.tanh(self.lin(x[t]) + self.rec(h))
            outs.append(h)
        y = torch.stack(outs)
        return (y * y).sum() + h.sum()


def test_list_append_loop_matches_torch() -> None:
    """The exported Loop carries a sequence it appends to (SequenceInsert), then ConcatFromSequence:
    all four parameters' gradients against torch autograd, over 1, 3 and 5 steps, also in onnxruntime."""
    torch.manual_seed(0)
    module = ListRNN()
    model = export_scripted(module, torch.randn(5, 2, 4))
    ops = {n.op_type for n in model.graph.node}
    assert {"Loop", "SequenceEmpty", "ConcatFromSequence"} <= ops
    names = [n for n, _ in module.named_parameters()]
    gmodel = build_gradient_model(model, "loss", names)
    onnx.checker.check_model(gmodel, full_check=True)
    gmodel.ir_version = 8
    for steps in (1, 3, 5):
        x = torch.randn(steps, 2, 4)
        got = engine_outputs(gmodel, {"x": x.numpy()})
        from_ort = ort_outputs(gmodel, {"x": x.numpy()})
        module.zero_grad()
        loss = module(x)
        loss.backward()
        np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5)
        for n, p in module.named_parameters():
            np.testing.assert_allclose(got[f"{n}_grad"], p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=n)
            np.testing.assert_allclose(from_ort[f"{n}_grad"], p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=n)


@pytest.mark.parametrize("new_axis", [0, 1])
def test_sequence_construct_and_concat_gradients(new_axis: int) -> None:
    """SequenceConstruct → ConcatFromSequence (a concatenation of elements of different sizes, or a
    stack), against central differences in float64."""
    d = T.DOUBLE
    b_shape = [4, 3] if not new_axis else [2, 3]
    nodes = [
        helper.make_node("SequenceConstruct", ["a", "b"], ["s"]),
        helper.make_node("ConcatFromSequence", ["s"], ["y"], axis=0, new_axis=new_axis),
        helper.make_node("Mul", ["y", "y"], ["yy"]),
        helper.make_node("ReduceSum", ["yy"], ["loss"], keepdims=0),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("a", d, [2, 3]), helper.make_tensor_value_info("b", d, b_shape)],
        [helper.make_tensor_value_info("loss", d, [])],
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(5)
    feeds = {"a": rng.standard_normal((2, 3)), "b": rng.standard_normal(b_shape)}
    grads = gradcheck(model, "loss", ["a", "b"], feeds)
    np.testing.assert_allclose(grads["b"], 2 * feeds["b"], rtol=1e-12)
    onnx.checker.check_model(build_gradient_model(model, "loss", ["a", "b"]), full_check=True)


@pytest.mark.parametrize("cond", [True, False])
def test_if_branch_not_reading_an_outer_sequence_gives_it_zeros(cond: bool) -> None:
    """An If whose then-branch concatenates an outer sequence and whose else-branch does not read it: the
    backward else-branch gives the sequence a sequence of zeros (it made a tensor with Shape of a sequence,
    which no runtime runs). Against central differences in float64, and in onnxruntime."""
    d = T.DOUBLE
    then_b = helper.make_graph([helper.make_node("ConcatFromSequence", ["seq"], ["t_out"], axis=0)], "then",
                               [], [helper.make_tensor_value_info("t_out", d, None)])
    else_b = helper.make_graph([helper.make_node("Sin", ["xw"], ["e_out"])], "else", [],
                               [helper.make_tensor_value_info("e_out", d, None)])
    nodes = [helper.make_node("Mul", ["x", "W"], ["xw"]),
             helper.make_node("SplitToSequence", ["xw"], ["seq"], axis=0),
             helper.make_node("If", ["c"], ["y"], then_branch=then_b, else_branch=else_b),
             helper.make_node("Mul", ["y", "y"], ["yy"]),
             helper.make_node("ReduceSum", ["yy"], ["loss"], keepdims=0)]
    rng = np.random.default_rng(1)
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", d, [4, 3]),
                                       helper.make_tensor_value_info("c", T.BOOL, [])],
                          [helper.make_tensor_value_info("loss", d, [])],
                          [numpy_helper.from_array(rng.standard_normal((4, 3)), "W")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": rng.standard_normal((4, 3)), "c": np.array(cond)}
    grads = gradcheck(model, "loss", ["W"], feeds)
    xw = feeds["x"] * numpy_helper.to_array(g.initializer[0])
    want = 2 * xw * feeds["x"] if cond else 2 * np.sin(xw) * np.cos(xw) * feeds["x"]
    np.testing.assert_allclose(grads["W"], want, rtol=1e-12)
    gmodel = build_gradient_model(model, "loss", ["W"])
    onnx.checker.check_model(gmodel, full_check=True)
    got = ort.InferenceSession(gmodel.SerializeToString()).run(["W_grad"], feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_a_loop_sequence_read_back_has_no_gradient() -> None:
    """A carried sequence the body reads (not only appends to) is a clear error naming the Loop."""
    d = T.DOUBLE
    seq = helper.make_tensor_sequence_value_info
    body = helper.make_graph(
        [
            helper.make_node("SequenceInsert", ["s_in", "w"], ["s_out"]),
            helper.make_node("SequenceLength", ["s_in"], ["len"]),
            helper.make_node("Identity", ["c"], ["c_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", T.INT64, []),
            helper.make_tensor_value_info("c", T.BOOL, []),
            seq("s_in", d, [2]),
        ],
        [helper.make_tensor_value_info("c_out", T.BOOL, []), seq("s_out", d, [2])],
    )
    nodes = [
        helper.make_node("SequenceEmpty", [], ["s0"], dtype=d),
        helper.make_node("Loop", ["n", "", "s0"], ["s"], name="the_loop", body=body),
        helper.make_node("ConcatFromSequence", ["s"], ["y"], axis=0, new_axis=1),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("n", T.INT64, [])],
        [helper.make_tensor_value_info("loss", d, [])],
        [numpy_helper.from_array(np.ones(2), "w")],
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(GradientError, match=r"the_loop.*Loop.*'s_in' has no gradient"):
        build_gradient_model(model, "loss", ["w"])


@pytest.mark.parametrize("position", [1, -1, None])
def test_sequence_ops_gradients(position: int | None) -> None:
    """SplitToSequence → SequenceAt (a negative position) and SequenceInsert (at a position, or appended)
    → ConcatFromSequence: the split sequence gets two gradient contributions, summed element by element.
    Against central differences in float64."""
    d = T.DOUBLE
    pos_in = ["p"] if position is not None else []
    nodes = [
        helper.make_node("SplitToSequence", ["x"], ["s"], axis=0),
        helper.make_node("SequenceAt", ["s", "last"], ["a"]),
        helper.make_node("SequenceInsert", ["s", "y", *pos_in], ["s2"]),
        helper.make_node("ConcatFromSequence", ["s2"], ["c"], axis=0),
        helper.make_node("Mul", ["c", "w"], ["cw"]),
        helper.make_node("Mul", ["a", "a"], ["aa"]),
        helper.make_node("ReduceSum", ["cw"], ["l1"], keepdims=0),
        helper.make_node("ReduceSum", ["aa"], ["l2"], keepdims=0),
        helper.make_node("Add", ["l1", "l2"], ["loss"]),
    ]
    inits = [
        numpy_helper.from_array(np.array(-1, np.int64), "last"),
        numpy_helper.from_array(np.arange(15.0).reshape(5, 3) / 7 - 1, "w"),
    ]
    if position is not None:
        inits.append(numpy_helper.from_array(np.array(position, np.int64), "p"))
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", d, [4, 3]), helper.make_tensor_value_info("y", d, [1, 3])],
        [helper.make_tensor_value_info("loss", d, [])],
        inits,
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(7)
    feeds = {"x": rng.standard_normal((4, 3)), "y": rng.standard_normal((1, 3))}
    grads = gradcheck(model, "loss", ["x", "y"], feeds)
    w = np.arange(15.0).reshape(5, 3) / 7 - 1
    row = {1: 1, -1: 3, None: 4}[position]  # where y lands in the concatenation
    np.testing.assert_allclose(grads["y"][0], w[row], rtol=1e-12)
    gmodel = build_gradient_model(model, "loss", ["x", "y"])
    onnx.checker.check_model(gmodel, full_check=True)
    gmodel.ir_version = 8
    got = ort_outputs(gmodel, feeds)
    for n in ("x", "y"):
        np.testing.assert_allclose(got[f"{n}_grad"], grads[n], rtol=1e-12, atol=1e-14, err_msg=n)


@pytest.mark.parametrize("position", [0, -2, None])
def test_sequence_erase_and_optional_gradients(position: int | None) -> None:
    """SequenceErase (the erased element gets no gradient) and an optional wrapped and unwrapped, against
    central differences in float64 and in onnxruntime."""
    d = T.DOUBLE
    pos_in = ["p"] if position is not None else []
    nodes = [
        helper.make_node("SplitToSequence", ["x"], ["s"], axis=0),
        helper.make_node("SequenceErase", ["s", *pos_in], ["s2"]),
        helper.make_node("ConcatFromSequence", ["s2"], ["c"], axis=0),
        helper.make_node("Optional", ["c"], ["o"]),
        helper.make_node("OptionalGetElement", ["o"], ["c2"]),
        helper.make_node("Mul", ["c2", "c2"], ["cc"]),
        helper.make_node("ReduceSum", ["cc"], ["loss"], keepdims=0),
    ]
    inits = [numpy_helper.from_array(np.array(position, np.int64), "p")] if position is not None else []
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", d, [4, 3])],
        [helper.make_tensor_value_info("loss", d, [])],
        inits,
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    x = np.random.default_rng(9).standard_normal((4, 3))
    grads = gradcheck(model, "loss", ["x"], {"x": x})
    want = 2 * x
    want[{0: 0, -2: 2, None: 3}[position]] = 0  # the erased row
    np.testing.assert_allclose(grads["x"], want, rtol=1e-12)
    gmodel = build_gradient_model(model, "loss", ["x"])
    onnx.checker.check_model(gmodel, full_check=True)
    got = ort_outputs(gmodel, {"x": x})
    np.testing.assert_allclose(got["x_grad"], want, rtol=1e-12)


def test_sequence_map_gradients() -> None:
    """SequenceMap over a sequence and a tensor, its body reading an outer value too: gradients of the
    split input, the tensor input and the outer value, against central differences and in onnxruntime."""
    d = T.DOUBLE
    body = helper.make_graph(
        [
            helper.make_node("Mul", ["e", "t"], ["et"]),
            helper.make_node("Mul", ["et", "w"], ["etw"]),
            helper.make_node("Tanh", ["etw"], ["out"]),
        ],
        "body",
        [helper.make_empty_tensor_value_info("e"), helper.make_empty_tensor_value_info("t")],
        [helper.make_empty_tensor_value_info("out")],
    )
    nodes = [
        helper.make_node("SplitToSequence", ["x"], ["s"], axis=0),
        helper.make_node("SequenceMap", ["s", "t"], ["m"], body=body),
        helper.make_node("ConcatFromSequence", ["m"], ["c"], axis=0),
        helper.make_node("Mul", ["c", "c"], ["cc"]),
        helper.make_node("ReduceSum", ["cc"], ["loss"], keepdims=0),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", d, [4, 3]), helper.make_tensor_value_info("t", d, [1, 3])],
        [helper.make_tensor_value_info("loss", d, [])],
        [numpy_helper.from_array(np.array([0.5, -1.0, 2.0]), "w")],
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    rng = np.random.default_rng(11)
    feeds = {"x": rng.standard_normal((4, 3)), "t": rng.standard_normal((1, 3))}
    grads = gradcheck(model, "loss", ["x", "t", "w"], feeds)
    gmodel = build_gradient_model(model, "loss", ["x", "t", "w"])
    onnx.checker.check_model(gmodel, full_check=True)
    got = ort_outputs(gmodel, feeds)
    for n in ("x", "t", "w"):
        np.testing.assert_allclose(got[f"{n}_grad"], grads[n], rtol=1e-12, atol=1e-14, err_msg=n)


def test_a_loop_body_reading_an_outer_sequence_is_an_error_naming_the_loop_and_sequence():
    """torch's export of repeat_interleave with dynamic shapes: the Loop's body indexes a sequence made
    outside it. Its gradient would be a sequence summed over the iterations, which the backward loop
    cannot hold; the error names the node and the sequence instead of writing an invalid graph."""
    import pytest
    from onnx import TensorProto, helper

    from onnxtrain.autodiff import GradientError, build_gradient_model

    body = helper.make_graph(
        [helper.make_node("SequenceAt", ["seq", "i"], ["row"]),
         helper.make_node("Mul", ["row", "row"], ["sq"]),
         helper.make_node("Identity", ["cond"], ["cond_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond", T.BOOL, [])],
        [helper.make_tensor_value_info("cond_out", T.BOOL, []),
         helper.make_tensor_value_info("sq", TensorProto.FLOAT, [4])])
    nodes = [helper.make_node("SplitToSequence", ["x"], ["seq"], axis=0, keepdims=0),
             helper.make_node("Constant", [], ["n"],
                              value=helper.make_tensor("n", TensorProto.INT64, [], [3])),
             helper.make_node("Constant", [], ["t"],
                              value=helper.make_tensor("t", T.BOOL, [], [True])),
             helper.make_node("Loop", ["n", "t"], ["rows"], name="the_loop", body=body),
             helper.make_node("ReduceSum", ["rows"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["a", 4])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(GradientError, match=r"'the_loop' \(Loop\).*outer sequence\(s\) \['seq'\]"):
        build_gradient_model(model, "loss", ["x"])


@pytest.mark.parametrize("start", [["c"], ["c", "d"]])
def test_an_appended_list_that_starts_with_values(start: list[str]) -> None:
    """TorchScript's ``outs = [h]`` before a loop that appends: the start's elements get the first elements
    of the final list's gradient (it was refused). Checked against float64 finite differences."""
    from onnxtrain.testing import gradcheck

    def vi(name: str, shape: list | None = None, t: int = T.DOUBLE) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, t, shape)

    body = helper.make_graph(
        [helper.make_node("Mul", ["hh", "a"], ["hm"]), helper.make_node("Sin", ["hm"], ["hn"]),
         helper.make_node("SequenceInsert", ["sq", "hn"], ["sqn"]),
         helper.make_node("Identity", ["cnd"], ["co"])],
        "b", [vi("i", [], T.INT64), vi("cnd", [], T.BOOL), vi("hh", [2]),
              helper.make_tensor_sequence_value_info("sq", T.DOUBLE, None)],
        [vi("co", [], T.BOOL), vi("hn", [2]), helper.make_tensor_sequence_value_info("sqn", T.DOUBLE, None)])
    g = helper.make_graph(
        [helper.make_node("SequenceConstruct", start, ["s0"]),
         helper.make_node("Constant", [], ["M"], value=helper.make_tensor("Mv", T.INT64, [], [3])),
         helper.make_node("Loop", ["M", "", "c", "s0"], ["hf", "sf"], body=body),
         helper.make_node("ConcatFromSequence", ["sf"], ["cs"], axis=0),
         helper.make_node("Mul", ["cs", "cs"], ["sq2"]),
         helper.make_node("ReduceSum", ["sq2"], ["L"], keepdims=0)],
        "g", [vi("a", [2]), vi("c", [2]), vi("d", [2])], [vi("L", [])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(m, full_check=True)
    feeds = {"a": np.array([0.7, -1.2]), "c": np.array([0.3, 0.9]), "d": np.array([-0.4, 0.5])}
    gradcheck(m, "L", ["a", *start], feeds)


def test_an_outer_optional_read_by_a_body_is_refused_by_name() -> None:
    """An If branch reading an outer optional value (the other branch not): the gradient graph took the
    Shape of the optional (onnx.checker, onnxruntime and the engine refused it); now an error naming the
    node and the value, as for an outer sequence read by a loop body."""
    vi = helper.make_tensor_value_info
    then_g = helper.make_graph([helper.make_node("OptionalGetElement", ["opt"], ["v"]),
                                helper.make_node("Mul", ["v", "W"], ["vw"])], "t", [],
                               [vi("vw", T.DOUBLE, [3])])
    else_g = helper.make_graph([helper.make_node("Identity", ["W"], ["wi"])], "e", [],
                               [vi("wi", T.DOUBLE, [3])])
    nodes = [helper.make_node("Optional", ["x"], ["opt"]),
             helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g, name="branch"),
             helper.make_node("ReduceSumSquare", ["y"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [vi("c", T.BOOL, []), vi("x", T.DOUBLE, [3])],
                          [vi("loss", T.DOUBLE, [])],
                          [numpy_helper.from_array(np.array([0.5, -1.0, 2.0]), "W")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    with pytest.raises(GradientError, match=r"node 'branch' \(If\): the If's body reads outer optional "
                                            r"value\(s\) \['opt'\]"):
        build_gradient_model(model, "loss", ["W", "x"])
    onnx.checker.check_model(build_gradient_model(model, "loss", ["W"]), full_check=True)  # W alone: fine


class SplitAtIndices(nn.Module):
    """``torch.tensor_split`` at run-time indices: the TorchScript exporter writes a Loop whose body declares
    its iteration number of shape [1] (ONNX's is a scalar; onnxruntime then gives it that rank) and slices x
    at bounds gathered with it."""

    def forward(self, x: torch.Tensor, cuts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.tensor_split(x, cuts, dim=1)


def test_loop_whose_body_declares_a_1d_iteration_number() -> None:
    """The forward Loop's stash of the iteration number keeps the body's declared shape, and the backward
    body binds the iteration number in that shape: the gradient graph passes the full check (it failed:
    rank 1 inferred against the stash's declared scalar) and gives torch's gradients on both runtimes."""
    x = torch.randn(3, 7, 2, dtype=torch.float64)
    cuts = torch.tensor([1, 3, 6])
    buffer = io.BytesIO()
    torch.onnx.export(SplitAtIndices(), (x, cuts), buffer, dynamo=False, opset_version=17,
                      input_names=["x", "cuts"], output_names=[f"y{i}" for i in range(4)])
    model = onnx.load_from_string(buffer.getvalue())
    loop = next(n for n in model.graph.node if n.op_type == "Loop")
    assert len(loop.attribute[0].g.input[0].type.tensor_type.shape.dim) == 1  # the export's declaration
    rng = np.random.default_rng(5)
    pieces = torch.tensor_split(x, cuts, dim=1)
    weights = [rng.uniform(0.5, 1.5, p.shape) for p in pieces]
    for i, w in enumerate(weights):
        model.graph.initializer.append(numpy_helper.from_array(w, f"w{i}"))
        model.graph.node.extend([helper.make_node("Mul", [f"y{i}", f"w{i}"], [f"p{i}"]),
                                 helper.make_node("ReduceSum", [f"p{i}"], [f"s{i}"], keepdims=0)])
    model.graph.node.append(helper.make_node("Sum", [f"s{i}" for i in range(4)], ["loss"]))
    model.graph.output.append(helper.make_tensor_value_info("loss", T.DOUBLE, []))
    gmodel = build_gradient_model(model, "loss", ["x"])
    onnx.checker.check_model(gmodel, full_check=True)
    xt = x.clone().requires_grad_(True)
    loss = sum((p * torch.from_numpy(w)).sum() for p, w in zip(torch.tensor_split(xt, cuts, dim=1), weights))
    (want,) = torch.autograd.grad(loss, [xt])
    feeds = {"x": x.numpy(), "cuts": cuts.numpy()}
    for got in (engine_outputs(gmodel, feeds), ort_outputs(gmodel, feeds)):
        np.testing.assert_allclose(got["x_grad"], want.numpy(), rtol=1e-12, atol=1e-12)
