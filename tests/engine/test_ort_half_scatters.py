"""A model whose own weights are float16 trains on the onnxruntime backend when its gradient graph holds a
combining scatter (cross-entropy's one-hot, a Gather's gradient): onnxruntime's CPU provider has no float16
kernel for ScatterElements / ScatterND with a reduction, so the step failed to load; they run in float32.
Oracle: the numpy engine (float16 throughout) and a float64 numpy SGD step of the same model."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from onnxtrain import SessionOptions, TrainingParameters, TrainingSession

RNG = np.random.default_rng(0)
LR = np.array([0.1], np.float32)


def _classifier() -> tuple[bytes, dict[str, np.ndarray]]:
    w = nh.from_array((RNG.standard_normal((4, 8)) * 0.3).astype(np.float16), "W")
    g = h.make_graph([h.make_node("Gemm", ["x", "W"], ["logits"], transB=1),
                      h.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"])], "m",
                     [h.make_tensor_value_info("x", T.FLOAT16, ["N", 8]),
                      h.make_tensor_value_info("y", T.INT64, ["N"])],
                     [h.make_tensor_value_info("loss", T.FLOAT16, [])], [w])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)], ir_version=9)
    return model.SerializeToString(), {"x": RNG.standard_normal((16, 8)).astype(np.float16),
                                       "y": RNG.integers(0, 4, 16)}


def _embedding() -> tuple[bytes, dict[str, np.ndarray]]:
    e = nh.from_array((RNG.standard_normal((10, 4)) * 0.3).astype(np.float16), "E")
    g = h.make_graph([h.make_node("Gather", ["E", "ids"], ["e"]), h.make_node("Sub", ["e", "t"], ["d"]),
                      h.make_node("Mul", ["d", "d"], ["d2"]),
                      h.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0)], "emb",
                     [h.make_tensor_value_info("ids", T.INT64, ["N"]),
                      h.make_tensor_value_info("t", T.FLOAT16, ["N", 4])],
                     [h.make_tensor_value_info("loss", T.FLOAT16, [])], [e])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)], ir_version=9)
    ids = np.array([1, 3, 3, 7, 1, 3, 0, 9])  # repeated tokens: several updates of one row
    return model.SerializeToString(), {"ids": ids, "t": RNG.standard_normal((8, 4)).astype(np.float16)}


def _train(model: bytes, feeds: dict, backend: str, steps: int = 3) -> tuple[list[float], np.ndarray]:
    """SGD steps of ``model`` on ``backend``: the losses and the weight."""
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", backend)
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    sess = TrainingSession(model, p, so)
    losses = [float(sess.run(["loss"], {**feeds, "Learning_Rate": LR})[0]) for _ in range(steps)]
    return losses, next(iter(sess.get_state().values()))


def test_two_unnamed_float16_scatters_in_one_graph() -> None:
    """Two unnamed combining scatters keep names of their own once rewritten (onnxruntime refuses a graph
    naming two nodes alike). Oracle: the numpy engine."""
    from onnxtrain import InferenceSession

    nodes = [h.make_node("ScatterElements", ["d", "i", "u"], ["a"], reduction="add"),
             h.make_node("ScatterElements", ["a", "i", "u"], ["y"], reduction="add")]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("d", T.FLOAT16, [4]),
                                  h.make_tensor_value_info("i", T.INT64, [2]),
                                  h.make_tensor_value_info("u", T.FLOAT16, [2])],
                     [h.make_tensor_value_info("y", T.FLOAT16, [4])])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 18)], ir_version=9).SerializeToString()
    feeds = {"d": np.array([1, 2, 3, 4], np.float16), "i": np.array([2, 0]),
             "u": np.array([8, 0.75], np.float16)}
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    got = InferenceSession(model, so).run(None, feeds)[0]
    np.testing.assert_array_equal(got, InferenceSession(model).run(None, feeds)[0])
    np.testing.assert_array_equal(got, np.array([2.5, 2, 19, 4], np.float16))


@pytest.mark.parametrize("make", [_classifier, _embedding], ids=["cross-entropy", "embedding"])
def test_float16_model_with_combining_scatters_trains_on_the_onnxruntime_backend(make) -> None:
    model, feeds = make()
    ref_losses, ref_w = _train(model, feeds, "numpy")
    losses, w = _train(model, feeds, "onnxruntime")
    assert w.dtype == np.float16
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-3)  # float16 sums in another order
    np.testing.assert_allclose(w.astype(np.float32), ref_w.astype(np.float32), rtol=5e-3, atol=2e-3)
    # the first step against float64: SGD on the loss's own gradient
    m = onnx.load_from_string(model)
    w0 = nh.to_array(m.graph.initializer[0]).astype(np.float64)
    if make is _classifier:
        x, y = feeds["x"].astype(np.float64), feeds["y"]
        z = x @ w0.T
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[np.arange(len(y)), y] -= 1
        w1 = w0 - 0.1 * (p / len(y)).T @ x
    else:
        d = w0[feeds["ids"]] - feeds["t"].astype(np.float64)
        grad = np.zeros_like(w0)
        np.add.at(grad, feeds["ids"], 2 * d / d.size)
        w1 = w0 - 0.1 * grad
    _, one = _train(model, feeds, "onnxruntime", steps=1)
    np.testing.assert_allclose(one.astype(np.float64), w1, rtol=5e-3, atol=2e-3)
