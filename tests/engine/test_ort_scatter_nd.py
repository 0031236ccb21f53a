"""Combining ScatterNDs whose index tuples hold several indices (a GatherND's gradient, e.g. torch's
``x[i, j]`` advanced indexing) on the onnxruntime backend.

onnxruntime 1.32's CPU ScatterND with a reduction combines updates from several intra-op threads without a
lock. With tuples of two indices (a [30, 20, 64] table, 4096 tuples of 600 distinct values, updates of 64,
2 threads) 84 to 181 of 300 plain onnxruntime runs (by the machine's load) came out off the float64 sum,
by up to 5.0 where the sum reaches 12.7. The backend computes such scatters as ScatterNDs over pieces of
the tuples too small to be split (:mod:`onnxtrain.engine.ort_scatter_nd`); through the backend, without
that rewrite, 1 to 4 of 100 runs lost updates (its sessions race less often), hence 200 runs a test. The
oracles: ``np.add.at`` in float32 (it adds the updates in index order, as a serial scatter does: bit for
bit) and in float64 (the exact sum, within rounding), and onnxruntime's own ScatterND for the errors of
tuples out of range.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

DATA = (30, 20, 64)


def _options(backend: str, threads: int = 0) -> Any:
    from onnxtrain import SessionOptions

    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", backend)
    if threads:
        so.intra_op_num_threads = threads
    return so


def _tuple_scatter(n: int | str, elem: int, data: tuple[int, ...] = DATA, k: int = 2) -> onnx.ModelProto:
    node = helper.make_node("ScatterND", ["data", "indices", "updates"], ["out"], reduction="add")
    graph = helper.make_graph(
        [node], "scatter",
        [helper.make_tensor_value_info("data", elem, list(data)),
         helper.make_tensor_value_info("indices", T.INT64, [n, k]),
         helper.make_tensor_value_info("updates", elem, [n, *data[k:]])],
        [helper.make_tensor_value_info("out", elem, list(data))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def loop_scatter_model(data: tuple[int, ...], k: int) -> onnx.ModelProto:
    """A Loop of two iterations whose body adds the updates into its carried ``data`` with a ScatterND of
    ``k`` indices per tuple; the body declares no type for the carried value (its type unknown there)."""
    body = helper.make_graph(
        [helper.make_node("ScatterND", ["acc_in", "indices", "updates"], ["acc_out"], reduction="add"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
        [helper.make_tensor_value_info("i", T.INT64, []),
         helper.make_tensor_value_info("cond_in", T.BOOL, []),
         helper.make_tensor_value_info("acc_in", T.FLOAT, None)],
        [helper.make_tensor_value_info("cond_out", T.BOOL, []),
         helper.make_tensor_value_info("acc_out", T.FLOAT, None)])
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["n"], value=numpy_helper.from_array(np.array(2, np.int64))),
         helper.make_node("Constant", [], ["go"], value=numpy_helper.from_array(np.array(True))),
         helper.make_node("Loop", ["n", "go", "data"], ["out"], body=body)], "loop",
        [helper.make_tensor_value_info("data", T.FLOAT, list(data)),
         helper.make_tensor_value_info("indices", T.INT64, ["n", k]),
         helper.make_tensor_value_info("updates", T.FLOAT, ["n", *data[k:]])],
        [helper.make_tensor_value_info("out", T.FLOAT, list(data))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _feeds(dtype: type, n: int = 4096, data: tuple[int, ...] = DATA, k: int = 2,
           seed: int = 7) -> dict[str, np.ndarray]:
    """Tuples drawn from every in-range value, negative ones included (many repeats)."""
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.integers(-d, d, n) for d in data[:k]], axis=1)
    return {"data": rng.standard_normal(data).astype(dtype), "indices": idx,
            "updates": rng.standard_normal((n, *data[k:])).astype(dtype)}


def _add_at(feeds: dict[str, np.ndarray], dtype: type, times: int = 1) -> np.ndarray:
    """``data`` plus each update at its tuple, in index order, in ``dtype``."""
    out = feeds["data"].astype(dtype)
    where = tuple(feeds["indices"].T)
    for _ in range(times):
        np.add.at(out, where, feeds["updates"].astype(dtype))
    return out


@pytest.mark.parametrize("n", [4096, "n"], ids=["static", "runtime"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_tuple_scatter_keeps_every_update(n, dtype) -> None:
    """Every run gives the serial sum's bits (float32 ``np.add.at``; float16 data is combined in float32 and
    rounded once), within rounding of the float64 sum; float32 also the numpy engine's bits."""
    from onnxtrain import InferenceSession

    model = _tuple_scatter(n, helper.np_dtype_to_tensor_dtype(np.dtype(dtype))).SerializeToString()
    feeds = _feeds(dtype)
    want = _add_at(feeds, np.float32).astype(dtype)
    exact = _add_at(feeds, np.float64)
    sess = InferenceSession(model, _options("onnxruntime", threads=2))
    for _ in range(200):  # the race lost updates in 1 to 60 % of the runs, depending on the load
        out = sess.run(None, feeds)[0]
        assert out.dtype == dtype
        assert out.tobytes() == want.tobytes()
    np.testing.assert_allclose(want.astype(np.float64), exact,
                               atol=1e-4 if dtype == np.float32 else 2e-2 * np.abs(exact).max())
    if dtype == np.float32:
        engine = InferenceSession(model, _options("numpy")).run(None, feeds)[0]
        assert engine.tobytes() == want.tobytes()


def test_tuples_of_every_index_combine_scalars() -> None:
    """Tuples as long as data's rank (one element each): [300, 400] data, 262144 scalar updates."""
    from onnxtrain import InferenceSession

    data = (300, 400)
    model = _tuple_scatter(262144, T.FLOAT, data, k=2).SerializeToString()
    feeds = _feeds(np.float32, 262144, data, k=2)
    feeds["indices"] %= 7  # 49 elements hit over 5000 times each
    want = _add_at(feeds, np.float32)
    sess = InferenceSession(model, _options("onnxruntime", threads=2))
    for _ in range(10):
        assert sess.run(None, feeds)[0].tobytes() == want.tobytes()
    np.testing.assert_allclose(want, _add_at(feeds, np.float64), atol=2e-3)


@pytest.mark.parametrize("limit, n", [("_MAX_CHAIN", 8192), ("RUNTIME_PIECES", "n")],
                         ids=["static", "runtime"])
def test_too_many_pieces_take_the_flat_scatter(monkeypatch, limit, n) -> None:
    """More pieces than laid out as nodes (here more than one): one ScatterElements over the flat data, the
    same bits; a tuple with one index out of range whose flat position would land inside the data is still
    refused."""
    from onnxtrain import InferenceSession
    from onnxtrain.engine import ort_scatter_nd
    from onnxtrain.engine.ort_rewrites import for_onnxruntime
    from onnxtrain.ir.graphs import walk_graphs

    monkeypatch.setattr(ort_scatter_nd, limit, 1)
    model = _tuple_scatter(n, T.FLOAT)
    ops = [nd.op_type for g in walk_graphs(for_onnxruntime(model).graph) for nd in g.node]
    assert "ScatterElements" in ops
    feeds = _feeds(np.float32, 8192)
    want = _add_at(feeds, np.float32)
    sess = InferenceSession(model.SerializeToString(), _options("onnxruntime", threads=2))
    for _ in range(100):
        assert sess.run(None, feeds)[0].tobytes() == want.tobytes()
    feeds["indices"][5000] = (0, 20)  # (1, 0)'s flat position
    with pytest.raises(Exception, match="(?i)out of|bound|range|ind"):
        sess.run(None, feeds)


def test_three_index_tuples_into_a_rank_4_tensor() -> None:
    """Tuples of three indices into [6, 5, 4, 512] data (strides 10240, 2048, 512)."""
    from onnxtrain import InferenceSession

    data = (6, 5, 4, 512)
    model = _tuple_scatter("n", T.FLOAT, data, k=3).SerializeToString()
    feeds = _feeds(np.float32, 1024, data, k=3, seed=9)
    want = _add_at(feeds, np.float32)
    sess = InferenceSession(model, _options("onnxruntime", threads=2))
    for _ in range(10):
        assert sess.run(None, feeds)[0].tobytes() == want.tobytes()


@pytest.mark.parametrize("n", [4096, "n"], ids=["static", "runtime"])
@pytest.mark.parametrize("bad", [(0, 20), (0, -21), (30, 0), (-31, 5), (3, 10**6)])
def test_a_tuple_out_of_range_is_refused(n, bad) -> None:
    """One tuple with a component out of range (its flat position Σ index·stride would land inside the data,
    e.g. (0, 20) on row (1, 0)) fails the run as onnxruntime's ScatterND fails it."""
    from onnxtrain import InferenceSession

    model = _tuple_scatter(n, T.FLOAT)
    feeds = _feeds(np.float32)
    feeds["indices"][1234] = bad
    plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="(?i)ind"):
        plain.run(None, feeds)
    sess = InferenceSession(model.SerializeToString(), _options("onnxruntime", threads=2))
    with pytest.raises(Exception, match="(?i)ScatterND|out of|bound|range|ind"):
        sess.run(None, feeds)
    with pytest.raises(Exception, match="(?i)ScatterND|out of|bound|range|ind"):
        InferenceSession(model.SerializeToString(), _options("numpy")).run(None, feeds)


def test_a_tuple_scatter_in_a_loop_body_keeps_every_update() -> None:
    """Inside a Loop body (run twice; its data's type unknown there, so behind an If on the updates' size):
    the serial sum's bits at every run."""
    from onnxtrain import InferenceSession
    from onnxtrain.engine.ort_rewrites import for_onnxruntime

    model = loop_scatter_model(DATA, 2)
    rewritten = for_onnxruntime(model).graph.node[-1].attribute[0].g
    assert "If" in [n.op_type for n in rewritten.node]
    feeds = _feeds(np.float32)
    want = _add_at(feeds, np.float32, times=2)
    sess = InferenceSession(model.SerializeToString(), _options("onnxruntime", threads=2))
    for _ in range(100):
        assert sess.run(None, feeds)[0].tobytes() == want.tobytes()
    np.testing.assert_allclose(want, _add_at(feeds, np.float64, times=2), atol=1e-4)


def test_one_intra_op_thread_keeps_the_scatter_nd(monkeypatch) -> None:
    """On one intra-op thread (asked for, or the host's CPUs shared by as many MPI ranks) onnxruntime's
    ScatterND runs serially: the graph keeps it (the rewrite costs ~10× its time), values still exact."""
    from onnxtrain.engine.ort_plan import OrtPlan

    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_SIZE", raising=False)
    monkeypatch.delenv("MPI_LOCALNRANKS", raising=False)
    monkeypatch.delenv("ONNXTRAIN_NUM_THREADS", raising=False)
    model = _tuple_scatter(4096, T.FLOAT)

    def ops(options: Any) -> list[str]:
        return [n.op_type for n in OrtPlan(model, options=options).onnxruntime_model.graph.node]

    assert ops(_options("onnxruntime", threads=1)) == ["ScatterND"]
    assert ops(_options("onnxruntime", threads=2)).count("ScatterND") == 2  # two pieces of 2048 tuples
    assert ops(_options("onnxruntime")).count("ScatterND") == 2
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    monkeypatch.setenv("MPI_LOCALNRANKS", "2")  # two ranks on two CPUs: one thread each
    assert ops(_options("onnxruntime")) == ["ScatterND"]
    monkeypatch.setenv("MPI_LOCALNRANKS", "1")
    assert ops(_options("onnxruntime")).count("ScatterND") == 2
    with monkeypatch.context() as m:  # a host of one CPU: onnxruntime's default is one thread there
        m.setattr("os.cpu_count", lambda: 1)
        assert ops(_options("onnxruntime")) == ["ScatterND"]
        assert ops(_options("onnxruntime", threads=2)).count("ScatterND") == 2  # two asked for: they race

    from onnxtrain import InferenceSession

    monkeypatch.delenv("MPI_LOCALNRANKS")
    feeds = _feeds(np.float32)
    sess = InferenceSession(model.SerializeToString(), _options("onnxruntime", threads=1))
    assert sess.run(None, feeds)[0].tobytes() == _add_at(feeds, np.float32).tobytes()


def test_a_gather_nd_gradient_is_the_same_at_every_run() -> None:
    """The gradient graph of ``loss = Σ table[i, j] · w`` (GatherND over tuples of two indices, as torch's
    ``table[i, j]`` exports) on the onnxruntime backend: within float32 rounding of torch autograd's table
    gradient, the same bits at every run and as the numpy engine's."""
    import torch

    from onnxtrain import InferenceSession
    from onnxtrain.autodiff import build_gradient_model

    n = 4096
    graph = helper.make_graph(
        [helper.make_node("GatherND", ["table", "idx"], ["picked"]),
         helper.make_node("Mul", ["picked", "w"], ["scaled"]),
         helper.make_node("ReduceSum", ["scaled"], ["loss"], keepdims=0)], "gather_nd",
        [helper.make_tensor_value_info("table", T.FLOAT, list(DATA)),
         helper.make_tensor_value_info("idx", T.INT64, ["n", 2]),
         helper.make_tensor_value_info("w", T.FLOAT, ["n", DATA[2]])],
        [helper.make_tensor_value_info("loss", T.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    grad = build_gradient_model(model, "loss", ["table"])
    assert "ScatterND" in [node.op_type for node in grad.graph.node]
    rng = np.random.default_rng(11)
    feeds = {"table": rng.standard_normal(DATA).astype(np.float32),
             "idx": np.stack([rng.integers(-30, 30, n), rng.integers(-20, 20, n)], axis=1),
             "w": rng.standard_normal((n, DATA[2])).astype(np.float32)}
    table = torch.tensor(feeds["table"], requires_grad=True)
    idx = torch.tensor(feeds["idx"])
    (table[idx[:, 0], idx[:, 1]] * torch.tensor(feeds["w"])).sum().backward()
    name = next(o.name for o in grad.graph.output if o.name != "loss")
    sess = InferenceSession(grad.SerializeToString(), _options("onnxruntime", threads=2))
    outs = [sess.run([name], feeds)[0] for _ in range(100)]
    np.testing.assert_allclose(outs[0], table.grad.numpy(), rtol=1e-5, atol=1e-4)
    assert all(o.tobytes() == outs[0].tobytes() for o in outs)
    engine = InferenceSession(grad.SerializeToString(), _options("numpy")).run([name], feeds)[0]
    assert engine.tobytes() == outs[0].tobytes()
