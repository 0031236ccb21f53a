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


# onnxruntime 1.32's session config keys for a CPU session that session_loading.ORT_SESSION_KEYS (349f241f)
# left out (its library holds each name; those of other providers, EP context models, compiling and MoE
# offload aside): an entry of onnxruntime's own SessionOptions under one of them was dropped by the backend
_LEFT_OUT = ["session.intra_op.spin_backoff_max", "session.inter_op.spin_backoff_max",
             "session.function_expansion_byte_limit",
             "session.function_expansion_node_limit",
             "session.debug_layout_transformation", "session.strict_workspace_verification",
             "session.use_external_initializer_file_buffers_directly", "session.external_data_loader.threads",
             "session.external_data_loader.min_size_bytes", "mlas.disable_kleidiai", "mlas.use_lut_gemm",
             "mlas.qnbit.force_fp32", "mlas.nchwc_depthwise_sliding", "ep.cpu.qmoe_deferred_scale"]


@pytest.mark.parametrize("key, bad", [("session.kernel_dispatch_policy", "fastest"),
                                      ("session.gqa_value_layout", "NHSB"),
                                      ("session.max_shape_override", "x")])
def test_onnxruntimes_own_options_entries_of_its_other_keys_reach_the_backend(key: str, bad: str) -> None:
    """onnxruntime 1.32 (the oracle, the very same options object) refuses these values of its keys; the
    backend, given onnxruntime's options, dropped the entry and made the session."""
    so = ort.SessionOptions()
    so.add_session_config_entry(key, bad)
    with pytest.raises(Exception, match=key.split(".", 1)[1]):  # noqa: PT011 - onnxruntime's own classes
        ort.InferenceSession(_model().SerializeToString(), so, providers=["CPUExecutionProvider"])
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    with pytest.raises(Exception, match=key.split(".", 1)[1]):  # noqa: PT011
        onnxtrain.InferenceSession(_model().SerializeToString(), so)


def test_onnxruntimes_own_options_entries_of_its_cpu_keys_reach_the_backends_session() -> None:
    so = ort.SessionOptions()
    want = {**dict.fromkeys(_LEFT_OUT, "1"), "session.kernel_dispatch_policy": "auto",
            "session.gqa_value_layout": "BNSH"}
    for key, value in want.items():
        so.add_session_config_entry(key, value)
    ort.InferenceSession(_model().SerializeToString(), so, providers=["CPUExecutionProvider"])  # (takes them)
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    sess = onnxtrain.InferenceSession(_model().SerializeToString(), so)
    theirs = sess._plan._session.get_session_options()
    got = {}
    for key in want:
        try:
            got[key] = theirs.get_session_config_entry(key)
        except RuntimeError:  # (not set)
            got[key] = None
    assert got == want
