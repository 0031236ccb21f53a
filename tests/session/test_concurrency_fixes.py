"""Concurrency defects an outside review found (each failed before the fix): state snapshots and
checkpoints taken while another thread trains, seeded random nodes' first runs from many threads,
``run_async`` threads while the main thread runs (a deadlock in OpenBLAS), and a forked child of a process
whose thread held a session's lock."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
from onnx import TensorProto, helper

import onnxtrain
from tests.lock_watch import first_set, watched_lock
from tests.session.helpers import mlp_model, params


def _blocked_while_held(owner, attr: str, call) -> None:
    """``call()`` in a thread does not finish while ``owner.attr`` (a lock) is held by another thread: it
    waits for the lock (seen by :func:`tests.lock_watch.watched_lock`, not by giving it a fixed time, which a
    loaded host could spend before the call even began), and finishes once the lock is let go."""
    held, release = threading.Event(), threading.Event()
    lock = getattr(owner, attr)

    def hold() -> None:
        with lock:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(60)
        with watched_lock(owner, attr) as watched:
            done = threading.Event()
            caller = threading.Thread(target=lambda: (call(), done.set()))
            caller.start()
            assert first_set(watched.waiting, done), "the call neither waited for the lock nor ended"
            assert not done.is_set(), "ran while a step held the lock (mixed or half-written state)"
            release.set()
            assert done.wait(60)
            caller.join()
    finally:
        release.set()
        holder.join()


def test_state_snapshots_wait_for_a_running_step() -> None:
    # get_model_state/get_optimizer_state read the arrays while a step in another thread wrote them: 24-41 of
    # 420 snapshots mixed steps or held half-updated tensors
    s = onnxtrain.TrainingSession(mlp_model().SerializeToString(), params("AdamOptimizer"))
    _blocked_while_held(s, "_run_lock", s.get_model_state)
    _blocked_while_held(s, "_run_lock", s.get_optimizer_state)


def test_a_checkpoint_waits_for_a_running_step(tmp_path) -> None:
    # save_checkpoint wrote arrays an Optimizer.step in another thread updated in place (9 of 26 files
    # matched no whole step on the onnxruntime backend)
    from onnxtrain.checkpoint import Checkpoint
    from onnxtrain.training.api import CheckpointState

    state = CheckpointState(Checkpoint(trainable={"w": np.ones(3, np.float32)}))
    path = str(tmp_path / "c.ckpt")
    _blocked_while_held(state, "_lock", lambda: CheckpointState.save_checkpoint(state, path))


def test_seeded_random_nodes_draw_one_sequence_over_concurrent_first_runs() -> None:
    # each thread's first run made the node's generator anew from its seed: the same masks, 34 of 40 trials
    nodes = [helper.make_node("Dropout", ["x", "r", "t"], ["y", "m"], seed=7)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64])],
        [helper.make_tensor_value_info("m", TensorProto.BOOL, [64])],
        [helper.make_tensor("r", TensorProto.FLOAT, [], [0.5]),
         helper.make_tensor("t", TensorProto.BOOL, [], [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    data = model.SerializeToString()
    x = np.ones(64, np.float32)
    for _ in range(5):
        sess = onnxtrain.InferenceSession(data)
        start, masks = threading.Barrier(8), []

        def run(sess=sess, start=start, masks=masks) -> None:
            start.wait()
            masks.append(sess.run(["m"], {"x": x})[0].tobytes())

        threads = [threading.Thread(target=run) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(set(masks)) == 8


RUN_ASYNC = r"""
import os, threading, faulthandler
import numpy as np
from onnx import helper, TensorProto, numpy_helper
import onnxtrain
faulthandler.dump_traceback_later(100, exit=True)
d = 1024
r = np.random.default_rng(1)
consts = {"W": (r.standard_normal((d, d)) * 0.03).astype(np.float32),
          "W2": (r.standard_normal((d, d)) * 0.03).astype(np.float32),
          "isq2": np.array(0.70710677, np.float32), "one": np.array(1.0, np.float32),
          "half": np.array(0.5, np.float32)}
nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Mul", ["h", "isq2"], ["h1"]),
         helper.make_node("Erf", ["h1"], ["e"]), helper.make_node("Add", ["e", "one"], ["e1"]),
         helper.make_node("Mul", ["h", "e1"], ["g0"]), helper.make_node("Mul", ["g0", "half"], ["g"]),
         helper.make_node("MatMul", ["g", "W2"], ["z"]), helper.make_node("Softmax", ["z"], ["y"], axis=-1)]
g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", d])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                      [numpy_helper.from_array(v, k) for k, v in consts.items()])
so = onnxtrain.SessionOptions()
so.add_session_config_entry("onnxtrain.batch_split", "1")
sess = onnxtrain.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                                                    ir_version=8).SerializeToString(), so)
xs = [r.standard_normal((n, d)).astype(np.float32) for n in (2048, 1024, 2048, 512, 2048, 1536, 2048, 1024)]
done = threading.Semaphore(0)
for x in xs[1:]:
    sess.run_async(None, {"x": x}, lambda o, u, e: done.release(), None)
sess.run(None, {"x": xs[0]})
assert all(done.acquire(timeout=60) for _ in xs[1:])
print("ok")
os._exit(0)
"""


def test_run_async_beside_a_run_of_the_main_thread_completes() -> None:
    # run_async's threads were taken for the engine's own: OpenBLAS's threads were stopped under their
    # GEMMs and the process hung (every time, in a fresh process)
    done = subprocess.run([sys.executable, "-c", RUN_ASYNC], capture_output=True, text=True, timeout=200)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


FORK = r"""
import multiprocessing as mp, threading, faulthandler, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import onnxtrain
from tests.session.helpers import mlp_model, params
s = onnxtrain.TrainingSession(mlp_model().SerializeToString(), params("AdamOptimizer"))
held, release = threading.Event(), threading.Event()
def hold():
    with s._run_lock:  # a step running in a thread of the parent at the fork
        held.set(); release.wait(30)
threading.Thread(target=hold, daemon=True).start(); held.wait(10)
def child(q):
    faulthandler.dump_traceback_later(20, exit=True)
    q.put(sorted(s.get_state()))
ctx = mp.get_context("fork"); q = ctx.Queue(); p = ctx.Process(target=child, args=(q,)); p.start()
print("W1" in q.get(timeout=40)); p.join(30); release.set()
"""


def test_a_forked_child_gets_the_sessions_lock_free(tmp_path) -> None:
    # the child inherited the lock held by a parent thread that does not exist in it: its first call hung
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", FORK, root], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-3000:]
