"""Names a ported script calls before or beside its sessions, side by side with onnxruntime 1.32 (the
oracle): telemetry switches, ``has_collective_ops``, the allocator-sharing classes, the names of
``capi._pybind_state``, and the rest of OrtValue's surface. Each raised AttributeError or TypeError before."""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper

import onnxtrain

LIBS = [pytest.param(onnxruntime, id="onnxruntime"), pytest.param(onnxtrain, id="onnxtrain")]


def _relu() -> bytes:
    vi = helper.make_tensor_value_info
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [vi("x", TensorProto.FLOAT, [2, 3])],
                          [vi("y", TensorProto.FLOAT, [2, 3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    return m.SerializeToString()


@pytest.mark.parametrize("lib", LIBS)
def test_module_level_switches(lib: Any) -> None:
    assert lib.disable_telemetry_events() is None
    assert lib.enable_telemetry_events() is None
    assert lib.has_collective_ops() is False


@pytest.mark.parametrize("lib", LIBS)
def test_a_shared_cpu_arena_is_registered_and_sessions_run(lib: Any) -> None:
    info = lib.OrtMemoryInfo("Cpu", lib.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, lib.OrtMemType.DEFAULT)
    assert info.name == "Cpu" and info.device_id == 0
    lib.create_and_register_allocator(info, lib.OrtArenaCfg(0, -1, -1, -1))
    cfg = lib.OrtArenaCfg({"max_mem": 1 << 20, "arena_extend_strategy": 1})
    assert (cfg.max_mem, cfg.arena_extend_strategy) == (1 << 20, 1)
    so = lib.SessionOptions()
    so.add_session_config_entry("session.use_env_allocators", "1")
    x = np.array([[-1, 2, -3], [4, -5, 6]], np.float32)
    y = lib.InferenceSession(_relu(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(y, np.maximum(x, 0))


def test_the_enums_have_onnxruntimes_values() -> None:
    for name in ("OrtAllocatorType", "OrtMemType"):
        ours, theirs = getattr(onnxtrain, name), getattr(onnxruntime, name)
        assert {k: int(v) for k, v in ours.__members__.items()} == \
            {k: int(v) for k, v in theirs.__members__.items()}, name


@pytest.mark.parametrize("lib", ["onnxruntime", "onnxtrain"])
def test_pybind_state_names(lib: str) -> None:
    C = importlib.import_module(f"{lib}.capi._pybind_state")
    assert C.set_seed(3) is None
    assert type(C.get_default_session_options()).__name__ == "SessionOptions"
    sess = C.InferenceSession if lib == "onnxtrain" else onnxruntime.InferenceSession
    s = sess(_relu(), providers=["CPUExecutionProvider"])
    assert isinstance(s.get_inputs()[0], C.NodeArg)
    assert isinstance(s.get_modelmeta(), C.ModelMetadata)


@pytest.mark.parametrize("lib", LIBS)
def test_ortvalue_keywords_and_queries(lib: Any) -> None:
    x = np.ones((2, 3), np.float32)
    v = lib.OrtValue.ortvalue_from_numpy(x, "cpu", 0, vendor_id=-1)
    assert v.shape() == [2, 3] and v.is_sparse_tensor() is False
    e = lib.OrtValue.ortvalue_from_shape_and_type([2, 3], np.float32, "cpu", 0, vendor_id=-1,
                                                  memory_info=None)
    assert e.shape() == [2, 3]


def test_an_ortvalue_of_an_ortvalue_is_the_same_value() -> None:
    """(onnxtrain made an opaque value that was no tensor; onnxruntime takes its C value there)"""
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    v = onnxtrain.OrtValue(onnxtrain.OrtValue.ortvalue_from_numpy(x))
    assert v.is_tensor()
    np.testing.assert_array_equal(v.numpy(), x)


def test_model_accessor_takes_the_models_path(tmp_path) -> None:
    """onnxruntime-training's ``ModelAccessor(model, model_path=None)``."""
    import onnx

    from onnxtrain.training.onnxblock.model_accessor import ModelAccessor

    m = onnx.load_from_string(_relu())
    assert ModelAccessor(m, str(tmp_path / "m.onnx")).path == str(tmp_path / "m.onnx")
    assert ModelAccessor(m).path is None
