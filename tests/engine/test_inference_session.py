"""The inference surface: InferenceSession, NodeArg, metadata, providers, OrtValue, IOBinding, profiling,
clear errors on bad input, and the ONNX backend (run_node / run_model).

Where onnxruntime has the same call, the same code runs on both and the answers are compared.
"""

from __future__ import annotations

import json
import os
import time
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain import backend
from onnxtrain.capi import onnxruntime_pybind11_state as onnxtrain_state
from onnxtrain.engine.plan import EngineError, UnsupportedOpError
from onnxtrain.engine.registry import available_ops
from onnxtrain.errors import InvalidGraph

W = np.arange(6, dtype=np.float32).reshape(3, 2) / 4
B = np.array([0.5, -1.0], np.float32)
BIG_B = np.array([4.0, 4.1], np.float32)  # the b iobinding_roundtrip binds (elements 40, 41 of its array)


def small_model(ir_version: int = 8) -> onnx.ModelProto:
    """y = x @ w + b (b overridable: also a graph input), yi = int64(y), with metadata."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
             helper.make_node("Add", ["m", "b"], ["y"], name="add"),
             helper.make_node("Cast", ["y"], ["yi"], to=TensorProto.INT64, name="cast")]
    graph = helper.make_graph(
        nodes, "small", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3]),
                         helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2]),
         helper.make_tensor_value_info("yi", TensorProto.INT64, None)],
        [numpy_helper.from_array(W, "w"), numpy_helper.from_array(B, "b")], doc_string="graph doc")
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=ir_version,
                              producer_name="tests", doc_string="model doc", model_version=3,
                              domain="ai.test")
    helper.set_model_props(model, {"author": "me", "task": "test"})
    return model


@pytest.fixture(scope="module")
def model_bytes() -> bytes:
    return small_model().SerializeToString()


def ort_session(data: bytes) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def args_of(args) -> list[tuple]:
    return [(a.name, a.type, a.shape) for a in args]


# ---- introspection ---------------------------------------------------------------------------------------
def test_inputs_outputs_match_onnxruntime(model_bytes: bytes) -> None:
    ours, ref = onnxtrain.InferenceSession(model_bytes), ort_session(model_bytes)
    assert args_of(ours.get_inputs()) == args_of(ref.get_inputs()) == [("x", "tensor(float)", ["N", 3])]
    assert args_of(ours.get_outputs())[0] == args_of(ref.get_outputs())[0] == ("y", "tensor(float)", ["N", 2])
    assert ours.get_outputs()[1].name == "yi" and ours.get_outputs()[1].type == "tensor(int64)"
    assert args_of(ours.get_overridable_initializers()) == args_of(ref.get_overridable_initializers())
    assert repr(ours.get_inputs()[0]) == "NodeArg(name='x', type='tensor(float)', shape=['N', 3])"


def test_exported_model_node_args_match_onnxruntime() -> None:
    pytest.importorskip("torch")
    from tests import models

    model, _, _ = models.export("recommender", training=False)
    data = model.SerializeToString()
    ours, ref = onnxtrain.InferenceSession(data), ort_session(data)
    assert args_of(ours.get_inputs()) == args_of(ref.get_inputs())
    assert args_of(ours.get_outputs()) == args_of(ref.get_outputs())


def test_modelmeta_matches_onnxruntime(model_bytes: bytes) -> None:
    ours = onnxtrain.InferenceSession(model_bytes).get_modelmeta()
    ref = ort_session(model_bytes).get_modelmeta()
    for field in ("producer_name", "graph_name", "domain", "description", "graph_description", "version",
                  "custom_metadata_map"):
        assert getattr(ours, field) == getattr(ref, field), field
    assert ours.custom_metadata_map == {"author": "me", "task": "test"}


def test_run_and_overridable_initializer(model_bytes: bytes) -> None:
    x = np.array([[1, 2, 3], [4, 5, 6]], np.float32)
    ours, ref = onnxtrain.InferenceSession(model_bytes), ort_session(model_bytes)
    for feeds in ({"x": x}, {"x": x, "b": np.array([10, 20], np.float32)}):
        got, want = ours.run(None, feeds), ref.run(None, feeds)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_allclose(g, w, rtol=1e-6)
    (y,) = ours.run(["y"], {"x": x})
    np.testing.assert_allclose(y, x @ W + B, rtol=1e-6)
    yi, y2 = ours.run(["yi", "y"], {"x": x})  # outputs in the order asked for
    assert yi.dtype == np.int64 and np.allclose(y2, y)


def test_session_from_path_and_proto(tmp_path, model_bytes: bytes) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(model_bytes)
    x = np.ones((1, 3), np.float32)
    a = onnxtrain.InferenceSession(str(path)).run(None, {"x": x})
    b = onnxtrain.InferenceSession(path).run(None, {"x": x})  # os.PathLike
    c = onnxtrain.InferenceSession(onnx.load_from_string(model_bytes)).run(None, {"x": x})
    for u, v, w in zip(a, b, c):
        np.testing.assert_array_equal(u, v)
        np.testing.assert_array_equal(u, w)


# ---- providers -------------------------------------------------------------------------------------------
def test_default_providers(model_bytes: bytes) -> None:
    s = onnxtrain.InferenceSession(model_bytes)
    assert s.get_providers() == ["CPUExecutionProvider"]
    assert s.get_provider_options() == {"CPUExecutionProvider": {}}
    assert onnxtrain.get_available_providers() == ["CPUExecutionProvider"]
    assert "CUDAExecutionProvider" in onnxtrain.get_all_providers()
    assert onnxtrain.get_device() == "CPU"


def test_unavailable_provider_falls_back_with_warning(model_bytes: bytes) -> None:
    with pytest.warns(UserWarning, match="CUDAExecutionProvider.*CPUExecutionProvider"):
        s = onnxtrain.InferenceSession(model_bytes,
                                       providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert s.get_providers() == ["CPUExecutionProvider"]
    with pytest.warns(UserWarning):
        s = onnxtrain.InferenceSession(model_bytes, providers=[("CUDAExecutionProvider", {"device_id": 0})])
    assert s.get_providers() == ["CPUExecutionProvider"]
    (y, _) = s.run(None, {"x": np.ones((2, 3), np.float32)})
    assert y.shape == (2, 2)


def test_unknown_provider_lists_valid_names(model_bytes: bytes) -> None:
    """(without enable_fallback=0 the constructor falls back to the CPU, as onnxruntime's)"""
    with pytest.raises(ValueError, match="Bogus.*CPUExecutionProvider.*CUDAExecutionProvider"):
        onnxtrain.InferenceSession(model_bytes, providers=["BogusExecutionProvider"], enable_fallback=0)
    s = onnxtrain.InferenceSession(model_bytes)
    with pytest.raises(ValueError, match="valid names"):
        s.set_providers(["Nope"])


def test_provider_options(model_bytes: bytes) -> None:
    s = onnxtrain.InferenceSession(model_bytes, providers=[("CPUExecutionProvider", {"arena": 1})])
    assert s.get_provider_options() == {"CPUExecutionProvider": {}}  # (onnxruntime's CPU provider keeps none)
    assert s._provider_options == [{"arena": "1"}]  # (what the onnxruntime backend passes on)
    with pytest.raises(ValueError, match="same length"):
        onnxtrain.InferenceSession(model_bytes, providers=["CPUExecutionProvider"], provider_options=[{}, {}],
                                   enable_fallback=0)


# ---- OrtValue --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mod", [onnxtrain, ort], ids=["onnxtrain", "onnxruntime"])
def test_ortvalue_methods(mod) -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    v = mod.OrtValue.ortvalue_from_numpy(a)
    assert v.shape() == [2, 3]
    assert v.data_type() == "tensor(float)"
    assert v.element_type() == TensorProto.FLOAT
    assert v.device_name() == "cpu"
    assert v.is_tensor() and v.has_value()
    assert v.data_ptr() == a.ctypes.data  # no copy
    np.testing.assert_array_equal(v.numpy(), a)
    v.update_inplace(np.ones((2, 3), np.float32))
    np.testing.assert_array_equal(a, np.ones((2, 3), np.float32))
    e = mod.OrtValue.ortvalue_from_shape_and_type([4, 5], np.int64)
    assert e.shape() == [4, 5] and e.data_type() == "tensor(int64)" and e.element_type() == TensorProto.INT64


@pytest.mark.parametrize("mod", [onnxtrain, ort], ids=["onnxtrain", "onnxruntime"])
@pytest.mark.parametrize("elem, bits, width", [(TensorProto.BFLOAT16, [0x3F80, 0x4000], np.uint16),
                                               (TensorProto.FLOAT8E4M3FN, [0x38, 0x40], np.uint8)])
def test_update_inplace_copies_the_bits_of_a_type_of_the_same_width(mod, elem, bits, width) -> None:
    """The usual way to feed bfloat16 or float8 from numpy: their bits as uint16 / uint8 into a value of
    that type (they were converted as numbers: 16256 for bfloat16 1.0)."""
    g = helper.make_graph([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)], "g",
                          [helper.make_tensor_value_info("x", elem, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10).SerializeToString()
    s = onnxtrain.InferenceSession(m) if mod is onnxtrain else ort_session(m)
    v = mod.OrtValue.ortvalue_from_shape_and_type([2], elem)
    v.update_inplace(np.array(bits, width))
    (y,) = s.run_with_ort_values(["y"], {"x": v})
    np.testing.assert_array_equal(y.numpy(), [1.0, 2.0])


def test_update_inplace_of_text_copies_the_strings() -> None:
    """Strings of 8 bytes (``<U2``) are as wide as the object array's references: copied as strings."""
    v = onnxtrain.OrtValue.ortvalue_from_numpy(np.array(["xx", "yy"], dtype=object))
    v.update_inplace(np.array(["ab", "cd"]))
    assert list(v.numpy()) == ["ab", "cd"]


@pytest.mark.parametrize("mod", [onnxtrain, ort], ids=["onnxtrain", "onnxruntime"])
def test_node_args_are_hashable_and_read_only_and_an_empty_dim_name_is_unknown(mod) -> None:
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["", "n", 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["", "n", 3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    s = onnxtrain.InferenceSession(m) if mod is onnxtrain else ort_session(m)
    x = s.get_inputs()[0]
    assert x.shape == [None, "n", 3] and {x: 1}[x] == 1
    with pytest.raises(AttributeError):
        x.name = "z"


def test_ortvalue_cpu_only() -> None:
    with pytest.raises(ValueError, match="cuda"):
        onnxtrain.OrtValue.ortvalue_from_numpy(np.zeros(2, np.float32), "cuda", 0)


@pytest.mark.parametrize("mod", [onnxtrain, ort], ids=["onnxtrain", "onnxruntime"])
def test_run_with_ort_values(mod, model_bytes: bytes) -> None:
    s = onnxtrain.InferenceSession(model_bytes) if mod is onnxtrain else ort_session(model_bytes)
    x = np.array([[1, 0, 2]], np.float32)
    out = s.run_with_ort_values(["y"], {"x": mod.OrtValue.ortvalue_from_numpy(x)})
    assert len(out) == 1 and isinstance(out[0], mod.OrtValue)
    np.testing.assert_allclose(out[0].numpy(), x @ W + B, rtol=1e-6)


# ---- IOBinding -------------------------------------------------------------------------------------------
def iobinding_roundtrip(mod, session) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Two inputs at offsets inside one big array, one output bound to a preallocated buffer."""
    big = np.arange(100, dtype=np.float32) / 10
    out = np.full((2, 2), -1.0, np.float32)
    binding = session.io_binding()
    x_off, b_off = 12, 40  # in elements
    binding.bind_input("x", "cpu", 0, np.float32, [2, 3], big.ctypes.data + x_off * 4)
    binding.bind_input("b", "cpu", 0, np.float32, [2], big.ctypes.data + b_off * 4)
    binding.bind_output("y", "cpu", 0, np.float32, [2, 2], out.ctypes.data)
    session.run_with_iobinding(binding)
    first = out.copy()
    big[x_off:x_off + 6] = 1.0  # the binding points into big: a second run sees the new values
    session.run_with_iobinding(binding)
    outs = [v.numpy().copy() for v in binding.get_outputs()]
    want_first = (np.arange(12, 18, dtype=np.float32) / 10).reshape(2, 3) @ W + BIG_B
    np.testing.assert_allclose(first, want_first, rtol=1e-6)
    return first, out.copy(), outs


def test_iobinding_raw_pointers_match_onnxruntime(model_bytes: bytes) -> None:
    a = iobinding_roundtrip(onnxtrain, onnxtrain.InferenceSession(model_bytes))
    b = iobinding_roundtrip(ort, ort_session(model_bytes))
    for u, v in zip(a[:2], b[:2]):
        np.testing.assert_allclose(u, v, rtol=1e-6)
    np.testing.assert_allclose(a[2][0], b[2][0], rtol=1e-6)
    np.testing.assert_allclose(a[1], np.ones((2, 3), np.float32) @ W + BIG_B, rtol=1e-6)


def test_iobinding_output_written_into_buffer(model_bytes: bytes) -> None:
    s = onnxtrain.InferenceSession(model_bytes)
    out = np.zeros((1, 2), np.float32)
    binding = s.io_binding()
    binding.bind_cpu_input("x", np.ones((1, 3), np.float32))
    binding.bind_output("y", "cpu", 0, np.float32, [1, 2], out.ctypes.data)
    binding.bind_output("yi")
    s.run_with_iobinding(binding)
    y, yi = binding.get_outputs()
    assert np.shares_memory(y.numpy(), out)
    np.testing.assert_allclose(out, np.ones((1, 3), np.float32) @ W + B, rtol=1e-6)
    assert yi.numpy().dtype == np.int64
    copies = binding.copy_outputs_to_cpu()
    assert not np.shares_memory(copies[0], out)
    binding.clear_binding_outputs()
    with pytest.raises(RuntimeError, match="At least one output should be requested"):  # as onnxruntime
        s.run_with_iobinding(binding)


@pytest.mark.parametrize("mod", [onnxtrain, ort], ids=["onnxtrain", "onnxruntime"])
def test_iobinding_output_bound_without_a_buffer_is_reused_by_later_runs(mod, model_bytes: bytes) -> None:
    """An output bound without a buffer: the value the first run made holds each later run's result (an
    OrtValue fetched once was stale: each run made a new one)."""
    s = onnxtrain.InferenceSession(model_bytes) if mod is onnxtrain else ort_session(model_bytes)
    binding = s.io_binding()
    binding.bind_output("y")
    results = []
    for k in (1.0, 2.0):
        x = np.full((1, 3), k, np.float32)
        binding.bind_cpu_input("x", x)
        s.run_with_iobinding(binding)
        results.append(binding.get_outputs()[0])
    first, second = results
    assert first.data_ptr() == second.data_ptr()
    np.testing.assert_allclose(first.numpy(), np.full((1, 3), 2.0, np.float32) @ W + B, rtol=1e-6)
    binding.bind_output("y")  # bound anew: the next run makes a value of its own
    binding.bind_cpu_input("x", np.full((1, 3), 3.0, np.float32))
    s.run_with_iobinding(binding)
    np.testing.assert_allclose(first.numpy(), np.full((1, 3), 2.0, np.float32) @ W + B, rtol=1e-6)
    np.testing.assert_allclose(binding.get_outputs()[0].numpy(), np.full((1, 3), 3.0, np.float32) @ W + B,
                               rtol=1e-6)


def test_iobinding_ortvalues_and_bad_buffer(model_bytes: bytes) -> None:
    s = onnxtrain.InferenceSession(model_bytes)
    binding = s.io_binding()
    binding.bind_ortvalue_input("x", onnxtrain.OrtValue.ortvalue_from_numpy(np.ones((3, 3), np.float32)))
    target = onnxtrain.OrtValue.ortvalue_from_shape_and_type([3, 2], np.float32)
    binding.bind_ortvalue_output("y", target)
    s.run_with_iobinding(binding)
    np.testing.assert_allclose(target.numpy(), np.ones((3, 3), np.float32) @ W + B, rtol=1e-6)
    wrong = np.zeros((5, 2), np.float32)
    binding.bind_output("y", "cpu", 0, np.float32, [5, 2], wrong.ctypes.data)
    with pytest.raises(ValueError, match="'y'.*shape"):
        s.run_with_iobinding(binding)
    with pytest.raises(ValueError, match="cpu only|CPU only"):
        binding.bind_input("x", "cuda", 0, np.float32, [1, 3], wrong.ctypes.data)


# ---- profiling -------------------------------------------------------------------------------------------
def test_profiling_writes_chrome_trace(tmp_path, model_bytes: bytes) -> None:
    so = onnxtrain.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "prof_")
    s = onnxtrain.InferenceSession(model_bytes, sess_options=so)
    assert s.get_profiling_start_time_ns() > 0
    runs = 3
    for _ in range(runs):
        s.run(None, {"x": np.ones((4, 3), np.float32)})
    path = s.end_profiling()
    assert path.startswith(str(tmp_path / "prof_")) and path.endswith(".json") and os.path.exists(path)
    with open(path) as f:
        trace = json.load(f)
    assert all(e["ph"] == "X" and e["dur"] >= 0 and "ts" in e for e in trace)
    events = [e for e in trace if e["cat"] == "Node"]
    assert len(events) == 3 * runs  # one per node run
    assert [e["args"]["op_name"] for e in events[:3]] == ["MatMul", "Add", "Cast"]
    assert events[0]["name"].startswith("mm")
    # each node's args as onnxruntime writes them (its profile of the same run is the oracle)
    theirs_so = ort.SessionOptions()
    theirs_so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # no fusion: node by node
    theirs_so.enable_profiling = True
    theirs_so.profile_file_prefix = str(tmp_path / "ort_")
    theirs = ort.InferenceSession(model_bytes, theirs_so, providers=["CPUExecutionProvider"])
    theirs.run(None, {"x": np.ones((4, 3), np.float32)})
    with open(theirs.end_profiling()) as f:
        want = [e for e in json.load(f) if e["cat"] == "Node"]
    keys = ("op_name", "input_type_shape", "output_type_shape", "output_size", "node_index")
    got = [(e["name"], {k: e["args"][k] for k in keys}) for e in events[:3]]
    # (onnxruntime leaves out the inputs its kernels pack ahead, MatMul's constant weight: onnxtrain lists it)
    want[0]["args"]["input_type_shape"].append({"float": [3, 2]})
    assert got == [(e["name"], {k: e["args"][k] for k in keys}) for e in want]


def test_traces_ended_at_once_keep_names_of_their_own(tmp_path, model_bytes: bytes) -> None:
    """Two sessions ending their profiles within one second (or one millisecond) write two files: the
    second overwrote the first, silently (its name had the time to the second). Names carry the
    milliseconds, as onnxruntime's."""
    import re

    paths = []
    for _ in range(4):
        so = onnxtrain.SessionOptions()
        so.enable_profiling = True
        so.profile_file_prefix = str(tmp_path / "prof_")
        s = onnxtrain.InferenceSession(model_bytes, sess_options=so)
        s.run(None, {"x": np.ones((4, 3), np.float32)})
        paths.append(s.end_profiling())
    assert len(set(paths)) == 4 and all(os.path.exists(p) for p in paths)
    assert all(re.search(r"prof__\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d+(_\d+)?\.json$", p) for p in paths), paths
    for p in paths:
        with open(p) as f:
            assert any(e["cat"] == "Node" for e in json.load(f))


def test_profile_write_that_fails_leaves_no_file(tmp_path, model_bytes: bytes, monkeypatch) -> None:
    """The trace goes to a temporary that is fsynced and renamed: a failed rename leaves neither the trace
    nor a temporary (a fixed ``<path>.tmp`` was left behind before)."""
    so = onnxtrain.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "prof_")
    s = onnxtrain.InferenceSession(model_bytes, sess_options=so)
    s.run(None, {"x": np.ones((4, 3), np.float32)})

    def fail(*args):
        raise OSError("simulated crash")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="simulated crash"):
        s.end_profiling()
    assert os.listdir(tmp_path) == []


def test_profiled_nodes_do_not_hold_garbage_collections(model_bytes: bytes) -> None:
    """A cyclic collection set off while a profiled node runs waits until the node's span ends, so a
    profile does not charge a node with the collector's time (with a threshold of one allocation, some
    collection starts within every step; each one's start lies outside every node's span)."""
    import gc

    from onnxtrain.engine.plan import Plan

    plan = Plan(small_model())
    plan.profiling = True
    feeds = {"x": np.ones((4, 3), np.float32)}
    starts: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            starts.append(time.perf_counter_ns())

    threshold, enabled = gc.get_threshold(), gc.isenabled()
    gc.enable()
    gc.set_threshold(1, 1, 1)
    gc.callbacks.append(seen)
    try:
        for _ in range(20):
            want = plan.run(feeds)
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*threshold)
        if not enabled:
            gc.disable()
    spans = [(e.start_ns, e.start_ns + e.dur_ns) for e in plan.profile if e.cat == "Node"]
    assert len(spans) == len(plan.steps) * 20 and len(starts) > 20
    assert not [t for t in starts for lo, hi in spans if lo < t < hi]
    assert gc.isenabled() == enabled
    np.testing.assert_allclose(want[0], np.ones((4, 3), np.float32) @ W + B, rtol=1e-6)


def test_no_profiling_by_default(model_bytes: bytes) -> None:
    s = onnxtrain.InferenceSession(model_bytes)
    s.run(None, {"x": np.ones((1, 3), np.float32)})
    assert s.end_profiling() == ""


def test_session_and_run_options(model_bytes: bytes) -> None:
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("session.x", "1")
    assert so.get_session_config_entry("session.x") == "1"
    so.graph_optimization_level = onnxtrain.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.execution_mode = onnxtrain.ExecutionMode.ORT_SEQUENTIAL
    s = onnxtrain.InferenceSession(model_bytes, sess_options=so)
    kept = s.get_session_options()  # a copy, as onnxruntime keeps: later changes to ``so`` do not reach it
    assert kept is not so and kept.get_session_config_entry("session.x") == "1"
    so.add_session_config_entry("session.x", "2")
    assert s.get_session_options().get_session_config_entry("session.x") == "1"
    ro = onnxtrain.RunOptions()
    ro.add_run_config_entry("k", "v")
    assert ro.get_run_config_entry("k") == "v"
    (y, _) = s.run(None, {"x": np.zeros((1, 3), np.float32)}, ro)
    np.testing.assert_array_equal(y, B[None])


@pytest.mark.parametrize("level,valid", [(-1, True), (0, True), (4, True), (-2, False), (5, False),
                                         ("3", False)])
def test_log_severity_levels_as_onnxruntime_takes_them(model_bytes: bytes, level, valid: bool) -> None:
    """onnxruntime refuses a session's level outside -1..4 when the session is made and a run's at the run."""
    feed = {"x": np.zeros((1, 3), np.float32)}
    ort_errors = (RuntimeError, ort.capi.onnxruntime_pybind11_state.Fail)  # at session creation, at run
    for lib, errors in ((ort, ort_errors), (onnxtrain, onnxtrain_state.Fail)):
        so = lib.SessionOptions()
        try:
            so.log_severity_level = level
        except TypeError:  # onnxruntime's binding takes ints only, and so do onnxtrain's options
            assert not valid
            continue
        if valid:
            lib.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
        else:
            with pytest.raises(errors, match="log severity level|log_severity_level"):
                lib.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
        session, ro = lib.InferenceSession(model_bytes, providers=["CPUExecutionProvider"]), lib.RunOptions()
        ro.log_severity_level = level
        if valid:
            session.run(None, feed, ro)
        else:
            with pytest.raises(errors, match="log severity level|log_severity_level"):
                session.run(None, feed, ro)


# ---- bad input -------------------------------------------------------------------------------------------
def test_malformed_bytes() -> None:
    with pytest.raises(EngineError, match="model bytes"):
        onnxtrain.InferenceSession(b"\x08\x07this is not an onnx model\xff\xff")


def test_missing_file_names_path(tmp_path) -> None:
    path = str(tmp_path / "nowhere" / "model.onnx")
    with pytest.raises(FileNotFoundError, match="nowhere/model.onnx"):
        onnxtrain.InferenceSession(path)


def test_bad_feeds(model_bytes: bytes) -> None:
    s = onnxtrain.InferenceSession(model_bytes)
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"missing input.*'x'"):
        s.run(None, {})
    with pytest.raises(ValueError, match="unknown input 'z'"):
        s.run(None, {"x": x, "z": x})
    with pytest.raises(TypeError, match="'x'.*float32.*float64"):
        s.run(None, {"x": x.astype(np.float64)})
    with pytest.raises(ValueError, match="'x'.*rank 2.*rank 1"):
        s.run(None, {"x": x[0]})
    with pytest.raises(ValueError, match="'x'.*dimension 1 must be 3, got 4"):
        s.run(None, {"x": np.ones((2, 4), np.float32)})
    with pytest.raises(Exception, match="unknown output 'nope'"):
        s.run(["nope"], {"x": x})


def one_node_model(node: onnx.NodeProto, domain_opsets: list | None = None) -> bytes:
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                               for o in node.output])
    opsets = [helper.make_opsetid("", 17)] + (domain_opsets or [])
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def test_op_without_kernel_names_node_and_op() -> None:
    data = one_node_model(helper.make_node("Frobnicate", ["x"], ["y"], name="frob_1", domain="com.example"),
                          [helper.make_opsetid("com.example", 1)])
    with pytest.raises(UnsupportedOpError, match=r"frob_1.*com\.example\.Frobnicate"):
        onnxtrain.InferenceSession(data)
    # a standard op that has no kernel (at an opset that has it, fed the type it takes)
    op = "ImageDecoder"  # no image codecs among the dependencies
    assert op not in available_ops()
    graph = helper.make_graph([helper.make_node(op, ["x"], ["y"], name="my_node")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.UINT8, [9])],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    with pytest.raises(UnsupportedOpError, match=f"my_node.*{op}") as e:
        onnxtrain.InferenceSession(model.SerializeToString())
    assert not isinstance(e.value, InvalidGraph)  # onnxruntime runs it: not an invalid graph


def test_kernel_failure_names_node() -> None:
    node = helper.make_node("Reshape", ["x", "shape"], ["y"], name="bad_reshape")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.array([4, 4], np.int64), "shape")])
    s = onnxtrain.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    with pytest.raises(EngineError, match="bad_reshape.*Reshape"):
        s.run(None, {"x": np.ones(6, np.float32)})


# ---- backend ---------------------------------------------------------------------------------------------
def test_backend_run_node() -> None:
    node = helper.make_node("Add", ["a", "b"], ["c"])
    a, b = np.ones((2, 3), np.float32), np.arange(3, dtype=np.float32)
    (c,) = backend.run_node(node, [a, b])
    np.testing.assert_array_equal(c, a + b)
    (m,) = backend.run_node(helper.make_node("Max", ["a", "b"], ["m"]), [a, b], opset_version=13)
    np.testing.assert_array_equal(m, np.maximum(a, b))
    assert backend.supports_device("CPU") and not backend.supports_device("CUDA")


def test_backend_run_node_takes_gaps_sequences_and_empty_optionals() -> None:
    """As onnx's node tests call it: the values of the non-empty inputs only (``Clip(x, "", max)`` with
    ``[x, max]`` put max in min's slot), a list for a sequence (np.asarray refused it), None for an empty
    optional (taken for a 0-d object tensor: OptionalHasElement said True); onnx.reference the oracle."""
    from onnx.reference import ReferenceEvaluator

    x, hi = np.array([-2.0, 0.0, 3.0], np.float32), np.array(1.0, np.float32)
    clip = helper.make_node("Clip", ["x", "", "max"], ["y"])
    want = np.minimum(x, hi)
    np.testing.assert_array_equal(backend.run_node(clip, [x, hi], opset_version=13)[0], want)
    np.testing.assert_array_equal(backend.run_node(clip, [x, None, hi], opset_version=13)[0], want)
    seq = [np.ones((2, 3), np.float32), np.zeros((1, 3), np.float32)]
    (n,) = backend.run_node(helper.make_node("SequenceLength", ["s"], ["n"]), [seq], opset_version=17)
    assert int(n) == 2
    (cat,) = backend.run_node(helper.make_node("ConcatFromSequence", ["s"], ["c"], axis=0), [seq],
                              opset_version=17)
    np.testing.assert_array_equal(cat, np.concatenate(seq))
    (has,) = backend.run_node(helper.make_node("OptionalHasElement", ["o"], ["h"]), [None], opset_version=18)
    opt = helper.make_optional_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, None))
    g = helper.make_graph([helper.make_node("OptionalHasElement", ["o"], ["h"])], "g",
                          [helper.make_value_info("o", opt)],
                          [helper.make_tensor_value_info("h", TensorProto.BOOL, [])])
    ref = ReferenceEvaluator(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))
    assert bool(has) is bool(ref.run(None, {"o": None})[0]) is False
    with pytest.raises(ValueError, match="3 inputs for node"):
        backend.run_node(helper.make_node("Add", ["a", "b"], ["c"]), [x, x, x])


def test_backend_run_model(model_bytes: bytes) -> None:
    model = onnx.load_from_string(model_bytes)
    x = np.ones((2, 3), np.float32)
    y, _ = backend.run_model(model, [x])
    np.testing.assert_allclose(y, x @ W + B, rtol=1e-6)
    rep = backend.prepare(model)
    y2, _ = rep.run({"x": x})
    np.testing.assert_array_equal(y, y2)
    (y3, _) = rep.run(x)  # a single array is the first input
    np.testing.assert_array_equal(y, y3)
    assert isinstance(rep.run(x), list) and backend.is_compatible(model)  # as onnxruntime.backend
    with pytest.raises(RuntimeError, match="expected dtype float32"):  # checked (it ran in float64)
        rep.run([x.astype(np.float64)])


def test_warnings_free_construction(model_bytes: bytes) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        onnxtrain.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])


def _chain_model() -> onnx.ModelProto:
    nodes = [helper.make_node("Add", ["x", "x"], ["a"]), helper.make_node("Mul", ["a", "x"], ["y"])]
    g = helper.make_graph(
        nodes, "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_disable_all_optimizations_runs_the_numpy_plan_unfused() -> None:
    x = np.arange(4, dtype=np.float32)
    so = onnxtrain.SessionOptions()
    so.graph_optimization_level = onnxtrain.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain = onnxtrain.InferenceSession(_chain_model().SerializeToString(), so)
    fused = onnxtrain.InferenceSession(_chain_model().SerializeToString())
    assert [s.node.op_type for s in plain._plan.steps] == ["Add", "Mul"]
    assert [s.node.op_type for s in fused._plan.steps] == ["FusedElementwise"]
    np.testing.assert_array_equal(plain.run(None, {"x": x})[0], (x + x) * x)
    np.testing.assert_array_equal(fused.run(None, {"x": x})[0], (x + x) * x)


def test_intra_op_threads_set_the_plans_width_and_inter_op_threads_warn() -> None:
    so = onnxtrain.SessionOptions()
    so.intra_op_num_threads = 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert onnxtrain.InferenceSession(_chain_model().SerializeToString(), so)._plan.threads == 3
        default = onnxtrain.InferenceSession(_chain_model().SerializeToString(), onnxtrain.SessionOptions())
    assert default._plan.threads >= 1
    so.inter_op_num_threads = 2
    with pytest.warns(UserWarning, match="inter_op_num_threads has no effect on the numpy engine"):
        onnxtrain.InferenceSession(_chain_model().SerializeToString(), so)
    so.inter_op_num_threads, so.intra_op_num_threads = 0, -1  # onnxruntime's default, as there
    model = _chain_model().SerializeToString()
    assert onnxtrain.InferenceSession(model, so)._plan.threads == default._plan.threads
    theirs = ort.SessionOptions()
    theirs.intra_op_num_threads = -1
    x = {"x": np.ones(4, np.float32)}
    cpu = ["CPUExecutionProvider"]
    assert ort.InferenceSession(model, theirs, providers=cpu).run(None, x)[0].shape == (4,)


def test_onnxruntime_memory_options_warn_on_the_numpy_engine() -> None:
    so = onnxtrain.SessionOptions()
    so.enable_mem_pattern = False
    so.enable_cpu_mem_arena = False
    with pytest.warns(UserWarning, match="enable_mem_pattern and enable_cpu_mem_arena = False has no effect"):
        onnxtrain.InferenceSession(_chain_model().SerializeToString(), so)


def test_non_finite_results_are_silent_and_match_onnxruntime():
    """Overflow, log(0), inf - inf and inf * 0 give their IEEE results without numpy's RuntimeWarnings, as in
    onnxruntime: a float16 Cast past 65504, Log of 0, a MatMul of inf by 0, Div by 0, ReduceLogSumExp of an
    all -inf row."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16, name="to_half"),
             helper.make_node("Log", ["x"], ["log"], name="log"),
             helper.make_node("MatMul", ["x", "z"], ["mm"], name="mm"),
             helper.make_node("Div", ["x", "z"], ["div"], name="div"),
             helper.make_node("ReduceLogSumExp", ["w"], ["lse"], axes=[1], keepdims=0, name="lse")]
    graph = helper.make_graph(
        nodes, "non_finite", [helper.make_tensor_value_info(n, f, [2, 2]) for n in ("x", "z", "w")],
        [helper.make_tensor_value_info("h", TensorProto.FLOAT16, [2, 2]),
         helper.make_tensor_value_info("log", f, [2, 2]), helper.make_tensor_value_info("mm", f, [2, 2]),
         helper.make_tensor_value_info("div", f, [2, 2]), helper.make_tensor_value_info("lse", f, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    feeds = {"x": np.array([[1e6, 0.0], [-np.inf, np.inf]], np.float32), "z": np.zeros((2, 2), np.float32),
             "w": np.array([[-np.inf, -np.inf], [0.0, 1.0]], np.float32)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = onnxtrain.InferenceSession(model.SerializeToString()).run(None, feeds)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = ref.run(None, feeds)
    assert np.isinf(got[0][0, 0]) and np.isinf(got[1][0, 1]) and np.isnan(got[2]).any()
    assert got[4][0] == -np.inf and np.isfinite(got[4][1])
    for name, a, b in zip(("h", "log", "mm", "div", "lse"), got, want):
        np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("source", ["bytes", "path"])
def test_profile_holds_the_session_events_onnxruntime_writes(tmp_path, model_bytes: bytes,
                                                              source: str) -> None:
    """The trace begins as onnxruntime's does, with the model's loading and the session's initialization, and
    holds one ``model_run`` per run around its nodes, times counted from the session's start (it held node
    events only). onnxruntime's own trace of the same model is the oracle for the names and their order."""
    import onnxruntime

    model: bytes | str = model_bytes
    if source == "path":
        model = str(tmp_path / "m.onnx")
        with open(model, "wb") as f:
            f.write(model_bytes)

    def session_events(lib) -> list[tuple[str, float, float]]:
        so = lib.SessionOptions()
        so.enable_profiling = True
        so.profile_file_prefix = str(tmp_path / f"{lib.__name__}_")
        s = lib.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        for _ in range(2):
            s.run(None, {"x": np.ones((4, 3), np.float32)})
        with open(s.end_profiling()) as f:
            trace = json.load(f)
        nodes = [(e["ts"], e["ts"] + e["dur"]) for e in trace if e["cat"] == "Node"]
        runs = [(e["ts"], e["ts"] + e["dur"]) for e in trace if e["name"] == "model_run"]
        # every node event lies inside a run
        assert nodes and all(any(a <= lo and hi <= b for a, b in runs) for lo, hi in nodes)
        return [(e["name"], e["ts"], e["dur"]) for e in trace
                if e["cat"] == "Session" and e["name"] != "SequentialExecutor::Execute"]

    ours, theirs = session_events(onnxtrain), session_events(onnxruntime)
    assert [n for n, _, _ in ours] == [n for n, _, _ in theirs]
    assert ours[0][0] == ("model_loading_uri" if source == "path" else "model_loading_array")
    starts = [t for _, t, _ in ours]
    assert starts == sorted(starts) and 0 <= starts[0] < 1e6 and all(d >= 0 for _, _, d in ours)
