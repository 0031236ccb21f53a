"""Review R2: ORT_LOAD_CONFIG_FROM_MODEL=1, the options onnxruntime 1.32 drops that
test_model_config_env_warnings does not cover (it covers optimized_model_filepath, add_initializer and free
dimension overrides): profiling and a data file given in memory. Oracle: onnxruntime in this process with the
variable 1 writes no profile (end_profiling gives no file) and does not find a model's external data given
with add_external_initializers_from_files_in_memory (it looks for the file and fails); onnxtrain applies both
and must name each in its warning. The model's ort_config setting the same field silences it (both take the
model's)."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import onnxtrain

CPU = ["CPUExecutionProvider"]


def _model(config: dict | None = None) -> onnx.ModelProto:
    g = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
                          [numpy_helper.from_array(np.arange(3, dtype=np.float32), "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    if config is not None:
        helper.set_model_props(m, {"ort_config": json.dumps(config)})
    return m


def _said(make) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make()
    return [str(w.message) for w in caught if "ORT_LOAD_CONFIG_FROM_MODEL" in str(w.message)]


def test_profiling_dropped_by_onnxruntime_is_named(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("ORT_LOAD_CONFIG_FROM_MODEL", "1")
    model = _model().SerializeToString()
    so = ort.SessionOptions()
    so.enable_profiling, so.profile_file_prefix = True, str(tmp_path / "theirs")
    theirs = ort.InferenceSession(model, so, providers=CPU)
    theirs.run(None, {"x": np.zeros(3, np.float32)})
    assert theirs.end_profiling() == "" and not os.listdir(tmp_path)  # (dropped)
    ours = onnxtrain.SessionOptions()
    ours.enable_profiling, ours.profile_file_prefix = True, str(tmp_path / "ours")
    said = _said(lambda: onnxtrain.InferenceSession(model, ours))
    assert len(said) == 1 and "enable_profiling" in said[0], said
    # the model's ort_config turning profiling on: both profile, and the field is not named
    on = _model({"session_options": {"enable_profiling": 1}}).SerializeToString()
    said = _said(lambda: onnxtrain.InferenceSession(on, ours))
    assert not said or "enable_profiling" not in said[0], said


def test_a_data_file_in_memory_dropped_by_onnxruntime_is_named(monkeypatch, tmp_path) -> None:
    m = _model()
    path = str(tmp_path / "m.onnx")
    onnx.save(m, path, save_as_external_data=True, location="w.bin", size_threshold=0)
    data = (tmp_path / "w.bin").read_bytes()
    os.unlink(tmp_path / "w.bin")
    monkeypatch.setenv("ORT_LOAD_CONFIG_FROM_MODEL", "1")
    so = ort.SessionOptions()
    so.add_external_initializers_from_files_in_memory(["w.bin"], [np.frombuffer(data, np.uint8)], [len(data)])
    try:  # (onnxruntime looks for w.bin on disk: the file given in memory was dropped)
        ort.InferenceSession(path, so, providers=CPU)
        dropped = False
    except Exception:  # noqa: BLE001 - its class is not the point
        dropped = True
    assert dropped
    ours = onnxtrain.SessionOptions()
    ours.add_external_initializers_from_files_in_memory(["w.bin"], [data], [len(data)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sess = onnxtrain.InferenceSession(path, ours)
    said = [str(w.message) for w in caught if "ORT_LOAD_CONFIG_FROM_MODEL" in str(w.message)]
    assert len(said) == 1 and "add_external_initializers_from_files_in_memory" in said[0], said
    np.testing.assert_array_equal(sess.run(None, {"x": np.zeros(3, np.float32)})[0], [0, 1, 2])
