"""Value names that are not valid UTF-8 (a damaged or foreign-written file: protobuf gives them as bytes).
onnxruntime runs such models; the training paths make names from the model's, so they decode those names
with backslash escapes, the same everywhere, and train the model (the sessions crashed with internal
TypeErrors before). Oracle: the gradient of Σ(x·W) by hand, x^T·1."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.errors import Fail
from onnxtrain.ir.graphs import text_value_names
from tests.session.helpers import params

X = np.array([[1.0, -2.0, 0.5]], np.float32)
W0 = np.arange(6, dtype=np.float32).reshape(3, 2) / 4
W_TEXT = "\\xfd"  # b"\xfd" decoded with backslash escapes


def _damaged(weight: bytes = b"\xfd", hidden: bytes = b"\xfe", x: str = "x") -> bytes:
    """loss = Σ(x·W) with the weight "W" and the product "h" renamed to the given bytes in the file."""
    w = numpy_helper.from_array(W0, "W")
    nodes = [helper.make_node("MatMul", [x, "W"], ["h"], name="mm"),
             helper.make_node("ReduceSum", ["h"], ["loss"], name="rs", keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 3])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [w])
    data = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    data = data.replace(b"\x01W", b"\x01" + weight).replace(b"\x01h", b"\x01" + hidden)
    assert isinstance(onnx.load_from_string(data).graph.initializer[0].name, bytes) == (weight != b"W")
    return data


def _grad() -> np.ndarray:
    return X.T @ np.ones((1, 2), np.float32)


def test_a_training_session_trains_a_weight_whose_name_is_not_utf8() -> None:
    sess = onnxtrain.TrainingSession(_damaged(), params("SGDOptimizer"))
    loss = sess.run(["loss"], {"x": X, "Learning_Rate": np.array([0.5], np.float32)})[0]
    np.testing.assert_allclose(loss, (X @ W0).sum(), rtol=1e-6)
    state = sess.get_state()
    assert list(state) == [W_TEXT]
    np.testing.assert_allclose(state[W_TEXT], W0 - 0.5 * _grad(), rtol=1e-6)


def test_the_gradient_builder_writes_text_names_onnxruntime_runs() -> None:
    ort = pytest.importorskip("onnxruntime")
    b = onnxtrain.GradientGraphBuilder(_damaged(), {"loss"}, {W_TEXT}, "loss")
    b.build()
    m = onnx.load_from_string(b.get_model())
    onnx.checker.check_model(m, full_check=True)
    assert [o.name for o in m.graph.output][-1] == W_TEXT + "_grad"
    got = ort.InferenceSession(b.get_model(), providers=["CPUExecutionProvider"]).run(
        [W_TEXT + "_grad"], {"x": X})[0]
    np.testing.assert_allclose(got, _grad(), rtol=1e-6)


def test_generate_artifacts_and_module_train_such_a_weight(tmp_path) -> None:
    from onnxtrain.training import artifacts
    from onnxtrain.training.api import CheckpointState, Module, Optimizer

    artifacts.generate_artifacts(onnx.load_from_string(_damaged()), requires_grad=[W_TEXT],
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=str(tmp_path))
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    module = Module(str(tmp_path / "training_model.onnx"), state)
    opt = Optimizer(str(tmp_path / "optimizer_model.onnx"), module)
    opt.set_learning_rate(0.25)
    module.train()
    module(X)
    opt.step()
    np.testing.assert_allclose(state.parameters[W_TEXT].data, W0 - 0.25 * _grad(), rtol=1e-6)


def test_a_decoded_name_that_another_value_has_is_refused() -> None:
    # the input named as the damaged "h" decodes: two values would share a name
    data = _damaged(hidden=b"\xfe", x="\\xfe")
    with pytest.raises(Fail, match=r"not valid UTF-8.*'\\\\xfe' names another value"):
        onnxtrain.TrainingSession(data, params("SGDOptimizer"))


def test_a_model_of_text_names_is_returned_as_it_is() -> None:
    m = onnx.load_from_string(_damaged(b"W", b"h"))
    assert text_value_names(m) is m


def test_inference_keeps_such_names_as_bytes() -> None:
    """The inference session takes the names as protobuf gives them: an input so named is fed by its bytes."""
    data = _damaged(b"W", b"h").replace(b"\x01x", b"\x01\xfc")
    sess = onnxtrain.InferenceSession(data)
    assert [i.name for i in sess.get_inputs()] == [b"\xfc"]
    (loss,) = sess.run(None, {b"\xfc": X})
    np.testing.assert_allclose(loss, (X @ W0).sum(), rtol=1e-6)
