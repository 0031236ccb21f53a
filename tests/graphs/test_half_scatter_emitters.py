"""A float16 model's gradient scatters that add (an embedding's Gather, a cross-entropy's one-hot) in every
emitted gradient graph run in onnxruntime's inference package, whose CPU provider has no float16 kernel for
them: the GradientGraphBuilder and the legacy dumps wrote them in float32 already; generate_artifacts'
training model and `onnxtrain gradient-graph` did not (onnxruntime refused the ScatterElements/ScatterND at
load or at its first run). The gradients are checked against float64 sums of the same one-hot counts."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.cli import main
from onnxtrain.training import artifacts
from tests.graphs.emitted import check_emitted, feeds_for

ort = pytest.importorskip("onnxruntime")

W = (np.arange(15, dtype=np.float64).reshape(5, 3) / 7 - 1).astype(np.float16)
IDS = np.array([1, 3, 1, 4, 1], np.int64)


def embedding_model() -> onnx.ModelProto:
    """loss = sum(Gather(W, ids) · v): W float16 [5, 3], repeated ids (their gradients add up)."""
    v = numpy_helper.from_array(np.array([0.5, -1.0, 2.0], np.float16), "v")
    g = helper.make_graph(
        [helper.make_node("Gather", ["W", "ids"], ["rows"]), helper.make_node("Mul", ["rows", "v"], ["p"]),
         helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0)],
        "embedding", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT16, [])],
        [numpy_helper.from_array(W, "W"), v])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


X = (np.linspace(-1, 1, 12).reshape(4, 3)).astype(np.float16)
LABELS = np.array([0, 2, 4, 2], np.int64)


def cross_entropy_model() -> onnx.ModelProto:
    """loss = SoftmaxCrossEntropyLoss(x · Wᵀ, labels) with W float16 [5, 3] (its gradient's one-hot is a
    ScatterElements that adds)."""
    g = helper.make_graph(
        [helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
         helper.make_node("MatMul", ["x", "Wt"], ["logits"]),
         helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"], reduction="mean")],
        "cross_entropy",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["N", 3]),
         helper.make_tensor_value_info("labels", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT16, [])],
        [numpy_helper.from_array(W, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def expected_ce_grad() -> np.ndarray:
    """d loss / d W in float64: (softmax − one-hot)ᵀ · x / N."""
    x, w = X.astype(np.float64), W.astype(np.float64)
    z = x @ w.T
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(LABELS)), LABELS] -= 1
    return p.T @ x / len(LABELS)


def expected_grad() -> np.ndarray:
    """d loss / d W in float64: v added to each row once per occurrence of its id."""
    out = np.zeros(W.shape)
    np.add.at(out, IDS, np.array([0.5, -1.0, 2.0]))
    return out


def _ort_outputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    wanted = {i.name for i in sess.get_inputs()}
    got = sess.run(None, {k: v for k, v in feeds.items() if k in wanted})
    return dict(zip([o.name for o in sess.get_outputs()], got))


@pytest.mark.parametrize("kind", ["embedding", "cross_entropy"])
def test_artifacts_training_model_of_float16_scatters_runs_in_onnxruntime(kind: str, tmp_path) -> None:
    model, data, wanted = ((embedding_model(), {"ids": IDS}, expected_grad()) if kind == "embedding" else
                           (cross_entropy_model(), {"x": X, "labels": LABELS}, expected_ce_grad()))
    artifacts.generate_artifacts(model, requires_grad=["W"], loss=None,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=str(tmp_path))
    training = onnx.load(str(tmp_path / "training_model.onnx"))
    feeds = feeds_for(training, {**data, "W": W, "W_grad.accumulation.buffer": np.zeros_like(W),
                                 "lazy_reset_grad": np.array([True])})
    got = _ort_outputs(training, feeds)
    np.testing.assert_allclose(got["W_grad.accumulation.out"].astype(np.float64), wanted, atol=2e-3)
    check_emitted(training, feeds, f"float16 {kind} training model", tol=2e-3)


@pytest.mark.parametrize("kind", ["embedding", "cross_entropy"])
def test_gradient_graph_command_of_float16_scatters_runs_in_onnxruntime(kind: str, tmp_path) -> None:
    model, data, wanted = ((embedding_model(), {"ids": IDS}, expected_grad()) if kind == "embedding" else
                           (cross_entropy_model(), {"x": X, "labels": LABELS}, expected_ce_grad()))
    src, out = str(tmp_path / "m.onnx"), str(tmp_path / "g.onnx")
    onnx.save(model, src)
    assert main(["gradient-graph", src, "--loss", "loss", "--wrt", "W", "-o", out]) == 0
    built = onnx.load(out)
    got = _ort_outputs(built, data)
    np.testing.assert_allclose(got["W_grad"].astype(np.float64), wanted, atol=2e-3)
    check_emitted(built, data, f"float16 {kind} gradient-graph", tol=2e-3)
