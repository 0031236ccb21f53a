"""Bad onnxruntime session config entries on the onnxruntime backend raise what onnxruntime raises.

The oracle: onnxruntime 1.32's InferenceSession with the same entry (in this process). It refuses some values
when the session is made, each with its class: InvalidArgument (optimization.minimal_build_optimizations,
session.kernel_dispatch_policy, session.function_expansion_byte_limit), RuntimeException
(session.graph_optimizations_loop_level), a plain ValueError (session.dynamic_block_base), Fail
(session.qdq_matmulnbits_accuracy_level). The backend raised its EngineError (a Fail) for all of them, so a
clause catching onnxruntime's InvalidArgument (as onnxtrain's capi mirror names it) missed it. Now the error
is an EngineError and the mirror of onnxruntime's class, and names the entry."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import onnxruntime.capi.onnxruntime_pybind11_state as ort_state
import pytest
from onnx import TensorProto, helper

import onnxtrain
import onnxtrain.capi.onnxruntime_pybind11_state as our_state
from onnxtrain.engine.interface import EngineError

ENTRIES = [("optimization.minimal_build_optimizations", "bogus"), ("session.kernel_dispatch_policy", "x"),
           ("session.function_expansion_byte_limit", "x"), ("session.graph_optimizations_loop_level", "abc"),
           ("session.dynamic_block_base", "x"), ("session.qdq_matmulnbits_accuracy_level", "x")]


def _model() -> bytes:
    g = helper.make_graph([helper.make_node("Mul", ["a", "b"], ["c"])], "product",
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3]) for n in "ab"],
                          [helper.make_tensor_value_info("c", TensorProto.FLOAT, [3])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _mirror(cls: type) -> type:
    """onnxtrain's class for onnxruntime's ``cls`` (a builtin stays itself)."""
    if cls.__module__ == "builtins":
        return cls
    return getattr(our_state, cls.__name__)


@pytest.mark.parametrize(("key", "value"), ENTRIES, ids=[k for k, _ in ENTRIES])
def test_the_onnxruntime_backend_raises_onnxruntimes_class(key: str, value: str, capsys) -> None:
    so = ort.SessionOptions()
    so.add_session_config_entry(key, value)
    with pytest.raises(Exception) as theirs:  # noqa: PT011 - onnxruntime's classes differ per entry
        ort.InferenceSession(_model(), so, providers=["CPUExecutionProvider"])
    want = _mirror(type(theirs.value))
    assert type(theirs.value) in (ValueError, *(getattr(ort_state, n) for n in (
        "InvalidArgument", "RuntimeException", "Fail")))  # (the oracle's classes, as listed above)
    ours = onnxtrain.SessionOptions()
    ours.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    ours.add_session_config_entry(key, value)
    with pytest.raises(want) as got:
        onnxtrain.InferenceSession(_model(), ours)
    assert isinstance(got.value, EngineError)  # (as before: code catching onnxtrain's class still does)
    assert key in str(got.value)
    capsys.readouterr()  # (onnxruntime's EP Error banners)


def test_a_good_entry_still_loads() -> None:
    ours = onnxtrain.SessionOptions()
    ours.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    ours.add_session_config_entry("session.dynamic_block_base", "4")
    sess = onnxtrain.InferenceSession(_model(), ours)
    a = np.arange(3, dtype=np.float32)
    np.testing.assert_array_equal(sess.run(None, {"a": a, "b": a})[0], a * a)
