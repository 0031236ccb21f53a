"""A seeded random node in the several graphs of one session (the micro-steps and the update step of
gradient accumulation) draws one sequence: its masks do not repeat from one graph to the next."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxtrain import SessionOptions, TrainingSession
from tests.session.helpers import batches, mlp_model, params

LR0 = np.array([0.0], np.float32)  # the weights stay: only the masks change the gradients


def _with_seeded_dropout() -> onnx.ModelProto:
    """The helpers' MLP with Dropout(ratio 0.5, training, seed 7) after its activation."""
    m = mlp_model()
    g = m.graph
    k = next(i for i, n in enumerate(g.node) if n.op_type == "Relu")
    g.node[k + 1].input[0] = "dropped"
    g.node.insert(k + 1, helper.make_node("Dropout", ["hr", "ratio", "on"], ["dropped", "mask"], seed=7))
    g.initializer.extend([numpy_helper.from_array(np.array(0.5, np.float32), "ratio"),
                          numpy_helper.from_array(np.array(True), "on")])
    onnx.checker.check_model(m, full_check=True)
    return m


def _gradients(steps: int, runs: int, options: SessionOptions | None = None) -> list[np.ndarray]:
    p = params("SGDOptimizer", gradient_accumulation_steps=steps, gradient_accumulation_mode="auto",
               set_gradients_as_graph_outputs=True, enable_grad_norm_clip=False)
    s = TrainingSession(_with_seeded_dropout().SerializeToString(), p, options)
    x, y = batches(1, 16)[0]
    return [s.run(["W1_grad"], {"x": x, "y": y, "Learning_Rate": LR0})[0] for _ in range(runs)]


def test_accumulation_micro_steps_continue_the_update_steps_draws() -> None:
    """Micro-step graph and update graph share the node's generator: the gradients of K = 2 and of K = 3,
    run by run, are those of K = 1 (one graph), where two graphs each seeded their own and repeated."""
    one = _gradients(1, 6)
    assert all(not np.array_equal(one[0], g) for g in one[1:])  # the masks change from run to run
    for k in (2, 3):
        for i, (a, b) in enumerate(zip(_gradients(k, 6), one)):
            np.testing.assert_array_equal(a, b, err_msg=f"K={k}, run {i}")


def test_onnxruntime_backend_gives_each_graph_its_own_seed() -> None:
    """onnxruntime keeps a generator per session: the later graph's copy of the node is seeded apart, so no
    two micro-steps of an accumulation see the same mask."""
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    g = _gradients(3, 6, so)
    for i in range(6):
        for j in range(i):
            assert not np.array_equal(g[i], g[j]), (i, j)
