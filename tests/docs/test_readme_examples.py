"""The README's Python examples run as written, given the names they assume (a model, its data)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.session.helpers import mlp_model

README = Path(__file__).resolve().parents[2] / "README.md"


def block(marker: str) -> str:
    """The ```python block of the README that contains ``marker``."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"{len(found)} README python blocks contain {marker!r}"
    return found[0]


def inference_model() -> onnx.ModelProto:
    """The test MLP without its loss: x → logits."""
    model = mlp_model()
    del model.graph.node[-1]
    del model.graph.input[1]
    del model.graph.output[0]
    return model


def batch(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    return rng.standard_normal((6, 8)).astype(np.float32), rng.integers(0, 4, 6).astype(np.int64)


def run_example(marker: str, files: dict[str, onnx.ModelProto] | None = None, **names) -> dict:
    """Save ``files`` in the working directory, run the README block holding ``marker`` with ``names``
    defined, and return its namespace."""
    for path, model in (files or {}).items():
        onnx.save(model, path)
    env = dict(names)
    exec(block(marker), env)  # noqa: S102 - the README's own code
    return env


LEGACY = 'ort.TrainingSession("model_with_loss.onnx", p)'


def test_legacy_session_example(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    x, y = batch(np.random.default_rng(0))
    env = run_example(LEGACY, {"model_with_loss.onnx": mlp_model()}, x=x, y=y)
    assert np.isfinite(env["loss"])
    # "weights and optimizer state by name": the weights and Adam's moments and step counts, after one step
    assert {"W1", "Moment_1_W1", "Moment_2_W1", "Update_Count_W1"} <= set(env["state"])
    assert int(np.asarray(env["state"]["Update_Count_W1"]).reshape(-1)[0]) == 2  # from 1, as in onnxruntime


def test_gradient_graph_builder_example(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "fc1.weight"),
             numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "fc1.bias")]
    nodes = [helper.make_node("Gemm", ["x", "fc1.weight", "fc1.bias"], ["h"], transB=1),
             helper.make_node("ReduceSum", ["h"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "fc", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    run_example("GradientGraphBuilder(model_bytes", model_bytes=model.SerializeToString())
    outputs = [o.name for o in onnx.load("model_with_grads.onnx").graph.output]
    assert outputs == ["loss", "fc1.bias_grad", "fc1.weight_grad"]  # the model's outputs, then the set sorted


def test_on_device_example(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(2)
    env = run_example("artifacts.generate_artifacts(model", model=inference_model(),
                      params=["W1", "b1", "W2", "b2"], batches=[batch(rng) for _ in range(3)])
    assert np.ndim(env["loss"]) == 0 and np.isfinite(env["loss"])
    assert os.path.exists("model.onnx") and os.path.exists("ckpt")
    assert [o.name for o in onnx.load("model.onnx").graph.output] == ["logits"]


@pytest.mark.parametrize("marker", ["from onnxtrain import TrainingParameters, TrainingSession, RunOptions"])
def test_migration_imports_resolve(marker: str) -> None:
    exec(block(marker).replace("from onnxruntime import", "# from onnxruntime import"), {})  # noqa: S102


def test_mixed_precision_example(tmp_path, monkeypatch) -> None:
    """The mixed-precision block continues the legacy session's (``ort``, ``p``, ``lr`` from there)."""
    monkeypatch.chdir(tmp_path)
    x, y = batch(np.random.default_rng(3))
    env = run_example(LEGACY, {"model_with_loss.onnx": mlp_model()}, x=x, y=y,
                      model_bytes=mlp_model().SerializeToString())
    exec(block("p.use_mixed_precision = True"), env)  # noqa: S102 - the README's code
    assert np.isfinite(env["loss"]) and bool(env["finite"])


def test_onnxruntime_backend_example() -> None:
    pytest.importorskip("onnxruntime")
    import onnxtrain
    from tests.session.helpers import params

    env = run_example('add_session_config_entry("onnxtrain.backend", "onnxruntime")', onnxtrain=onnxtrain,
                      model_bytes=mlp_model().SerializeToString(), p=params())
    x, y = batch(np.random.default_rng(4))
    (loss,) = env["sess"].run(["loss"], {"x": x, "y": y, "Learning_Rate": np.array([0.1], np.float32)})
    assert np.isfinite(loss)


def test_inference_example(tmp_path, monkeypatch) -> None:
    import onnxtrain

    monkeypatch.chdir(tmp_path)
    x, _ = batch(np.random.default_rng(5))
    env = run_example('onnxtrain.InferenceSession("model.onnx"', {"model.onnx": inference_model()},
                      onnxtrain=onnxtrain, x=x)
    assert env["logits"].shape == (6, 4) and env["sess"].peak_bytes > 0


def test_batch_split_process_example(tmp_path, monkeypatch) -> None:
    """The child-process batch split: the README's block runs as written, and its outputs are an unsplit
    session's (to the split's tolerance; where the process cannot fork, the halves run on threads)."""
    import onnxtrain

    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(6)
    inits = [numpy_helper.from_array(rng.standard_normal((64, 256)).astype(np.float32), "W1"),
             numpy_helper.from_array(rng.standard_normal((256, 10)).astype(np.float32), "W2")]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["a"]), helper.make_node("Tanh", ["a"], ["h"]),
             helper.make_node("MatMul", ["h", "W2"], ["y"])]
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])
    y_info = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10])
    g = helper.make_graph(nodes, "encoder", [x_info], [y_info], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    env = run_example('"onnxtrain.batch_split", "process"', {"encoder.onnx": model}, onnxtrain=onnxtrain)
    x = rng.standard_normal((4096, 64)).astype(np.float32)  # 4 MiB of activations: large enough to split
    whole = onnxtrain.SessionOptions()
    whole.add_session_config_entry("onnxtrain.batch_split", "0")
    (want,) = onnxtrain.InferenceSession("encoder.onnx", whole).run(None, {"x": x})
    for _ in range(2):  # the first run of a batch size checks the halves against the whole run
        (got,) = env["sess"].run(None, {"x": x})
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
