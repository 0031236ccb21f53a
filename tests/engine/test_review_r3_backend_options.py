"""Review R3 (of 349f241f, which reads session.disable_optimizers from onnxruntime's own SessionOptions
for the onnxruntime backend): onnxruntime 1.32 has no session config entry session.disable_optimizers (it
is not among the keys its library knows, and a session given it still constant-folds); its optimizers
are disabled by InferenceSession's ``disabled_optimizers`` argument only. The backend merged the
caller's entry with its own list into that config entry and passed onnxruntime its own list alone, so the
caller's disabled optimizers never reached onnxruntime. Oracle: onnxruntime 1.32's profile of the same
graph with ``disabled_optimizers=["ConstantFolding"]`` (the folded Add runs) and without (it does not)."""

from __future__ import annotations

import json

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper  # noqa: E402

import onnxtrain  # noqa: E402


def _model():
    g = helper.make_graph(
        [helper.make_node("Add", ["a", "a"], ["c"], name="fold_me"),
         helper.make_node("Add", ["x", "c"], ["y"], name="out")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [helper.make_tensor("a", TensorProto.FLOAT, [2], [1.0, 2.0])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def _nodes_run(path: str) -> set[str]:
    with open(path) as f:
        return {e["name"] for e in json.load(f) if e["cat"] == "Node"}


def _oracle(tmp_path, disabled: list[str]) -> set[str]:
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "oracle_")
    sess = ort.InferenceSession(_model().SerializeToString(), so, providers=["CPUExecutionProvider"],
                                disabled_optimizers=disabled)
    sess.run(None, {"x": np.ones(2, np.float32)})
    return _nodes_run(sess.end_profiling())


@pytest.mark.parametrize("options", ["onnxtrain", "onnxruntime"])
def test_the_callers_disabled_optimizers_reach_the_onnxruntime_backend(tmp_path, options: str) -> None:
    folded, unfolded = _oracle(tmp_path, []), _oracle(tmp_path, ["ConstantFolding"])
    assert folded != unfolded  # (the oracle tells the two apart)
    so = onnxtrain.SessionOptions() if options == "onnxtrain" else ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "ours_")
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    so.add_session_config_entry("session.disable_optimizers", "ConstantFolding")
    sess = onnxtrain.InferenceSession(_model().SerializeToString(), so)
    y = sess.run(None, {"x": np.ones(2, np.float32)})[0]
    np.testing.assert_array_equal(y, np.array([3.0, 5.0], np.float32))
    assert _nodes_run(sess.end_profiling()) == unfolded
