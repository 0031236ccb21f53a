"""Mixed precision under onnxruntime's names: the half twins in the state dict, their gradients as outputs."""

from __future__ import annotations

import numpy as np
import pytest

from onnxtrain import TrainingSession
from tests.session.helpers import batches, mlp_model, params

LR = np.array([0.05], np.float32)


def _session(**kw) -> TrainingSession:
    return TrainingSession(
        mlp_model().SerializeToString(), params("AdamOptimizer", use_mixed_precision=True, **kw)
    )


def test_state_holds_the_half_twins_and_loads_them_strictly() -> None:
    sess = _session()
    ((x, y),) = batches(1, 16)
    sess.run(
        ["loss"],
        {"x": x, "y": y, "Learning_Rate": LR, sess.loss_scale_input_name: np.array([1.0], np.float32)},
    )
    state = sess.get_state()
    for w in ("W1", "b1", "W2", "b2"):
        assert state[f"{w}_fp16"].dtype == np.float16
        np.testing.assert_array_equal(state[f"{w}_fp16"], state[w].astype(np.float16))
    assert list(state) == sorted(state)
    other = _session()
    other.load_state(state, strict=True)  # a legacy-shaped state dict, twins included
    np.testing.assert_array_equal(other.get_state()["W1_fp16"], state["W1_fp16"])
    with pytest.raises(ValueError, match="W1_fp16"):
        other.load_state({"W1_fp16": np.zeros((2, 2), np.float16)})
    wrong = dict(state, b1_fp16=np.full(state["b1_fp16"].shape, np.nan))  # float64: refused, as a weight's
    with pytest.raises(TypeError, match=r"'b1_fp16': expected dtype float16.*got float64"):
        other.load_state(wrong, strict=True)


def test_gradients_are_also_output_under_the_twins_names() -> None:
    """``<w>_fp16_grad`` (float16), as onnxruntime named the gradient of the half twin; the float32
    ``<w>_grad`` holds the same values."""
    sess = _session(set_gradients_as_graph_outputs=True)
    names = [o.name for o in sess.get_outputs()]
    assert {"W1_fp16_grad", "b2_fp16_grad", "W1_grad"} <= set(names)
    ((x, y),) = batches(1, 16)
    feeds = {"x": x, "y": y, "Learning_Rate": LR, sess.loss_scale_input_name: np.array([8.0], np.float32)}
    half, full = sess.run(["W1_fp16_grad", "W1_grad"], feeds)
    assert half.dtype == np.float16 and full.dtype == np.float32
    np.testing.assert_array_equal(half, full.astype(np.float16))
    assert np.abs(full).max() > 0


@pytest.mark.parametrize("clash", ["loss_scale", "scaled_loss"])
def test_a_model_value_named_like_the_loss_scale_gets_a_unique_name(clash: str) -> None:
    """onnxruntime generated the loss scale's names (``GenerateNodeArgName``) and told the input's through
    ``loss_scale_input_name``; a model using one of them was refused. It now trains as the same model with
    that value named otherwise."""
    models = []
    for name in (clash, "hidden"):
        m = mlp_model()
        for n in m.graph.node:
            if n.op_type == "Relu":
                n.output[0] = name
            elif n.input and n.input[0] == "hr":
                n.input[0] = name
        models.append(m)
    ((x, y),) = batches(1, 16)
    losses = []
    for m in models:
        sess = TrainingSession(m.SerializeToString(), params("AdamOptimizer", use_mixed_precision=True))
        scale = sess.loss_scale_input_name
        assert (scale != "loss_scale") == (clash == "loss_scale" and m is models[0])
        feeds = {"x": x, "y": y, "Learning_Rate": LR, scale: np.array([4.0], np.float32)}
        losses.append([sess.run(["loss"], feeds)[0] for _ in range(3)])
    np.testing.assert_array_equal(losses[0], losses[1])


def test_every_float32_weight_has_a_twin_also_when_read_in_float32() -> None:
    """An embedding table read by a Gather and a weight read after a Softmax (both kept in float32) get
    their half twins in the state and ``<w>_fp16_grad`` outputs too, as onnxruntime gave every float32
    initializer a twin (they had neither)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = {"E": rng.standard_normal((10, 4)), "W": rng.standard_normal((4, 3)), "S": np.ones(3)}
    nodes = [helper.make_node("Gather", ["E", "ids"], ["e"]),
             helper.make_node("MatMul", ["e", "W"], ["z0"]),
             helper.make_node("Softmax", ["z0"], ["sm"], axis=-1),
             helper.make_node("Mul", ["sm", "S"], ["z"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["z", "y"], ["loss"])]
    ints = [helper.make_tensor_value_info(n, TensorProto.INT64, [5]) for n in ("ids", "y")]
    g = helper.make_graph(nodes, "g", ints, [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    p = params("SGDOptimizer", use_mixed_precision=True, set_gradients_as_graph_outputs=True)
    sess = TrainingSession(model.SerializeToString(), p)
    names = [o.name for o in sess.get_outputs()]
    assert {"E_fp16_grad", "S_fp16_grad", "W_fp16_grad"} <= set(names), names
    feeds = {"ids": np.array([1, 2, 3, 1, 9]), "y": np.array([0, 1, 2, 0, 1]), "Learning_Rate": LR,
             sess.loss_scale_input_name: np.array([4.0], np.float32)}
    half, full = sess.run(["E_fp16_grad", "E_grad"], feeds)
    np.testing.assert_array_equal(half, full.astype(np.float16))
    state = sess.get_state()
    for w in ("E", "S", "W"):
        np.testing.assert_array_equal(state[f"{w}_fp16"], state[w].astype(np.float16))
