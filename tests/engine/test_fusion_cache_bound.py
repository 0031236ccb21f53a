"""An elementwise cluster keeps programs for at most ``MAX_PROGRAMS`` input signatures: a session run over
many distinct shapes (every (batch, seq) of a data set) levels off in memory instead of keeping one program
per shape, and a signature whose program was dropped is traced again and gives the same values."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest
from onnx import TensorProto, checker, helper
from onnx.reference import ReferenceEvaluator

import onnxtrain
import onnxtrain.engine.fusion.elementwise as fe


def _chain_model():
    """y = tanh((x + b) · x) − exp(−|b|) / 2 over x (N, T) and a row b (T): one elementwise cluster."""
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("Add", ["x", "b"], ["s"]),
        helper.make_node("Mul", ["s", "x"], ["p"]),
        helper.make_node("Tanh", ["p"], ["t"]),
        helper.make_node("Abs", ["b"], ["a"]),
        helper.make_node("Neg", ["a"], ["na"]),
        helper.make_node("Exp", ["na"], ["e"]),
        helper.make_node("Mul", ["e", "half"], ["eh"]),
        helper.make_node("Sub", ["t", "eh"], ["y"]),
    ]
    g = helper.make_graph(
        nodes, "chain",
        [helper.make_tensor_value_info("x", f, ["N", "T"]), helper.make_tensor_value_info("b", f, ["T"])],
        [helper.make_tensor_value_info("y", f, ["N", "T"])],
        [helper.make_tensor("half", f, [], [0.5])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    checker.check_model(m, full_check=True)
    return m


def _feeds(shape: tuple[int, int], rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"x": rng.standard_normal(shape).astype(np.float32),
            "b": rng.standard_normal(shape[1]).astype(np.float32)}


def _session():
    """The numpy engine's session of the chain model and its one cluster."""
    sess = onnxtrain.InferenceSession(_chain_model().SerializeToString())
    clusters = [st.fn for st in sess._plan.steps if isinstance(st.fn, fe.Cluster)]
    assert len(clusters) == 1
    return sess, clusters[0]


def _shapes(n: int, seed: int) -> list[tuple[int, int]]:
    shapes = [(b, t) for b in range(1, 41) for t in range(1, 41)]
    np.random.default_rng(seed).shuffle(shapes)
    return shapes[:n]


@pytest.fixture
def traces(monkeypatch) -> list[tuple]:
    """The input shapes of every cluster trace run while the test runs."""
    seen: list[tuple] = []
    original = fe.Cluster._traced_run

    def spy(self, inputs, last):
        seen.append(tuple(np.shape(a) for a in inputs))
        return original(self, inputs, last)

    monkeypatch.setattr(fe.Cluster, "_traced_run", spy)
    return seen


def test_programs_stay_bounded_and_evicted_shapes_give_the_reference_values(traces: list[tuple]) -> None:
    sess, cluster = _session()
    ref = ReferenceEvaluator(_chain_model())
    rng = np.random.default_rng(1)
    bound = fe.MAX_PROGRAMS
    shapes = _shapes(3 * bound, seed=2)

    def check(shape: tuple[int, int]) -> None:
        feeds = _feeds(shape, rng)
        (want,) = ref.run(None, feeds)
        for _ in range(2):  # the second visit runs the compiled program
            (got,) = sess.run(None, feeds)
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)

    for shape in shapes:
        check(shape)
        assert len(cluster.programs) <= bound
    assert len(cluster.programs) == bound
    # the first shapes were dropped long ago, the last ones are still held: both give the reference values
    for shape in shapes[:8] + shapes[-8:]:
        check(shape)
    assert len(cluster.programs) <= bound
    # a fixed-shape loop traces once and then keeps its one program
    hot = (37, 39)
    before = len(traces)
    for _ in range(5):
        check(hot)
    assert len(traces) == before + 1
    prog = next(p for sig, p in cluster.programs.items() if sig[0][0] == hot)
    check(hot)
    assert next(p for sig, p in cluster.programs.items() if sig[0][0] == hot) is prog


@pytest.mark.parametrize("n", [500])
def test_memory_levels_off_over_many_distinct_shapes(n: int) -> None:
    sess, cluster = _session()
    rng = np.random.default_rng(3)
    sess.run(None, _feeds((40, 40), rng))  # the largest shape first: the scratch pool is full size from here
    shapes = _shapes(2 * n, seed=4)
    feeds = [_feeds(s, rng) for s in shapes]

    def run(part: list[dict[str, np.ndarray]]) -> None:
        for f in part:
            sess.run(None, f)
            sess.run(None, f)  # a program is compiled on a shape's second visit

    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        run(feeds[:n])
        gc.collect()
        first = tracemalloc.get_traced_memory()[0] - base
        run(feeds[n:])
        gc.collect()
        second = tracemalloc.get_traced_memory()[0] - base - first
    finally:
        tracemalloc.stop()
    assert first > 0
    assert second < 0.1 * first, (first, second)
    assert len(cluster.programs) <= fe.MAX_PROGRAMS


def test_a_cycle_through_more_shapes_than_the_bound_does_not_trace_each_visit(monkeypatch,
                                                                              traces: list[tuple]) -> None:
    """Past the bound, a new shape runs unfused until it has come back PROMOTE_AFTER times (a cycle of 12
    shapes over 8 programs traced on every visit once the oldest were dropped first: 96 traces in 8
    cycles); values stay the reference's."""
    monkeypatch.setattr(fe, "MAX_PROGRAMS", 8)
    sess, cluster = _session()
    ref = ReferenceEvaluator(_chain_model())
    rng = np.random.default_rng(5)
    shapes = _shapes(12, seed=6)
    for _ in range(8):
        for shape in shapes:
            feeds = _feeds(shape, rng)
            (got,) = sess.run(None, feeds)
            np.testing.assert_allclose(got, ref.run(None, feeds)[0], rtol=1e-6, atol=1e-6)
    assert len(cluster.programs) <= 8
    assert len(traces) <= 8 + 4 * 8 // fe.PROMOTE_AFTER * 3, len(traces)
