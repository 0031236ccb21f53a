"""Bad onnxruntime session config entries on the onnxruntime backend raise what onnxruntime raises.

The oracle: onnxruntime 1.32's InferenceSession with the same entry (in this process). It refuses some values
when the session is made, each with its class: InvalidArgument (optimization.minimal_build_optimizations,
session.kernel_dispatch_policy, session.function_expansion_byte_limit), RuntimeException
(session.graph_optimizations_loop_level), a plain ValueError (session.dynamic_block_base), Fail
(session.qdq_matmulnbits_accuracy_level). The backend raised its EngineError (a Fail) for all of them, so a
clause catching onnxruntime's InvalidArgument (as onnxtrain's capi mirror names it) missed it. Now the error
is an EngineError and the mirror of onnxruntime's class, and names the entry.

The numpy engine, which reads none of these entries, took them all without a word; it now refuses the same
values with the same classes (but session.qdq_matmulnbits_accuracy_level, whose parse rules it does not
copy), and takes the values onnxruntime takes. With ORT_LOAD_CONFIG_FROM_MODEL=1 onnxruntime drops the
caller's entries and refuses none of them (nor session.disable_cpu_ep_fallback = "1"): neither engine does."""

from __future__ import annotations

import pickle

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
    again = pickle.loads(pickle.dumps(got.value))  # (an error sent to another process: MPI, a pool)
    assert type(again) is type(got.value) and str(again) == str(got.value)
    capsys.readouterr()  # (onnxruntime's EP Error banners)


NUMPY_ENTRIES = [e for e in ENTRIES if e[0] != "session.qdq_matmulnbits_accuracy_level"] + [
    ("session.function_expansion_node_limit", "0"), ("session.kernel_dispatch_policy", "Auto"),
    ("optimization.minimal_build_optimizations", "save"), ("session.graph_optimizations_loop_level", ""),
    ("session.dynamic_block_base", "99999999999")]


def _oracle_class(key: str, value: str) -> type | None:
    """onnxtrain's mirror of the class onnxruntime raises making a session with the entry (None: it takes
    it)."""
    so = ort.SessionOptions()
    so.add_session_config_entry(key, value)
    try:
        ort.InferenceSession(_model(), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - the oracle's class is the answer
        return _mirror(type(e))  # (onnxruntime's IndexError for a number past int32 stays an IndexError)
    return None


@pytest.mark.parametrize(("key", "value"), NUMPY_ENTRIES, ids=[f"{k}={v}" for k, v in NUMPY_ENTRIES])
def test_the_numpy_engine_refuses_them_with_onnxruntimes_class(key: str, value: str, capsys) -> None:
    want = _oracle_class(key, value)
    assert want is not None
    ours = onnxtrain.SessionOptions()
    ours.add_session_config_entry(key, value)
    with pytest.raises(want, match=key.replace(".", r"\.")):
        onnxtrain.InferenceSession(_model(), ours)
    capsys.readouterr()


TAKEN = [("optimization.minimal_build_optimizations", "apply"), ("session.kernel_dispatch_policy", "auto"),
         ("session.function_expansion_byte_limit", "12"), ("session.graph_optimizations_loop_level", "3x"),
         ("session.graph_optimizations_loop_level", " -1"), ("session.dynamic_block_base", "0")]


@pytest.mark.parametrize(("key", "value"), TAKEN, ids=[f"{k}={v}" for k, v in TAKEN])
def test_values_onnxruntime_takes_are_taken(key: str, value: str) -> None:
    assert _oracle_class(key, value) is None
    ours = onnxtrain.SessionOptions()
    ours.add_session_config_entry(key, value)
    a = np.arange(3, dtype=np.float32)
    np.testing.assert_array_equal(onnxtrain.InferenceSession(_model(), ours).run(None, {"a": a, "b": a})[0],
                                  a * a)


@pytest.mark.parametrize(("key", "value"), [*ENTRIES[:2], ("session.disable_cpu_ep_fallback", "1")],
                         ids=["minimal_build", "dispatch", "no_cpu_fallback"])
def test_none_refused_when_the_model_config_is_loaded(key: str, value: str, monkeypatch) -> None:
    monkeypatch.setenv("ORT_LOAD_CONFIG_FROM_MODEL", "1")
    assert _oracle_class(key, value) is None
    ours = onnxtrain.SessionOptions()
    ours.add_session_config_entry(key, value)
    onnxtrain.InferenceSession(_model(), ours, providers=["CPUExecutionProvider"])


def test_a_good_entry_still_loads() -> None:
    ours = onnxtrain.SessionOptions()
    ours.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    ours.add_session_config_entry("session.dynamic_block_base", "4")
    sess = onnxtrain.InferenceSession(_model(), ours)
    a = np.arange(3, dtype=np.float32)
    np.testing.assert_array_equal(sess.run(None, {"a": a, "b": a})[0], a * a)
