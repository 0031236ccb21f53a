"""The SessionOptions that shape the loaded model reach the legacy TrainingSession as they reach an
InferenceSession (legacy onnxruntime applied them in the inference session its training session derived
from): ``add_initializer`` sets a weight's starting value, ``add_free_dimension_override_by_name`` fixes a
dim of the inputs, and config entry ``session.model_external_initializers_file_folder_path`` finds the
external data of a model given as bytes. The TrainingSession ignored all three (the first silently).
Oracle: plain onnxruntime's inference session with the same options, and the SGD step's rule."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnxtrain
from onnxtrain.errors import InvalidArgument
from tests.session.helpers import mlp_model, params

LR = 0.1


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"x": rng.standard_normal((5, 8)).astype(np.float32), "y": np.array([0, 1, 2, 3, 1])}


def test_add_initializer_is_the_starting_value_of_the_weight() -> None:
    model = mlp_model().SerializeToString()
    b1 = np.linspace(-1, 1, 16).astype(np.float32)
    ort_so, so = ort.SessionOptions(), onnxtrain.SessionOptions()
    held = ort.OrtValue.ortvalue_from_numpy(b1)  # onnxruntime reads the value's memory: keep it alive
    ort_so.add_initializer("b1", held)
    so.add_initializer("b1", onnxtrain.OrtValue.ortvalue_from_numpy(b1.copy()))
    want = ort.InferenceSession(model, ort_so, providers=["CPUExecutionProvider"]).run(["loss"], _feeds())[0]
    s = onnxtrain.TrainingSession(model, params(set_gradients_as_graph_outputs=True), so)
    assert not np.allclose(want, ort.InferenceSession(model, providers=["CPUExecutionProvider"])
                           .run(["loss"], _feeds())[0])  # the override changes the loss
    np.testing.assert_array_equal(s.get_state()["b1"], b1)
    fetches = ["loss", "b1_grad"]
    loss, grad = s.run(fetches, {**_feeds(), "Learning_Rate": np.array([LR], np.float32)})
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    np.testing.assert_allclose(s.get_state()["b1"], b1 - LR * grad, rtol=1e-6, atol=1e-7)


def test_a_free_dimension_override_fixes_the_training_inputs() -> None:
    model = mlp_model().SerializeToString()
    ort_so, so = ort.SessionOptions(), onnxtrain.SessionOptions()
    ort_so.add_free_dimension_override_by_name("N", 5)
    so.add_free_dimension_override_by_name("N", 5)
    want = {i.name: i.shape for i in ort.InferenceSession(model, ort_so, providers=["CPUExecutionProvider"])
            .get_inputs()}
    s = onnxtrain.TrainingSession(model, params(set_gradients_as_graph_outputs=True), so)
    got = {i.name: i.shape for i in s.get_inputs()}
    assert want == {"x": [5, 8], "y": [5]}
    assert {k: got[k] for k in want} == want
    feeds = {k: v[:3] for k, v in _feeds().items()}
    with pytest.raises(InvalidArgument, match="x"):
        s.run(["loss"], {**feeds, "Learning_Rate": np.array([LR], np.float32)})


def test_external_data_of_a_model_given_as_bytes_is_found_in_the_configured_folder(tmp_path) -> None:
    folder = tmp_path / "weights"
    folder.mkdir()
    onnx.save(mlp_model(), str(folder / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="w.bin", size_threshold=0)
    data = (folder / "m.onnx").read_bytes()
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("session.model_external_initializers_file_folder_path", os.fspath(folder))
    s = onnxtrain.TrainingSession(data, params(set_gradients_as_graph_outputs=True), so)
    want = ort.InferenceSession(mlp_model().SerializeToString(), providers=["CPUExecutionProvider"])
    loss = s.run(["loss"], {**_feeds(), "Learning_Rate": np.array([0.0], np.float32)})[0]
    np.testing.assert_allclose(loss, want.run(["loss"], _feeds())[0], rtol=1e-6)
