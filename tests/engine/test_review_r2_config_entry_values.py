"""Review R2: the session config entry values onnxruntime 1.32 refuses when it makes a session, value by
value, on both engines (session_loading.refuse_bad_ort_entries on the numpy engine; the onnxruntime
backend's load failure, backends._as_onnxruntime_raised). Oracle: onnxruntime 1.32's InferenceSession made
with the same entry, in this process.

Found: session.dynamic_block_base past int32 (99999999999) is an IndexError in onnxruntime (std::stoi's
out_of_range; 1.16.3 and 1.19.2 alike), a ValueError on the numpy engine and a bare EngineError not naming the
entry on the onnxruntime backend; Unicode digits and spaces (Arabic-Indic digits, a no-break space), which
std::stoi does not read, were taken by the numpy engine (Python's \\d and \\s); a hexadecimal
session.function_expansion_*_limit (0x10), which onnxruntime takes, was refused."""

from __future__ import annotations

import contextlib
import io
import pickle

import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnxtrain

KEYS = ["session.function_expansion_node_limit", "session.graph_optimizations_loop_level",
        "session.dynamic_block_base"]
VALUES = ["0x10", "0X1F", "0x0", "0xg", "0x10000000000000000", "0xFFFFFFFFFFFFFFFF", "08", "\u00a03",
          "\u0663", "\uff11\uff12", "\u2003 5", "2147483648", "-2147483649", "99999999999", "\t7", "3x", ""]


def _model() -> bytes:
    g = helper.make_graph([helper.make_node("Mul", ["a", "b"], ["c"])], "product",
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3]) for n in "ab"],
                          [helper.make_tensor_value_info("c", TensorProto.FLOAT, [3])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _error(make) -> Exception | None:
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # (onnxruntime's EP Error banner)
            make()
    except Exception as e:  # noqa: BLE001 - the class is the answer
        return e
    return None


def _same_kind(ours: Exception | None, theirs: Exception | None) -> bool:
    """Whether ``ours`` is what onnxruntime raised: none for none; a builtin class itself (an instance of
    it); onnxruntime's own class by name among ours's bases."""
    if theirs is None or ours is None:
        return theirs is ours
    if type(theirs).__module__ == "builtins":
        return isinstance(ours, type(theirs))
    return type(theirs).__name__ in {c.__name__ for c in type(ours).__mro__}


CASES = [(k, v) for k in KEYS for v in VALUES]


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
@pytest.mark.parametrize(("key", "value"), CASES, ids=[f"{k.split('.')[-1]}={v!r}" for k, v in CASES])
def test_each_value_as_onnxruntime(key: str, value: str, backend: str) -> None:
    so = ort.SessionOptions()
    so.add_session_config_entry(key, value)
    theirs = _error(lambda: ort.InferenceSession(_model(), so, providers=["CPUExecutionProvider"]))
    opts = onnxtrain.SessionOptions()
    opts.add_session_config_entry(key, value)
    if backend != "numpy":
        opts.add_session_config_entry("onnxtrain.backend", backend)
    ours = _error(lambda: onnxtrain.InferenceSession(_model(), opts))
    assert _same_kind(ours, theirs), (ours, theirs)
    if ours is not None:
        assert key in str(ours), str(ours)
        again = pickle.loads(pickle.dumps(ours))  # (an error sent to another process)
        assert type(again) is type(ours) and str(again) == str(ours)


def test_the_legacy_session_refuses_a_block_base_past_int32_as_an_index_error() -> None:
    from tests.session.helpers import mlp_model, params

    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("session.dynamic_block_base", "99999999999")
    with pytest.raises(IndexError, match=r"session\.dynamic_block_base"):
        onnxtrain.TrainingSession(mlp_model().SerializeToString(), params("SGDOptimizer"), so)
