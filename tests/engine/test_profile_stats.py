"""A numpy-engine profile's per-node statistics: the inputs' bytes split as onnxruntime splits them
(``activation_size``, ``parameter_size``), the bytes of live tensors around each node, and the threads that
ran it (``thread_scheduling_stats``)."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxtrain


def _trace(model_bytes: bytes, feeds: dict, lib=onnxtrain, threads: int = 0) -> list[dict]:
    """The Node events of one profiled run, node by node (no fusion)."""
    so = lib.SessionOptions()
    so.enable_profiling = True
    so.graph_optimization_level = lib.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = threads
    kw = {"providers": ["CPUExecutionProvider"]} if lib is ort else {}
    s = lib.InferenceSession(model_bytes, so, **kw)
    s.run(None, feeds)
    path = s.end_profiling()
    try:
        with open(path) as f:
            return [e for e in json.load(f) if e["cat"] == "Node"]
    finally:
        os.remove(path)


def _model(nodes, inputs, outputs, inits) -> bytes:
    tensors = [numpy_helper.from_array(v, k) for k, v in inits.items()]
    g = helper.make_graph(nodes, "g", inputs, outputs, tensors)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m.SerializeToString()


def _f(name: str, shape: list[int]):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def test_input_sizes_split_as_onnxruntime_splits_them() -> None:
    """A constant initializer's bytes are ``parameter_size``; a fed input's, an intermediate's and an
    overridable initializer's (one that is also a graph input) are ``activation_size`` (onnxruntime's own
    profile of the same model is the oracle)."""
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    v = np.ones((2, 3), np.float32)
    b = np.ones((4, 2, 3), np.float32)
    model = _model(
        [helper.make_node("Add", ["x", "w"], ["y"], name="add"),
         helper.make_node("Relu", ["y"], ["z"], name="relu"),
         helper.make_node("Mul", ["z", "v"], ["u"], name="mul"),
         helper.make_node("Sub", ["b", "u"], ["o"], name="sub")],
        [_f("x", [2, 3]), _f("v", [2, 3])], [_f("o", [4, 2, 3])], {"w": w, "v": v, "b": b})
    feeds = {"x": np.ones((2, 3), np.float32)}
    keys = ("activation_size", "parameter_size", "output_size")
    ours = [(e["name"], {k: e["args"][k] for k in keys}) for e in _trace(model, feeds)]
    theirs = [(e["name"], {k: e["args"][k] for k in keys}) for e in _trace(model, feeds, ort)]
    assert ours == theirs
    assert [a["parameter_size"] for _, a in ours] == ["24", "0", "0", "96"]  # (what the oracle says, too)


def test_memory_in_use_follows_each_values_last_use() -> None:
    """``mem_bytes_in_use`` after each node is the bytes of the values alive then: the initializers, the
    inputs and intermediates still to be read (or graph outputs), and the node's outputs; ``delta`` the
    change over the node, ``peak`` the largest so far. The oracle replays the graph's liveness in this test
    on the sizes onnx.reference computes for every value."""
    big = 1 << 14
    nodes = [
        helper.make_node("Exp", ["x"], ["a"], name="exp"),                  # a: 64 KiB
        helper.make_node("Tile", ["a", "reps"], ["t"], name="tile"),        # t: 256 KiB
        helper.make_node("ReduceSum", ["t"], ["s"], name="sum", keepdims=0),
        helper.make_node("Mul", ["a", "s"], ["m"], name="mul"),             # a read again, here last
        helper.make_node("Neg", ["s"], ["n"], name="neg"),                  # s is a graph output too
        helper.make_node("Add", ["m", "w"], ["y"], name="add"),
    ]
    inits = {"reps": np.array([4], np.int64), "w": np.ones(big, np.float32)}
    outputs = [_f("y", [big]), _f("s", []), _f("n", [])]
    model = _model(nodes, [_f("x", [big])], outputs, inits)
    x = np.linspace(-1, 1, big, dtype=np.float32)
    events = _trace(model, {"x": x})
    assert [e["name"] for e in events] == [f"{n.name}_kernel_time" for n in nodes]

    # every value's bytes, from onnx.reference (each intermediate made a graph output)
    names = ["a", "t", "s", "m", "n", "y"]
    probe = helper.make_graph(nodes, "g", [_f("x", [big])], [helper.make_tensor_value_info(n, 0, None)
                                                               for n in names],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    values = dict(zip(names, ReferenceEvaluator(helper.make_model(
        probe, opset_imports=[helper.make_opsetid("", 17)])).run(None, {"x": x})))
    size = {k: np.asarray(v).nbytes for k, v in {**values, **inits, "x": x}.items()}
    kept = set(inits) | {o.name for o in outputs}
    last = {}
    for i, n in enumerate(nodes):
        for name in n.input:
            last[name] = i
    alive = set(inits) | {"x"}
    peak = 0
    for i, (n, e) in enumerate(zip(nodes, events)):
        before = sum(size[k] for k in alive)
        alive |= set(n.output)
        now = sum(size[k] for k in alive)
        peak = max(peak, now)
        got = e["args"]
        assert (int(got["mem_bytes_in_use"]), int(got["mem_in_use_delta"]), int(got["mem_in_use_peak"])) == (
            now, now - before, peak), n.name
        alive -= {k for k in alive if k not in kept and last.get(k, -1) <= i}
    assert int(events[1]["args"]["mem_bytes_in_use"]) > int(events[-1]["args"]["mem_bytes_in_use"])


def test_thread_statistics_name_the_threads_that_ran_the_node() -> None:
    """The main thread is the caller's; a node whose kernel split its work lists the split (``splits``:
    parts of each parallel section), a node that ran alone an empty list; ``sub_threads`` are the engine's
    worker threads, by native id."""
    n = 1 << 21
    model = _model(
        [helper.make_node("Exp", ["x"], ["a"], name="exp"),
         helper.make_node("ReduceSum", ["a"], ["s"], name="sum", keepdims=0),
         helper.make_node("Neg", ["s"], ["t"], name="neg")],
        [_f("x", [n])], [_f("t", [])], {})
    events = _trace(model, {"x": np.zeros(n, np.float32)}, threads=2)
    stats = {e["name"]: e["args"]["thread_scheduling_stats"] for e in events}
    me = str(threading.get_native_id())
    assert {s["main_thread"]["thread_id"] for s in stats.values()} == {me}
    assert stats["exp_kernel_time"]["main_thread"]["splits"] == [2]
    assert stats["neg_kernel_time"]["main_thread"]["splits"] == []
    running = {str(t.native_id) for t in threading.enumerate()}
    workers = stats["exp_kernel_time"]["sub_threads"]
    assert workers and set(workers) <= running and me not in workers
    assert all(isinstance(w["core"], int) for w in workers.values())
