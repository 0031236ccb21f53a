"""A legacy ``recompute_checkpoints`` name that is an *activation* of the user's model which the session's
own rewrites removed (the Sigmoid output of a ``Log(Sigmoid(z))`` term, computed as ``-softplus(-z)``) is
not kept: the step graph has no such value. ec1970d5 leaves such names out without a word, as it does the
constants it was written for (a Dropout's training-mode Constant, a frozen weight), whose leaving out
changes nothing. For an activation the user asked to keep, the checkpoint list then keeps less than it
names, and the user is not told (recompute options that act on nothing are otherwise named in a warning).

Review of ec1970d5: failed until a3b079ae named such a left-out activation in a warning."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import onnxtrain as ort

RNG = np.random.default_rng(3)
W1 = (RNG.standard_normal((6, 8)) * 0.5).astype(np.float32)
W2 = (RNG.standard_normal((8, 3)) * 0.5).astype(np.float32)
X = RNG.standard_normal((4, 6)).astype(np.float32)
Y = RNG.uniform(0.0, 1.0, (4, 3)).astype(np.float32)


def _model() -> onnx.ModelProto:
    """x → MatMul W1 (h) → Tanh (t) → MatMul W2 (z) → Sigmoid (s) → Log (ls) → ·y, mean, negated: loss."""
    n = helper.make_node
    nodes = [n("MatMul", ["x", "W1"], ["h"]), n("Tanh", ["h"], ["t"]), n("MatMul", ["t", "W2"], ["z"]),
             n("Sigmoid", ["z"], ["s"]), n("Log", ["s"], ["ls"]), n("Mul", ["ls", "y"], ["p"]),
             n("ReduceMean", ["p"], ["m"], keepdims=0), n("Neg", ["m"], ["loss"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6]),
                                       helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          [numpy_helper.from_array(W1, "W1"), numpy_helper.from_array(W2, "W2")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _session(checkpoints: list[str]) -> tuple[ort.TrainingSession, list[str]]:
    p = ort.TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    p.recompute_checkpoints = checkpoints
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sess = ort.TrainingSession(_model().SerializeToString(), p)
    return sess, [str(w.message) for w in caught]


def test_a_rewritten_activation_named_as_a_checkpoint_is_named_in_a_warning() -> None:
    named, said = _session(["t", "s"])
    kept, _ = _session(["t"])
    # (the step is the one that keeps t alone: s is no value of the step graph, so nothing more is kept)
    for _ in range(2):
        feeds = {"x": X, "y": Y, "Learning_Rate": np.array([0.1], np.float32)}
        np.testing.assert_array_equal(named.run(["loss"], feeds)[0], kept.run(["loss"], feeds)[0])
    for k, v in kept.get_state().items():
        np.testing.assert_array_equal(named.get_state()[k], v, err_msg=k)
    assert any("recompute_checkpoints" in s and "'s'" in s for s in said), (
        f"the checkpoint 's' (an activation the session's log-sigmoid rewrite removed) was left out without "
        f"a warning: {said}")
