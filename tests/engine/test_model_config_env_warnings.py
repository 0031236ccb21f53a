"""ORT_LOAD_CONFIG_FROM_MODEL=1 and the warnings of session config entries the numpy engine does not apply.

The oracle, onnxruntime 1.32 in this process: with the variable 1 its InferenceSession drops the caller's
session config entries (get_session_config_entry no longer finds them) whatever the model's ort_config
says, graph_optimization_level 0, 2 or none at all; so optimization.enable_gelu_approximation and
session.set_denormal_as_zero change nothing there. onnxtrain's numpy session warned that it did not apply
them (its values would differ from onnxruntime's): spurious. With the variable 0 onnxruntime applies them and
the warning stays."""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnxtrain
from tests.engine.test_review_r1_sessions import erf_gelu_model

F = TensorProto.FLOAT
X = np.linspace(-4, 4, 200).astype(np.float32)
CPU = ["CPUExecutionProvider"]


def _gelu_model(config: dict | None) -> bytes:
    """The erf GELU of x (which enable_gelu_approximation replaces), with ``config`` as its ort_config
    metadata."""
    m = erf_gelu_model()
    if config is not None:
        helper.set_model_props(m, {"ort_config": json.dumps(config)})
    return m.SerializeToString()


def _ours(model: bytes, key: str) -> tuple[np.ndarray, list[str]]:
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry(key, "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sess = onnxtrain.InferenceSession(model, so)
    return sess.run(None, {"x": X})[0], [str(w.message) for w in caught if key in str(w.message)]


def _theirs(model: bytes, key: str | None) -> np.ndarray:
    so = ort.SessionOptions()
    if key:
        so.add_session_config_entry(key, "1")
    return ort.InferenceSession(model, so, providers=CPU).run(None, {"x": X})[0]


GELU = "optimization.enable_gelu_approximation"
CONFIGS = [None, {"session_options": {"graph_optimization_level": 0}},
           {"session_options": {"graph_optimization_level": 2}}]


@pytest.mark.parametrize("config", CONFIGS, ids=["no_ort_config", "level0", "level2"])
def test_gelu_approximation_not_warned_when_the_model_config_is_loaded(config, monkeypatch) -> None:
    monkeypatch.setenv("ORT_LOAD_CONFIG_FROM_MODEL", "1")
    model = _gelu_model(config)
    exact = _theirs(model, None)
    np.testing.assert_array_equal(_theirs(model, GELU), exact)  # onnxruntime does not apply it
    got, warned = _ours(model, GELU)
    assert warned == []
    np.testing.assert_allclose(got, exact, rtol=1e-6, atol=1e-6)


def test_gelu_approximation_still_warned_without_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("ORT_LOAD_CONFIG_FROM_MODEL", "0")
    model = _gelu_model({"session_options": {"graph_optimization_level": 0}})  # (not read)
    assert np.abs(_theirs(model, GELU) - _theirs(model, None)).max() > 1e-4  # onnxruntime applies it
    assert len(_ours(model, GELU)[1]) == 1


def _add_model(config: dict | None) -> bytes:
    """y = x + w (w an initializer of one 0, x of the free dim n), with ``config`` as its ort_config."""
    from onnx import numpy_helper

    g = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", F, ["n"])],
                          [helper.make_tensor_value_info("y", F, ["n"])],
                          [numpy_helper.from_array(np.zeros(1, np.float32), "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    if config is not None:
        helper.set_model_props(m, {"ort_config": json.dumps(config)})
    return m.SerializeToString()


def _set_options(lib, folder):
    so = lib.SessionOptions()
    so.intra_op_num_threads = 2
    so.optimized_model_filepath = str(folder / f"{lib.__name__}.onnx")
    so.add_initializer("w", ort.OrtValue.ortvalue_from_numpy(np.full(1, 5.0, np.float32)))
    so.add_free_dimension_override_by_name("n", 3)
    return so


def test_options_onnxruntime_drops_with_the_variable_are_warned_of(monkeypatch, tmp_path) -> None:
    """The oracle: onnxruntime with the variable 1 drops the caller's add_initializer (y = x + 0, not + 5),
    free dimension override, threads and optimized_model_filepath (no file) but those the model's ort_config
    sets. onnxtrain applies them and must say which onnxruntime drops."""
    monkeypatch.setenv("ORT_LOAD_CONFIG_FROM_MODEL", "1")
    model = _add_model({"session_options": {"intra_op_num_threads": 1}})
    x = np.zeros(3, np.float32)
    theirs = ort.InferenceSession(model, _set_options(ort, tmp_path), providers=CPU)
    np.testing.assert_array_equal(theirs.run(None, {"x": x})[0], x)  # the weight override dropped
    assert theirs.get_inputs()[0].shape == ["n"] and not (tmp_path / "onnxruntime.onnx").exists()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = onnxtrain.InferenceSession(model, _set_options(onnxtrain, tmp_path))
    said = [str(w.message) for w in caught if "ORT_LOAD_CONFIG_FROM_MODEL" in str(w.message)]
    assert len(said) == 1, said
    for name in ("optimized_model_filepath", "add_initializer", "free dimension overrides"):
        assert name in said[0]
    assert "intra_op_num_threads" not in said[0]  # (the model's ort_config sets it: both take the model's)
    np.testing.assert_array_equal(ours.run(None, {"x": x})[0], x + 5)  # (applied, as the warning says)


@pytest.mark.parametrize("variable", ["0", "1"])
def test_no_such_warning_without_options_or_without_the_variable(variable, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("ORT_LOAD_CONFIG_FROM_MODEL", variable)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        options = None if variable == "1" else _set_options(onnxtrain, tmp_path)
        onnxtrain.InferenceSession(_add_model(None), options)
    assert not [w for w in caught if "ORT_LOAD_CONFIG_FROM_MODEL" in str(w.message)]
