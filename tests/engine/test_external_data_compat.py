"""Models whose tensors live in external files load as onnxruntime (side by side, the oracle) loads them:
through symbolic links (a Hugging Face cache: the model and its data links into a blobs folder; onnx's
loader refuses links), and from bytes with the data's folder given as the session config entry
``session.model_external_initializers_file_folder_path`` (or the working directory); a location that
leaves the folder is refused."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain


def _save(folder, name: str = "model.onnx") -> onnx.ModelProto:
    w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(3, 2), "W")
    g = helper.make_graph([helper.make_node("Mul", ["X", "W"], ["Y"])], "g",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, [3, 2])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [3, 2])], [w])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save_model(model, str(folder / name), save_as_external_data=True, location="data.bin",
                    size_threshold=0)
    return model


X = np.ones((3, 2), np.float32)
WANT = np.arange(6, dtype=np.float32).reshape(3, 2)


def test_symbolic_links_to_the_model_and_its_data(tmp_path) -> None:
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "v1"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    _save(blobs)
    os.rename(blobs / "model.onnx", blobs / "guid1")
    os.rename(blobs / "data.bin", blobs / "guid2")
    os.symlink(blobs / "guid1", snapshot / "model.onnx")
    os.symlink(blobs / "guid2", snapshot / "data.bin")
    path = str(snapshot / "model.onnx")
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"X": X})[0]
    np.testing.assert_array_equal(want, WANT)
    np.testing.assert_array_equal(onnxtrain.InferenceSession(path).run(None, {"X": X})[0], want)


def test_bytes_with_external_data_read_from_the_given_folder(tmp_path, monkeypatch) -> None:
    (tmp_path / "m").mkdir()
    _save(tmp_path / "m")
    data = (tmp_path / "m" / "model.onnx").read_bytes()
    monkeypatch.chdir(tmp_path)  # not where the data is
    for lib in (ort, onnxtrain):
        with pytest.raises(Exception, match="data"):
            lib.InferenceSession(data, providers=["CPUExecutionProvider"])
        so = lib.SessionOptions()
        key = "session.model_external_initializers_file_folder_path"
        so.add_session_config_entry(key, str(tmp_path / "m"))
        y = lib.InferenceSession(data, so, providers=["CPUExecutionProvider"]).run(None, {"X": X})[0]
        np.testing.assert_array_equal(y, WANT, err_msg=lib.__name__)


def test_a_location_outside_the_folder_is_refused(tmp_path) -> None:
    (tmp_path / "m").mkdir()
    _save(tmp_path / "m")
    model = onnx.load(str(tmp_path / "m" / "model.onnx"), load_external_data=False)
    for e in model.graph.initializer[0].external_data:
        if e.key == "location":
            e.value = "../m/data.bin"
    onnx.save_model(model, str(tmp_path / "m" / "escape.onnx"))
    with pytest.raises(RuntimeError, match=r"outside the folder"):
        onnxtrain.InferenceSession(str(tmp_path / "m" / "escape.onnx"))
