"""The legacy TrainingSession on the numpy engine refuses the session config entry values onnxruntime refuses,
with onnxruntime's classes, as onnxtrain's InferenceSession does (session_loading.refuse_bad_ort_entries).

The oracle: onnxruntime 1.32's InferenceSession made with the same entry in this process (1.16.3's
TrainingSession made its inference session from the same options). Before, the legacy session took these
values without a word.

A kept difference (review R2, checked with 1.16.3 in its venv, tests/ortt.py): 1.16.3's TrainingSession
refuses optimization.minimal_build_optimizations = "bogus" (InvalidArgument) and session.dynamic_block_base =
"x" (ValueError) or "99999999999" (IndexError) as 1.32 does, but takes session.kernel_dispatch_policy = "x",
session.function_expansion_*_limit = "0" and session.graph_optimizations_loop_level = "abc", entries it
does not read; onnxtrain refuses them on both engines, as onnxruntime 1.32 (its onnxruntime backend)
does."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnxtrain
import onnxtrain.capi.onnxruntime_pybind11_state as our_state
from onnxtrain import TrainingSession
from tests.session.helpers import mlp_model, params

BAD = [("optimization.minimal_build_optimizations", "bogus"), ("session.kernel_dispatch_policy", "x"),
       ("session.function_expansion_node_limit", "0"), ("session.graph_optimizations_loop_level", "abc"),
       ("session.dynamic_block_base", "x"), ("session.dynamic_block_base", "99999999999")]
TAKEN = [("session.kernel_dispatch_policy", "auto"), ("session.dynamic_block_base", "0")]


def _onnxruntime_class(key: str, value: str) -> type | None:
    """onnxtrain's mirror of the class onnxruntime raises for a session made with the entry (None: taken)."""
    g = helper.make_graph([helper.make_node("Neg", ["a"], ["b"])], "neg",
                          [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    so = ort.SessionOptions()
    so.add_session_config_entry(key, value)
    try:
        ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - the oracle's class is the answer
        return type(e) if type(e).__module__ == "builtins" else getattr(our_state, type(e).__name__)
    return None


def _session(key: str, value: str) -> TrainingSession:
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry(key, value)
    return TrainingSession(mlp_model().SerializeToString(), params("SGDOptimizer"), so)


@pytest.mark.parametrize(("key", "value"), BAD, ids=[f"{k}={v}" for k, v in BAD])
def test_refused_with_onnxruntimes_class_naming_the_entry(key: str, value: str, capsys) -> None:
    want = _onnxruntime_class(key, value)
    assert want is not None
    with pytest.raises(want, match=key.replace(".", r"\.")):
        _session(key, value)
    capsys.readouterr()


@pytest.mark.parametrize(("key", "value"), TAKEN, ids=[f"{k}={v}" for k, v in TAKEN])
def test_values_onnxruntime_takes_train(key: str, value: str) -> None:
    assert _onnxruntime_class(key, value) is None
    s = _session(key, value)
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    loss = s.run(None, {"x": x, "y": np.array([0, 1, 2, 3], np.int64),
                        "Learning_Rate": np.array([0.1], np.float32)})[0]
    assert np.isfinite(loss).all()
