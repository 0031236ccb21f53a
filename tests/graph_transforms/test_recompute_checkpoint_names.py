"""The legacy session's ``recompute_checkpoints`` take any value of the model the user gave, also one the
session's own rewrites remove before the recompute pass runs (a Dropout's training-mode Constant, replaced by
the shared ``training_mode`` input; under mixed precision a float32 Constant remade in the half type) or
leave an initializer (a frozen weight): such a constant is never recomputed, so naming it keeps nothing
more, and the step is the plain one's. Those names were refused as "not values of the forward graph" though
the user's model has them; a name the model does not have is still refused."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain as ort

RNG = np.random.default_rng(11)
W1 = (RNG.standard_normal((6, 8)) * 0.5).astype(np.float32)
W2 = (RNG.standard_normal((8, 5)) * 0.5).astype(np.float32)
X = RNG.standard_normal((4, 6)).astype(np.float32)
Y = RNG.integers(0, 5, 4).astype(np.int64)


def _model() -> onnx.ModelProto:
    """x → MatMul W1 → Dropout(ratio 0.25, training mode the Constant ``mode``) → Mul by the Constant
    ``half`` (0.5) → Relu → MatMul W2 → SoftmaxCrossEntropyLoss."""
    n = helper.make_node
    const = {"mode": np.array(True), "ratio": np.array(0.25, np.float32), "half": np.array(0.5, np.float32)}
    nodes = [n("Constant", [], [k], value=numpy_helper.from_array(v, k)) for k, v in const.items()]
    nodes += [n("MatMul", ["x", "W1"], ["h"]), n("Dropout", ["h", "ratio", "mode"], ["d", "mask"], seed=3),
              n("Mul", ["d", "half"], ["s"]), n("Relu", ["s"], ["r"]), n("MatMul", ["r", "W2"], ["logits"]),
              n("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6]),
                                       helper.make_tensor_value_info("y", TensorProto.INT64, [4])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          [numpy_helper.from_array(W1, "W1"), numpy_helper.from_array(W2, "W2")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _steps(dtype: str | None, checkpoints: list[str], tmp_path) -> tuple[list, dict, onnx.ModelProto]:
    p = ort.TrainingParameters()
    p.weights_to_train = {"W1"}  # W2 stays an initializer of the step
    p.loss_output_name = "loss"
    p.training_optimizer_name = "AdamOptimizer"
    p.recompute_checkpoints = checkpoints
    p.model_with_training_graph_path = str(tmp_path / "training.onnx")
    if dtype:
        p.use_mixed_precision = True
        p.mixed_precision_dtype = dtype
    ort.set_seed(5)  # the same Dropout masks in both sessions
    sess = ort.TrainingSession(_model().SerializeToString(), p)
    feeds = {"x": X, "y": Y, "Learning_Rate": np.array([0.01], np.float32)}
    if dtype:
        feeds[sess.loss_scale_input_name] = np.array([64.0], np.float32)
    losses = [sess.run(["loss"], feeds)[0] for _ in range(3)]
    return losses, sess.get_state(), onnx.load(p.model_with_training_graph_path)


@pytest.mark.parametrize(("dtype", "constant"), [(None, "mode"), ("float16", "mode"), ("float16", "half"),
                                                 ("bfloat16", "half"), (None, "W2"), ("float16", "W2")])
def test_a_constant_the_session_rewrote_is_a_checkpoint_that_keeps_nothing(dtype, constant, tmp_path) -> None:
    """Checkpoints [h, the constant]: every activation but h is recomputed (the graph has clones), and three
    Adam steps give the plain session's losses and state to the bit."""
    plain_losses, plain_state, _ = _steps(dtype, [], tmp_path)
    losses, state, graph = _steps(dtype, ["h", constant], tmp_path)
    assert any(n.name.endswith("_recompute") for n in graph.graph.node)
    onnx.checker.check_model(graph, full_check=True)
    for a, b in zip(losses, plain_losses, strict=True):
        np.testing.assert_array_equal(a, b)
    assert state.keys() == plain_state.keys()
    for k, v in plain_state.items():
        np.testing.assert_array_equal(state[k], v, err_msg=k)


def test_a_name_the_model_does_not_have_is_still_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"recompute_checkpoints.*\['hh'\]"):
        _steps("float16", ["h", "hh", "half"], tmp_path)


@pytest.mark.parametrize("name", ["W1_grad", "loss_grad"])
def test_a_value_of_the_gradient_graph_only_is_refused(name: str, tmp_path) -> None:
    """A name the step graph has but the user's model does not (a weight's gradient, the loss's): recompute
    keeps forward values only, so naming it kept nothing, and it was taken without a word."""
    with pytest.raises(ValueError, match=rf"recompute_checkpoints.*\['{name}'\]"):
        _steps(None, ["h", name], tmp_path)
