"""A seeded random node in the several graphs of one session (the micro-steps and the update step of
gradient accumulation) draws one sequence: its masks do not repeat from one graph to the next."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxtrain import SessionOptions, TrainingSession, set_seed
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


def test_onnxruntime_backend_unseeded_noise_differs_between_graphs() -> None:
    """An unseeded RandomUniformLike in the micro-step and update graphs: onnxruntime seeds every session's
    unseeded kernels alike, so runs 0 and 1 (and 2 and 3) drew the same noise; each later graph's copy now
    takes a seed of its own, and ``set_seed`` still makes the runs repeat."""
    rng = np.random.default_rng(0)
    vi = helper.make_tensor_value_info
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("RandomUniformLike", ["h"], ["u"]),
             helper.make_node("Mul", ["h", "u"], ["z"]),
             helper.make_node("ReduceSum", ["z"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [vi("x", onnx.TensorProto.FLOAT, [4, 3])],
                          [vi("loss", onnx.TensorProto.FLOAT, []), vi("u", onnx.TensorProto.FLOAT, [4, 6])],
                          [numpy_helper.from_array(rng.standard_normal((3, 6)).astype(np.float32), "W")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    x = rng.standard_normal((4, 3)).astype(np.float32)

    def draws() -> list[np.ndarray]:
        set_seed(2)
        so = SessionOptions()
        so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
        s = TrainingSession(model, params("SGDOptimizer", gradient_accumulation_steps=2,
                                          gradient_accumulation_mode="auto"), so)
        return [s.run(["u"], {"x": x, "Learning_Rate": LR0})[0] for _ in range(4)]

    first = draws()
    for i in range(4):
        for j in range(i):
            assert not np.array_equal(first[i], first[j]), (i, j)
    for a, b in zip(first, draws()):
        np.testing.assert_array_equal(a, b)
