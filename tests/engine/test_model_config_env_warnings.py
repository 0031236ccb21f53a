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

F = TensorProto.FLOAT
X = np.linspace(-4, 4, 200).astype(np.float32)
CPU = ["CPUExecutionProvider"]


def _gelu_model(config: dict | None) -> bytes:
    """torch's export of the erf GELU of x (which enable_gelu_approximation replaces), with ``config`` as
    its ort_config metadata."""
    consts = [helper.make_tensor(n, F, [], [v]) for n, v in (("s", 2 ** 0.5), ("one", 1.0), ("half", 0.5))]
    nodes = [helper.make_node("Div", ["x", "s"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["f"]), helper.make_node("Mul", ["x", "f"], ["g"]),
             helper.make_node("Mul", ["g", "half"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [200])],
                          [helper.make_tensor_value_info("y", F, [200])], consts)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
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
