"""An elementwise cluster over large arrays traces its first run on a slice of two entries of the longest
axis, then computes the whole with its program: the same bits as the unfused kernels from the first run on,
and a first optimizer update that writes into its donated arrays instead of holding new ones beside them."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import onnxtrain.engine.fusion.elementwise as fe
from onnxtrain.engine.plan import Plan
from tests.engine.graphs import model
from tests.engine.test_donation import momentum_model


def _broadcast_model():
    """Over x (300, 1000): rows scaled by v (1, 1000), a column c (300, 1) added, cast to float64, squared by
    Pow, its square root, halved; and c·3 (which never meets the long axis), and x passed through Identity
    then Neg."""
    consts = [helper.make_node("Constant", [], ["two"], value=helper.make_tensor("", TensorProto.DOUBLE, [],
                                                                                  [2.0])),
              helper.make_node("Constant", [], ["half"], value_float=0.5),
              helper.make_node("Constant", [], ["three"], value_float=3.0)]
    nodes = consts + [
        helper.make_node("Mul", ["x", "v"], ["a"]),
        helper.make_node("Add", ["a", "c"], ["b"]),
        helper.make_node("Cast", ["b"], ["b64"], to=TensorProto.DOUBLE),
        helper.make_node("Pow", ["b64", "two"], ["sq"]),
        helper.make_node("Sqrt", ["sq"], ["r"]),
        helper.make_node("Cast", ["r"], ["r32"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["r32", "half"], ["y"]),
        helper.make_node("Mul", ["c", "three"], ["c3"]),
        helper.make_node("Identity", ["x"], ["xi"]),
        helper.make_node("Neg", ["xi"], ["nx"]),
    ]
    return model(nodes, ["x", "v", "c"], ["y", "b", "c3", "nx", "sq"],
                 output_types={"sq": TensorProto.DOUBLE})


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((300, 1000)).astype(np.float32),
            "v": rng.standard_normal((1, 1000)).astype(np.float32),
            "c": rng.standard_normal((300, 1)).astype(np.float32)}


@pytest.fixture
def traced(monkeypatch) -> list[list[tuple]]:
    """The shapes of the inputs of every traced run of a cluster (a spy on ``Cluster._traced_run``)."""
    shapes: list[list[tuple]] = []
    original = fe.Cluster._traced_run

    def spy(self, inputs, last):
        shapes.append([np.shape(a) for a in inputs])
        return original(self, inputs, last)

    monkeypatch.setattr(fe.Cluster, "_traced_run", spy)
    return shapes


def test_the_first_run_traces_a_slice_and_gives_the_unfused_bits(traced) -> None:
    m = _broadcast_model()
    f = _feeds()
    want = Plan(m, fuse=False).run(f)
    plan = Plan(m)
    first = plan.run(f)
    assert traced and all((300, 2) in shapes for shapes in traced)  # the long axis (1) cut to two entries
    assert all((1, 2) in shapes and (300, 1) in shapes for shapes in traced if len(shapes) == 3)
    second = plan.run(f)
    for a, b, w in zip(first, second, want):
        assert a.shape == w.shape and a.dtype == w.dtype
        np.testing.assert_array_equal(a, w)
        np.testing.assert_array_equal(b, w)
    for a, r in zip(first, ReferenceEvaluator(m).run(None, f)):
        np.testing.assert_allclose(a, r, rtol=1e-6, atol=1e-6)


def test_small_clusters_trace_whole(monkeypatch) -> None:
    monkeypatch.setattr(fe, "TRACE_SLICE_MIN", 10 ** 9)
    m = _broadcast_model()
    f = _feeds()
    for a, w in zip(Plan(m).run(f), Plan(m, fuse=False).run(f)):
        np.testing.assert_array_equal(a, w)


def test_a_first_donated_update_allocates_no_whole_array() -> None:
    """The momentum update over 4 M values (16 MiB an array): its first run writes W' and M' into the donated
    W and M, and allocates less than one array (a traced first run held two new ones, 32 MiB)."""
    n = 1 << 22
    rng = np.random.default_rng(1)
    f = {k: rng.standard_normal(n).astype(np.float32) for k in ("W", "M", "G")}
    m = momentum_model()
    want = Plan(m, fuse=False).run(f)
    plan = Plan(m)
    given = {k: v.copy() for k, v in f.items()}
    tracemalloc.start()
    try:
        out = plan.run(given, donate=["W", "M"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out[0] is given["W"] and out[1] is given["M"]
    np.testing.assert_array_equal(out[0], want[0])
    np.testing.assert_array_equal(out[1], want[1])
    assert peak < n * 4, peak


def _two_weight_momentum_model():
    """M_i' = 0.9·M_i + 0.1·G_i, W_i' = W_i − lr·M_i' for two weights of shapes that do not broadcast
    together, one cluster through the learning rate they share, scaled in the cluster (as the bias
    correction of an on-device optimizer's update)."""
    consts = (("a", 0.9), ("b", 0.1), ("k", 2.0))
    c = [helper.make_node("Constant", [], [n], value_float=v) for n, v in consts]
    nodes = [*c, helper.make_node("Mul", ["lr", "k"], ["lr2"])]
    for i in (1, 2):
        nodes += [
            helper.make_node("Mul", [f"M{i}", "a"], [f"ma{i}"]),
            helper.make_node("Mul", [f"G{i}", "b"], [f"gb{i}"]),
            helper.make_node("Add", [f"ma{i}", f"gb{i}"], [f"M{i}_new"]),
            helper.make_node("Mul", [f"M{i}_new", "lr2"], [f"step{i}"]),
            helper.make_node("Sub", [f"W{i}", f"step{i}"], [f"W{i}_new"]),
        ]
    return model(nodes, ["W1", "M1", "G1", "W2", "M2", "G2", "lr"], ["W1_new", "M1_new", "W2_new", "M2_new"])


def test_a_first_update_of_weights_of_several_shapes_allocates_no_whole_array(traced) -> None:
    """Weights [2048, 512] and [512, 10] in one cluster: their shapes do not broadcast together, so the first
    run traced the whole arrays and held new weights and moments beside the donated ones (an on-device
    AdamW step over a 2048² and a 2048 × 10 weight: +80 MiB, 5 weights' worth). It traces every input cut
    to its corner now: the same bits as unfused, written into the donated arrays, with less than one
    array allocated."""
    rng = np.random.default_rng(2)
    shapes = {"1": (2048, 512), "2": (512, 10)}
    f = {f"{k}{i}": rng.standard_normal(shp).astype(np.float32) for i, shp in shapes.items() for k in "WMG"}
    f["lr"] = np.array(0.01, np.float32)
    m = _two_weight_momentum_model()
    want = Plan(m, fuse=False).run(f)
    plan = Plan(m)
    given = {k: v.copy() for k, v in f.items()}
    tracemalloc.start()
    try:
        out = plan.run(given, donate=["W1", "M1", "W2", "M2"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(traced) == 1 and max(max(s, default=1) for s in traced[0]) <= 2, traced  # one cluster
    assert out[0] is given["W1"] and out[1] is given["M1"]
    for a, w in zip(out, want):
        np.testing.assert_array_equal(a, w)
    for a, w in zip(plan.run({k: v.copy() for k, v in f.items()}), want):
        np.testing.assert_array_equal(a, w)
    assert peak < 2048 * 512 * 4, peak


_UNARY = ["Neg", "Abs", "Exp", "Tanh", "Relu", "Erf", "Identity", "Sqrt", "Log", "Reciprocal"]
_BINARY = ["Add", "Sub", "Mul", "Div", "Pow"]


def _random_cluster(seed: int):
    """A random chain of elementwise ops over inputs that broadcast to a shape of 64 K values or more
    (some with a size-1 axis, some of lower rank), with two outputs; Sqrt, Log and Reciprocal take an Abs
    plus one first, Pow an exponent input near 1; a Cast to float64 and back sits in the chain at random."""
    rng = np.random.default_rng(seed)
    rank = int(rng.integers(2, 5))
    shape = [int(rng.integers(2, 9)) for _ in range(rank)]
    shape[int(rng.integers(rank))] = int(rng.integers(600, 3000))  # the long axis, anywhere
    while int(np.prod(shape)) < fe.TRACE_SLICE_MIN:
        shape[0] *= 2
    feeds, names = {}, []
    for i in range(int(rng.integers(2, 5))):
        s = list(shape)
        kind = rng.integers(3)
        if kind == 1:  # a size-1 axis (broadcast along it), never all of them
            s[int(rng.integers(rank))] = 1
        elif kind == 2:  # lower rank: the trailing axes
            s = s[int(rng.integers(1, rank)):]
        name = f"in{i}"
        feeds[name] = rng.standard_normal(s).astype(np.float32)
        names.append(name)
    feeds[names[0]] = rng.standard_normal(shape).astype(np.float32)  # one of the whole shape
    feeds["p"] = rng.uniform(0.5, 1.5, (1,)).astype(np.float32)
    nodes, cur, k = [], names[0], 0

    def new() -> str:
        nonlocal k
        k += 1
        return f"v{k}"

    one = helper.make_node("Constant", [], ["one"], value_float=1.0)
    nodes.append(one)
    outs = []
    for _ in range(int(rng.integers(4, 10))):
        if rng.random() < 0.5:
            op = str(rng.choice(_UNARY))
            src = cur
            if op in ("Sqrt", "Log", "Reciprocal"):
                a, b = new(), new()
                nodes += [helper.make_node("Abs", [cur], [a]), helper.make_node("Add", [a, "one"], [b])]
                src = b
            if op == "Exp":
                t = new()
                nodes.append(helper.make_node("Tanh", [cur], [t]))
                src = t
            out = new()
            nodes.append(helper.make_node(op, [src], [out]))
        else:
            op = str(rng.choice(_BINARY))
            other = "p" if op == "Pow" else str(rng.choice(names))
            src = cur
            if op in ("Pow", "Div"):
                a, b = new(), new()
                nodes += [helper.make_node("Abs", [cur], [a]), helper.make_node("Add", [a, "one"], [b])]
                src = b
            out = new()
            args = [src, other] if op in ("Pow", "Div") or rng.random() < 0.5 else [other, src]
            if op == "Div" and args[1] != src:
                args = [other, src]
            nodes.append(helper.make_node(op, args, [out]))
        if rng.random() < 0.2:
            a, b = new(), new()
            nodes += [helper.make_node("Cast", [out], [a], to=TensorProto.DOUBLE),
                      helper.make_node("Cast", [a], [b], to=TensorProto.FLOAT)]
            out = b
        if rng.random() < 0.3:
            outs.append(out)
        cur = out
    outs = list(dict.fromkeys([*outs, cur]))
    return model(nodes, [*names, "p"], outs), feeds


@pytest.mark.parametrize("seed", range(12))
def test_random_clusters_first_run_gives_the_unfused_bits(seed) -> None:
    m, f = _random_cluster(seed)
    want = Plan(m, fuse=False).run(f)
    plan = Plan(m)
    first = plan.run(f)
    second = plan.run(f)
    for a, b, w in zip(first, second, want):
        assert a.shape == w.shape and a.dtype == w.dtype
        np.testing.assert_array_equal(a, w)
        np.testing.assert_array_equal(b, w)
