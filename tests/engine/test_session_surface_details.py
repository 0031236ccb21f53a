"""Details of the inference surface checked against plain onnxruntime: execution_mode, execution_order's type,
duplicate providers, get_session_options as a copy, profile file names, IOBinding.get_outputs before a run,
an unknown element type, and an optimized-model path ending in .ort."""

from __future__ import annotations

import os
import re
import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper

import onnxtrain

ort = pytest.importorskip("onnxruntime")


def _relu() -> bytes:
    vi = helper.make_tensor_value_info
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [vi("x", TensorProto.FLOAT, [2])],
                          [vi("y", TensorProto.FLOAT, [2])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9).SerializeToString()


def _messages(caught) -> list[str]:
    return [str(w.message) for w in caught]


def test_parallel_execution_mode_reaches_onnxruntime_and_warns_on_the_numpy_engine():
    so = onnxtrain.SessionOptions()
    so.execution_mode = onnxtrain.ExecutionMode.ORT_PARALLEL
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        onnxtrain.InferenceSession(_relu(), so)
    assert any("execution_mode = ORT_PARALLEL has no effect" in m for m in _messages(caught))
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    sess = onnxtrain.InferenceSession(_relu(), so)
    sess.run(None, {"x": np.ones(2, np.float32)})
    inner = sess._plan._session.get_session_options()
    assert inner.execution_mode == ort.ExecutionMode.ORT_PARALLEL


@pytest.mark.parametrize("bad", ["PRIORITY_BASD", 7, 1.5])
def test_execution_order_of_the_wrong_kind_is_a_type_error(bad):
    with pytest.raises(TypeError):
        ort.SessionOptions().execution_order = bad
    so = onnxtrain.SessionOptions()
    with pytest.raises(TypeError, match="execution_order"):
        so.execution_order = bad
    so.execution_order = ort.ExecutionOrder.PRIORITY_BASED  # onnxruntime's member is taken by name
    assert so.execution_order == onnxtrain.ExecutionOrder.PRIORITY_BASED


def test_a_provider_listed_twice_is_kept_once_with_a_warning():
    twice = ["CPUExecutionProvider"] * 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sess = onnxtrain.InferenceSession(_relu(), providers=twice)
    assert sess.get_providers() == ort.InferenceSession(_relu(), providers=twice).get_providers()
    assert any("duplicate provider" in m for m in _messages(caught))


def test_session_options_returned_are_a_copy(tmp_path, monkeypatch):
    """Turning profiling off on what get_session_options returns does not lose the session's trace (as in
    onnxruntime, whose session keeps its own options)."""
    monkeypatch.chdir(tmp_path)
    so = onnxtrain.SessionOptions()
    so.enable_profiling = True
    sess = onnxtrain.InferenceSession(_relu(), so)
    sess.get_session_options().enable_profiling = False
    sess.run(None, {"x": np.ones(2, np.float32)})
    path = sess.end_profiling()
    assert path and os.path.isfile(path)
    # onnxruntime's names: <prefix>_<date>_<time>_<three-digit milliseconds>.json
    assert re.search(r"_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d{3}\.json$", path), path


def test_iobinding_outputs_before_a_run_are_the_bound_values():
    for mod in (ort, onnxtrain):
        sess = mod.InferenceSession(_relu(), providers=["CPUExecutionProvider"])
        binding = sess.io_binding()
        value = mod.OrtValue.ortvalue_from_shape_and_type([2], np.float32)
        binding.bind_ortvalue_output("y", value)
        got = binding.get_outputs()
        assert len(got) == 1, mod.__name__
        binding.bind_cpu_input("x", np.array([-1.0, 2.0], np.float32))
        sess.run_with_iobinding(binding)
        np.testing.assert_array_equal(binding.get_outputs()[0].numpy(), [0.0, 2.0])


def test_an_unknown_element_type_number_is_a_runtime_error():
    with pytest.raises(RuntimeError):
        ort.OrtValue.ortvalue_from_shape_and_type([2], 999)
    with pytest.raises(RuntimeError, match="999"):
        onnxtrain.OrtValue.ortvalue_from_shape_and_type([2], 999)


def test_an_ort_named_optimized_model_path_warns_that_it_gets_onnx(tmp_path):
    so = onnxtrain.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "model.ort")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        onnxtrain.InferenceSession(_relu(), so)
    assert any("not onnxruntime's ORT format" in m for m in _messages(caught))
    with open(tmp_path / "model.ort", "rb") as f:
        assert f.read(8)[4:8] != b"ORTM"  # an ONNX protobuf, as the warning says


def test_an_optimized_model_path_that_is_a_folder_names_the_option_and_the_folder(tmp_path):
    """onnxruntime refuses it at creation with a RuntimeError ("SystemError : 21"); onnxtrain's error named a
    temporary beside the folder."""
    so = onnxtrain.SessionOptions()
    so.optimized_model_filepath = str(tmp_path)
    with pytest.raises(IsADirectoryError, match="SessionOptions.optimized_model_filepath") as e:
        onnxtrain.InferenceSession(_relu(), so)
    assert e.value.filename == str(tmp_path) and isinstance(e.value, RuntimeError)
    ort_options = ort.SessionOptions()
    ort_options.optimized_model_filepath = str(tmp_path)
    with pytest.raises(RuntimeError):
        ort.InferenceSession(_relu(), ort_options, providers=["CPUExecutionProvider"])
