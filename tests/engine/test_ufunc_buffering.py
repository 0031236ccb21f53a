"""numpy's ufunc buffer kept out of row broadcasts (onnxtrain/engine/kernels/buffering.py): the runs, the
thresholds, the same bits as numpy's buffered calls, and the buffer size given back."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

from onnxtrain.engine.kernels import buffering
from onnxtrain.engine.plan import Plan

F, I64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64


@pytest.mark.parametrize(("shapes", "result", "run"), [
    (((1024, 1000), (1024, 1)), (1024, 1000), 1000),  # a per-row column
    (((512, 768), (768,)), (512, 768), 768),  # a per-column vector
    (((32, 16, 32, 32), (1, 16, 1, 1)), (32, 16, 32, 32), 1024),  # per channel: one plane
    (((8, 1, 5), (8, 4, 5)), (8, 4, 5), 5),
    (((4, 3, 1000), (4, 1, 1)), (4, 3, 1000), 3000),  # the column spans the last two axes
    (((4, 3, 1000), (4, 3, 1000)), (4, 3, 1000), 0),  # nothing broadcast
    (((4, 3, 1000), ()), (4, 3, 1000), 0),  # a scalar: one run over everything
    (((7, 1, 900), (7, 1, 1)), (7, 1, 900), 900),  # unit axes skipped
])
def test_broadcast_run(shapes: tuple, result: tuple, run: int) -> None:
    assert buffering.broadcast_run(shapes, result) == run


def test_run_size_thresholds() -> None:
    big = buffering.MIN_VALUES
    assert buffering.run_size(buffering.MIN_RUN - 1, big) == 0
    assert buffering.run_size(buffering.MIN_RUN, big) == buffering.MIN_RUN
    assert buffering.run_size(1000, big) == 992  # a multiple of 16, at most one run
    assert buffering.run_size(buffering.MAX_RUN, big) == buffering.MAX_RUN
    assert buffering.run_size(buffering.MAX_RUN + 1, big) == 0
    assert buffering.run_size(1000, big - 1) == 0


def _model(nodes: list, inputs: list[tuple[str, int, list[int]]],
           outputs: list[tuple[str, list[int]]]) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "buffering",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, F, s) for n, s in outputs])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(m, full_check=True)
    return m


def _cases(rng: np.random.Generator) -> list[tuple[onnx.ModelProto, dict[str, np.ndarray]]]:
    cases = []
    for op in ("Add", "Sub", "Mul", "Div"):
        for a, c in (((1024, 1000), (1024, 1)), ((512, 768), (768,)), ((1024, 128), (128,))):
            # alone (the op's kernel) and as a cluster of two (the fused program)
            m = _model([helper.make_node(op, ["a", "c"], ["o"]),
                        helper.make_node(op, ["a", "c"], ["t"]), helper.make_node("Mul", ["t", "c"], ["u"])],
                       [("a", F, list(a)), ("c", F, list(c))], [("o", list(a)), ("u", list(a))])
            cases.append((m, {"a": rng.standard_normal(a).astype(np.float32),
                              "c": rng.uniform(0.5, 2.0, c).astype(np.float32)}))
    ln = _model([helper.make_node("LayerNormalization", ["x", "s", "b"], ["y", "mean", "inv"], axis=-1)],
                [("x", F, [640, 768]), ("s", F, [768]), ("b", F, [768])],
                [("y", [640, 768]), ("mean", [640, 1]), ("inv", [640, 1])])
    cases.append((ln, {"x": rng.standard_normal((640, 768)).astype(np.float32) * 3 + 1,
                       "s": rng.standard_normal(768).astype(np.float32),
                       "b": rng.standard_normal(768).astype(np.float32)}))
    sce = _model([helper.make_node("SoftmaxCrossEntropyLoss", ["x", "y"], ["loss", "logp"])],
                 [("x", F, [1024, 1000]), ("y", I64, [1024])], [("loss", []), ("logp", [1024, 1000])])
    cases.append((sce, {"x": rng.standard_normal((1024, 1000)).astype(np.float32) * 4,
                        "y": rng.integers(0, 1000, 1024).astype(np.int64)}))
    return cases


def test_row_broadcasts_give_numpys_buffered_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    cases = _cases(rng)
    sizes: list[int] = []
    set_size = np.setbufsize

    def recording(size: int) -> int:
        sizes.append(size)
        return set_size(size)

    monkeypatch.setattr(np, "setbufsize", recording)
    default = np.getbufsize()
    got = [[r.copy() for r in Plan(m).run(f)] for m, f in cases]
    assert np.getbufsize() == default  # given back
    assert 992 in sizes and 768 in sizes  # the runs of 1,000 and 768 values went unbuffered
    assert not {s for s in sizes if s != default} - {992, 768}  # and nothing else (128: through the buffer)
    monkeypatch.setattr(buffering, "MIN_RUN", 1 << 30)  # numpy's own buffering everywhere
    sizes.clear()
    for (m, f), mine in zip(cases, got):
        want = Plan(m).run(f)
        for a, b in zip(mine, want):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
        for a, b in zip(mine, ReferenceEvaluator(m).run(None, f)):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
    assert not sizes


def test_buffer_size_given_back_after_an_error() -> None:
    default = np.getbufsize()

    def fails(*args: object, **kwargs: object) -> None:
        assert np.getbufsize() == 992
        raise FloatingPointError("raised inside")

    with pytest.raises(FloatingPointError, match="raised inside"):
        buffering.UnbufferedUfunc(fails, 992)(np.ones(3))
    assert np.getbufsize() == default


@pytest.mark.parametrize(("big", "small", "cut"), [
    ((400, 383), (400, 1), set()),  # one value under the run limit: left to numpy's buffer
    ((400, 384), (400, 1), {384}),
    ((40, 4096), (40, 1), {4096}),  # the longest run cut
    ((40, 4097), (40, 1), set()),  # longer: numpy walks it in place by itself
    ((100, 3, 500), (100, 3, 1), {496}),
    ((100, 3, 500), (3, 500), {1488}),  # a (C, L) block repeated over the batch: one run of 1,500
    # per channel over planes of 500: Div as it is; the cluster's ops after spreading the operand over the
    # planes (spread.py), which makes one run of 6 · 500
    ((50, 6, 20, 25), (1, 6, 1, 1), {496, 2992}),
    ((2, 300, 700), (300, 1), {688}),
    ((300, 400), (300, 1), set()),  # 120,000 values: too few to pay for the switch
])
def test_ops_and_clusters_near_the_limits_give_numpys_bits(big: tuple, small: tuple, cut: set[int],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    a = rng.standard_normal(big).astype(np.float32)
    c = rng.uniform(0.5, 2.0, small).astype(np.float32)
    m = _model([helper.make_node("Div", ["a", "c"], ["o"]),
                helper.make_node("Sub", ["a", "c"], ["t"]), helper.make_node("Mul", ["t", "c"], ["u"])],
               [("a", F, list(big)), ("c", F, list(small))], [("o", list(big)), ("u", list(big))])
    sizes: list[int] = []
    set_size = np.setbufsize

    def recording(size: int) -> int:
        sizes.append(size)
        return set_size(size)

    default = np.getbufsize()
    monkeypatch.setattr(np, "setbufsize", recording)
    o, u = Plan(m).run({"a": a, "c": c})
    assert o.tobytes() == np.divide(a, c).tobytes()
    assert u.tobytes() == np.multiply(np.subtract(a, c), c).tobytes()
    assert np.getbufsize() == default
    assert set(sizes) - {default} == cut
