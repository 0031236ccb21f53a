"""The batch split's second half in a forked child process (onnxtrain.batch_split = process,
onnxtrain/engine/half_process.py): the same outputs as the halves on threads, errors raised in the parent,
and a child that ends with its session."""

from __future__ import annotations

import gc
import os
import signal
import sys
import time

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.engine import half_process
from tests import models
from tests.engine.test_batch_split import batch_model, no_minimum, session  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(half_process.available() is not None, reason="no fork() here")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2]


@pytest.mark.parametrize("name,batch", [("transformer_encoder", 6), ("lstm_cls", 4)])
def test_the_child_gives_the_thread_halves_bits(no_minimum, name, batch):  # noqa: F811
    model, _, _ = models.export(name, training=False)
    feeds = models.example_inputs(name, batch, seed=5)
    forked, threads = session(model, split="process"), session(model)
    runs = [forked.run(None, feeds)[0] for _ in range(3)]
    want = [threads.run(None, feeds)[0] for _ in range(3)]
    assert forked._splitter.verdicts == {batch: True} and forked._splitter.split_runs == 2
    child = forked._splitter.child
    assert child is not None and child.pid != os.getpid() and not _gone(child.pid)
    for a, b in zip(runs, want):  # the same half plans, each on one BLAS thread: the same bits
        np.testing.assert_array_equal(a, b)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(runs[-1], ref.run(None, feeds)[0], rtol=1e-5,
                               atol=1e-5 * float(np.abs(want[0]).max()))
    assert child.peak_bytes > 0 and forked.peak_bytes > 0


def test_the_child_ends_with_its_session(no_minimum):  # noqa: F811
    sess = session(batch_model([helper.make_node("Relu", ["x"], ["y"])]), split="process")
    x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(8, 3)
    for _ in range(2):
        np.testing.assert_array_equal(sess.run(None, {"x": x})[0], np.maximum(x, 0))
    pid = sess._splitter.child.pid
    del sess
    gc.collect()
    assert _gone(pid)  # told to end and reaped: no zombie either

    sess = session(batch_model([helper.make_node("Relu", ["x"], ["y"])]), split="process")
    for _ in range(2):
        sess.run(None, {"x": x})
    pid = sess._splitter.child.pid
    sess._splitter.close()
    assert _gone(pid)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], np.maximum(x, 0))  # a new child
    assert sess._splitter.child.pid != pid and sess._splitter.split_runs == 2


def test_an_error_in_the_child_is_raised_here_and_the_next_run_works(no_minimum):  # noqa: F811
    # y = table[idx]: an index out of range in the second half fails only in the child
    table = numpy_helper.from_array(np.arange(30, dtype=np.float32).reshape(10, 3), "table")
    g = helper.make_graph([helper.make_node("Gather", ["table", "idx"], ["y"], name="lookup")], "g",
                          [helper.make_tensor_value_info("idx", TensorProto.INT64, ["batch"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])], [table])
    sess = session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), split="process")
    good = np.array([1, 2, 3, 4, 5, 6], np.int64)
    for _ in range(2):
        np.testing.assert_array_equal(sess.run(None, {"idx": good})[0], np.arange(30.0).reshape(10, 3)[good])
    bad = good.copy()
    bad[4] = 99
    # raised as by an unsplit run of the batch: its class, its message (the node, the whole batch's shape)
    unsplit = session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), split="0")
    with pytest.raises(Exception) as expected:
        unsplit.run(None, {"idx": bad})
    with pytest.raises(type(expected.value), match=r"lookup.*idx: int64\[6\]") as got:
        sess.run(None, {"idx": bad})
    assert str(got.value) == str(expected.value)
    np.testing.assert_array_equal(sess.run(None, {"idx": good[::-1].copy()})[0],
                                  np.arange(30.0).reshape(10, 3)[good[::-1]])
    assert sess._splitter.split_runs == 3


def test_outputs_larger_than_the_pipe(no_minimum):  # noqa: F811
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 400_000])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 400_000])])
    sess = session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), split="process")
    x = np.random.default_rng(0).standard_normal((4, 400_000)).astype(np.float32)  # 3.2 MB per half
    for _ in range(2):
        np.testing.assert_array_equal(sess.run(None, {"x": x})[0], np.maximum(x, 0))
    assert sess._splitter.split_runs == 1


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_the_child_keeps_only_its_pipes(no_minimum, tmp_path):  # noqa: F811
    with open(tmp_path / "held.txt", "w") as held:
        sess = session(batch_model([helper.make_node("Relu", ["x"], ["y"])]), split="process")
        for _ in range(2):
            sess.run(None, {"x": np.ones((8, 3), np.float32)})
        fds = os.listdir(f"/proc/{sess._splitter.child.pid}/fd")
        assert str(held.fileno()) not in fds
        assert len(fds) <= 5  # stdin, stdout, stderr and its two pipes


def test_the_config_entry_and_where_a_process_cannot_fork(monkeypatch):
    relu = batch_model([helper.make_node("Relu", ["x"], ["y"])])
    assert session(relu, split="process")._splitter.mode == "process"
    assert session(relu, split="1")._splitter.mode == "threads"
    with pytest.raises(ValueError, match=r"onnxtrain.batch_split.*'0', '1', 'process'.*'fork'"):
        session(relu, split="fork")
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", object())  # an MPI rank must not fork
    with pytest.warns(UserWarning, match="MPI process must not fork; the halves run on threads"):
        assert session(relu, split="process")._splitter.mode == "threads"


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="needs /proc/PID/schedstat")
def test_the_child_makes_its_products_on_its_own_thread(no_minimum):  # noqa: F811
    """The child's BLAS runs on one thread (the parent's half has the other core): OpenBLAS's helper
    threads, which it starts in the child all the same, get no work."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 512])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 512])], [w])
    sess = session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), split="process")
    x = np.random.default_rng(1).standard_normal((512, 512)).astype(np.float32)
    want = x.astype(np.float64) @ numpy_helper.to_array(w).astype(np.float64)
    for _ in range(3):
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-3)
    pid = sess._splitter.child.pid
    helpers = [t for t in os.listdir(f"/proc/{pid}/task") if t != str(pid)]

    def helpers_cpu_ns() -> int:
        return sum(int(open(f"/proc/{pid}/task/{t}/schedstat").read().split()[0]) for t in helpers)

    time.sleep(0.3)  # a helper that has just started spins a while before it sleeps
    before = helpers_cpu_ns()
    for _ in range(20):  # 20 halves of 256 x 512 x 512: about 13 ms of a helper's CPU if it took half
        sess.run(None, {"x": x})
    assert helpers_cpu_ns() - before < 2_000_000
    assert sess._splitter.split_runs == 22


def test_a_forked_process_gets_a_child_of_its_own(no_minimum):  # noqa: F811
    """The user's own fork (a multiprocessing worker, say) must neither stop the parent's child nor talk to
    it: the session there forks a child of its own."""
    sess = session(batch_model([helper.make_node("Relu", ["x"], ["y"])]), split="process")
    x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(8, 3)
    for _ in range(2):
        sess.run(None, {"x": x})
    first = sess._splitter.child.pid
    pid = os.fork()
    if pid == 0:  # the test's fork: exit status 0 only if its runs are right and on a child of its own
        ok = False
        try:
            y = sess.run(None, {"x": -x})[0]
            ok = (np.array_equal(y, np.maximum(-x, 0)) and sess._splitter.child.pid != first
                  and sess._splitter.split_runs == 2)
            del sess
            gc.collect()
        finally:
            os._exit(0 if ok else 1)
    assert os.waitpid(pid, 0)[1] == 0
    assert not _gone(first) and sess._splitter.child.pid == first
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], np.maximum(x, 0))
    assert sess._splitter.split_runs == 2


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_a_child_that_died_is_replaced_and_its_half_runs_here(no_minimum):  # noqa: F811
    sess = session(batch_model([helper.make_node("Relu", ["x"], ["y"])]), split="process")
    x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(8, 3)
    for _ in range(2):
        sess.run(None, {"x": x})
    first = sess._splitter.child.pid
    os.kill(first, signal.SIGKILL)
    while _state(first) != "Z":  # dead, not yet reaped
        time.sleep(0.001)
    with pytest.warns(RuntimeWarning, match=rf"child process \(pid {first}\) ended; its half"):
        np.testing.assert_array_equal(sess.run(None, {"x": -x})[0], np.maximum(-x, 0))
    assert _gone(first)  # reaped
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], np.maximum(x, 0))
    assert sess._splitter.child.pid != first and sess._splitter.split_runs == 3
