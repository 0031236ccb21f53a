"""Memory: the plan frees each intermediate after its last use, and reports the peak of live bytes."""

from __future__ import annotations

import itertools
import tracemalloc

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.engine.plan import compile_model


def mlp_model(dims: tuple[int, ...] = (784, 512, 512, 10), seed: int = 0) -> onnx.ModelProto:
    """x → (MatMul, Add, Relu)* → MatMul, Add: one node per op, each intermediate a separate value."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    h = "x"
    for k, (a, b) in enumerate(itertools.pairwise(dims)):
        inits.append(numpy_helper.from_array(rng.standard_normal((a, b), np.float32) * 0.05, f"w{k}"))
        inits.append(numpy_helper.from_array(np.zeros(b, np.float32), f"b{k}"))
        nodes.append(helper.make_node("MatMul", [h, f"w{k}"], [f"mm{k}"], name=f"matmul{k}"))
        last = k == len(dims) - 2
        out = "y" if last else f"pre{k}"
        nodes.append(helper.make_node("Add", [f"mm{k}", f"b{k}"], [out], name=f"add{k}"))
        if not last:
            nodes.append(helper.make_node("Relu", [f"pre{k}"], [f"h{k}"], name=f"relu{k}"))
            h = f"h{k}"
    graph = helper.make_graph(nodes, "mlp",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", dims[0]])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", dims[-1]])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def add_chain_model(n: int) -> onnx.ModelProto:
    """y = x + c + c + ... (n Adds), each Add a new intermediate of x's size."""
    nodes = [helper.make_node("Add", ["x" if i == 0 else f"t{i - 1}", "c"], ["y" if i == n - 1 else f"t{i}"])
             for i in range(n)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.array(1.0, np.float32), "c")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_mlp_peak_is_weights_plus_two_activations() -> None:
    model = mlp_model()
    weights = sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
    batch = 64
    x = np.random.default_rng(1).standard_normal((batch, 784), np.float32)
    sess = onnxtrain.InferenceSession(model)
    assert sess.peak_bytes == 0  # nothing ran yet
    (y,) = sess.run(None, {"x": x})
    assert y.shape == (batch, 10)
    activations = sorted([x.nbytes, batch * 512 * 4, batch * 512 * 4, y.nbytes], reverse=True)
    assert weights < sess.peak_bytes <= weights + activations[0] + activations[1]
    # the largest single step (MatMul on x) keeps x and its output alive together
    assert sess.peak_bytes >= weights + x.nbytes + batch * 512 * 4


def test_peak_follows_the_batch() -> None:
    sess = onnxtrain.InferenceSession(mlp_model())
    sess.run(None, {"x": np.zeros((128, 784), np.float32)})
    big = sess.peak_bytes
    sess.run(None, {"x": np.zeros((8, 784), np.float32)})
    assert sess.peak_bytes < big  # the figure is of the last run, not a running maximum


def test_add_chain_releases_intermediates() -> None:
    n = 50
    x = np.ones((512, 1024), np.float32)  # 2 MiB
    plan = compile_model(add_chain_model(n))
    (y,) = plan.run({"x": x})
    np.testing.assert_array_equal(y[:2, :2], np.full((2, 2), 1.0 + n, np.float32))
    # live at once: the feed, one input and one output of the current Add (plus the 4-byte constant)
    assert plan.peak_bytes <= 3 * x.nbytes + 64
    assert plan.peak_bytes >= 2 * x.nbytes


def test_add_chain_allocates_few_tensors() -> None:
    """Measured by tracemalloc (numpy reports its buffers to it), not by the plan's own accounting."""
    n = 50
    x = np.ones((512, 1024), np.float32)
    plan = compile_model(add_chain_model(n))
    plan.run({"x": x})  # warm-up: first-run caches
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        (y,) = plan.run({"x": x})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert y.shape == x.shape
    assert peak - base <= 2.5 * x.nbytes, f"run allocated {(peak - base) / x.nbytes:.1f} tensors at its peak"


def test_per_shape_memos_are_bounded_and_remade_right() -> None:
    """A run over many batch sizes keeps at most NodeCache.LIMIT memos per node (every size's MaxPool index
    table stayed: 339 MiB after training LeNet over sizes 1..128); a size whose memo went is remade right
    (against onnxruntime)."""
    from onnxtrain.engine.registry import NodeCache

    ort = __import__("pytest").importorskip("onnxruntime")
    w = np.random.default_rng(0).standard_normal((4, 2, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("MaxPool", ["c"], ["y", "i"], kernel_shape=[2, 2], strides=[2, 2]),
         helper.make_node("AveragePool", ["c"], ["a"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("i", TensorProto.INT64, None),
         helper.make_tensor_value_info("a", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    plan = compile_model(model)
    rng = np.random.default_rng(1)
    for n in range(1, 3 * NodeCache.LIMIT):
        plan.run({"x": rng.standard_normal((n, 2, 8, 8)).astype(np.float32)})
    assert all(len(step.attrs.cache) <= NodeCache.LIMIT for step in plan.steps)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for n in (1, 2 * NodeCache.LIMIT):  # the first size's memos are long gone, the other's still held
        x = rng.standard_normal((n, 2, 8, 8)).astype(np.float32)
        for ours, theirs in zip(plan.run({"x": x}), sess.run(None, {"x": x})):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_node_memo_bounds_setdefault_and_einsum_paths() -> None:
    from onnxtrain.engine.registry import NodeCache

    memo = NodeCache()
    for k in range(3 * NodeCache.LIMIT):
        memo.setdefault(("shape", k), k)
    assert len(memo) == NodeCache.LIMIT
    node = helper.make_node("Einsum", ["a", "b"], ["y"], equation="ij,jk->ik")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n", 3]),
                                            helper.make_tensor_value_info("b", TensorProto.FLOAT, [3, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    plan = compile_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))
    b = np.ones((3, 2), np.float32)
    for n in range(1, 2 * NodeCache.LIMIT):
        y = plan.run({"a": np.full((n, 3), 2.0, np.float32), "b": b})[0]
        np.testing.assert_array_equal(y, np.full((n, 2), 6.0, np.float32))
    assert all(len(v) <= NodeCache.LIMIT for st in plan.steps for v in [st.attrs.cache, *(
        x for x in st.attrs.cache.values() if isinstance(x, dict))])


def test_node_caches_shared_by_threads_never_lose_an_entry_under_them() -> None:
    """Threads running one session share its nodes' caches: an eviction between another thread's insert
    and its read (setdefault), or two threads evicting the same oldest entry, raised a KeyError inside a
    kernel (3 of 4 threads here), and evictions that saw the dict change skipped theirs (it held 317 of
    at most 32 entries). Switches forced every microsecond."""
    import sys
    import threading

    from onnxtrain.engine.registry import NodeCache

    cache, errors = NodeCache(), []

    def work(t: int) -> None:
        try:
            for i in range(100_000):
                assert cache.setdefault((t, i % 97), i) is not None
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(old)
    assert errors == []
    assert len(cache) <= NodeCache.LIMIT + len(threads)  # (each thread's last insert may race the limit)
