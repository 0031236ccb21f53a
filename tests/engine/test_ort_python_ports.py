"""onnxruntime's Python API tests (onnxruntime/test/python/onnxruntime_test_python.py and
onnxruntime_test_python_iobinding.py), their behaviours checked on onnxtrain.InferenceSession with
onnxruntime 1.32 run side by side as the oracle.

The models are built here to match the ones those tests load from onnxruntime's test data (mul_1.onnx,
matmul_1.onnx, logicaland.onnx, identity_string.onnx, ...). Each test's first docstring line names the
onnxruntime test it covers. Not ported:

- CUDA/TensorRT/DML/TVM/CANN only: test_set_providers, test_set_providers_with_options,
  test_session_providers, test_get_and_set_tuning_results, test_ort_value_gh_issue9799,
  test_run_model_with_cuda_copy_stream, test_multiple_devices, test_tvm_imported, the GPU halves of the
  IOBinding tests (their CPU behaviour is ported) and create_and_register_allocator_v2 (CUDA arena);
- a custom-op library loaded and run (test_register_custom_ops_library): onnxtrain runs standard ops and
  refuses the library's by name (ported so);
- LoRA adapters (test_adater_export_read, test_run_with_adapter, test_run_base_model): onnxruntime's own
  adapter file format, outside onnxtrain's surface;
- test_run_session_owned_output_is_zero_copy: that an output array views onnxruntime's buffer (``.base``)
  is an implementation detail; onnxtrain's outputs own their memory;
- the binding-layer session calls (``sess._sess.run_with_ort_values``, ``SessionIOBinding(sess._sess)``):
  private to onnxruntime's wrapper; the public calls they back are ported.
"""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import threading
import warnings
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import onnxtrain

ort = pytest.importorskip("onnxruntime")

LIBS = pytest.mark.parametrize("lib", [ort, onnxtrain], ids=["onnxruntime", "onnxtrain"])
CPU = ["CPUExecutionProvider"]
X32 = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32)
SQUARES = X32 * X32


def _bytes(nodes, inputs, outputs, inits=(), opset: int = 17, ir: int = 8, **model_fields: Any) -> bytes:
    g = h.make_graph(nodes, model_fields.pop("graph_name", "g"), inputs, outputs, list(inits))
    m = h.make_model(g, opset_imports=[h.make_opsetid("", opset)], ir_version=ir, **model_fields)
    return m.SerializeToString()


def mul_1() -> bytes:
    """Y = X · W, X [3, 2], W an initializer equal to X's test feed (so Y holds its squares)."""
    return _bytes([h.make_node("Mul", ["X", "W"], ["Y"])], [h.make_tensor_value_info("X", T.FLOAT, [3, 2])],
                  [h.make_tensor_value_info("Y", T.FLOAT, [3, 2])], [numpy_helper.from_array(X32, "W")])


def matmul(batch: Any = 3) -> bytes:
    """Y = X @ [[1], [2]], X [batch, 2]."""
    w = numpy_helper.from_array(np.array([[1.0], [2.0]], np.float32), "W")
    return _bytes([h.make_node("MatMul", ["X", "W"], ["Y"])],
                  [h.make_tensor_value_info("X", T.FLOAT, [batch, 2])],
                  [h.make_tensor_value_info("Y", T.FLOAT, [batch, 1])], [w])


def logical_and() -> bytes:
    """output:0 = And(input1:0, input:0), booleans [2, 2], the inputs in that order."""
    b = [h.make_tensor_value_info(n, T.BOOL, [2, 2]) for n in ("input1:0", "input:0", "output:0")]
    return _bytes([h.make_node("And", ["input1:0", "input:0"], ["output:0"])], b[:2], b[2:])


def identity_string() -> bytes:
    v = [h.make_tensor_value_info(n, T.STRING, [2, 2]) for n in ("input:0", "output:0")]
    return _bytes([h.make_node("Identity", ["input:0"], ["output:0"])], v[:1], v[1:])


def _session(lib, model, options=None):
    return lib.InferenceSession(model, options, providers=CPU)


def _both(model, options_of=None) -> list:
    """The model's session in onnxruntime and in onnxtrain (each given options_of(lib)'s options)."""
    return [_session(lib, model, options_of(lib) if options_of else None) for lib in (ort, onnxtrain)]


def _args(args) -> list[tuple]:
    return [(a.name, a.type, a.shape) for a in args]


# ---- sessions, metadata and runs ---------------------------------------------------------------------
@LIBS
def test_model_serialization(lib, tmp_path) -> None:
    """test_model_serialization: optimized_model_filepath gets a model that loads and runs as the original."""
    so = lib.SessionOptions()
    so.log_severity_level = 1
    so.logid = "TestModelSerialization"
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    _session(lib, mul_1(), so)
    again = _session(lib, so.optimized_model_filepath)
    np.testing.assert_array_equal(again.run(None, {"X": X32})[0], SQUARES)


@LIBS
def test_get_providers(lib) -> None:
    """test_get_providers / test_run_device / test_get_version_string / test_get_build_info."""
    assert "CPUExecutionProvider" in lib.get_available_providers()
    assert lib.get_all_providers()[-1] == "CPUExecutionProvider"
    sess = lib.InferenceSession(mul_1(), providers=lib.get_available_providers())
    assert "CPUExecutionProvider" in sess.get_providers()
    assert "CPU" in lib.get_device()
    assert lib.get_version_string()
    assert "Build Info" in lib.get_build_info()
    lib.disable_telemetry_events()  # test_enabling_and_disabling_telemetry: no-ops off Windows
    lib.enable_telemetry_events()


@LIBS
def test_deserialization_from_path_object(lib, tmp_path) -> None:
    """test_deserialization_from_path_object (and test_run_model_from_bytes): a pathlib.Path, a str path and
    the bytes give the same session."""
    path = tmp_path / "mul_1.onnx"
    path.write_bytes(mul_1())
    for source in (pathlib.Path(path), str(path), mul_1()):
        sess = _session(lib, source)
        assert _args(sess.get_inputs()) == [("X", "tensor(float)", [3, 2])]
        assert _args(sess.get_outputs()) == [("Y", "tensor(float)", [3, 2])]
        np.testing.assert_array_equal(sess.run(["Y"], {"X": X32})[0], SQUARES)


@LIBS
def test_invalid_set_providers(lib) -> None:
    """test_invalid_set_providers: an unknown provider given to set_providers is a RuntimeError naming it."""
    sess = _session(lib, mul_1())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (onnxruntime warns of the name before it raises)
        with pytest.raises(RuntimeError, match="Unknown Provider Type: InvalidProvider"):
            sess.set_providers(["InvalidProvider"])


def test_run_model() -> None:
    """test_run_model: metadata, memory infos of the inputs and outputs, and the run."""
    ours, theirs = _both(mul_1())[::-1]
    for sess in (ours, theirs):
        assert _args(sess.get_inputs()) == [("X", "tensor(float)", [3, 2])]
        assert _args(sess.get_outputs()) == [("Y", "tensor(float)", [3, 2])]
        assert len(sess.get_input_memory_infos()) == 1 and sess.get_input_memory_infos()[0] is not None
        assert len(sess.get_output_memory_infos()) == 1 and sess.get_output_memory_infos()[0] is not None
        assert len(sess.get_input_epdevices()) == 1
        np.testing.assert_array_equal(sess.run(["Y"], {"X": X32})[0], SQUARES)
    for get in ("get_input_memory_infos", "get_output_memory_infos"):
        mine, other = getattr(ours, get)()[0], getattr(theirs, get)()[0]
        assert (mine.name, mine.device_id, mine.mem_type) == (other.name, other.device_id, other.mem_type)


@LIBS
def test_run_async(lib) -> None:
    """test_run_async: the callback gets the outputs, the user's data and an empty error."""
    so = lib.SessionOptions()
    so.intra_op_num_threads = 2
    sess = _session(lib, mul_1(), so)
    done, got = threading.Event(), {}

    def callback(outputs, data, err) -> None:
        got.update(outputs=outputs, data=data, err=err)
        done.set()

    sess.run_async(["Y"], {"X": X32}, callback, 123456)
    assert done.wait(10)
    assert got["err"] == "" and got["data"] == 123456 and len(got["outputs"]) == 1
    np.testing.assert_array_equal(got["outputs"][0], SQUARES)


@LIBS
def test_run_model2(lib) -> None:
    """test_run_model2 / test_run_model2_contiguous: a MatMul, fed a C-ordered and a strided array."""
    sess = _session(lib, matmul())
    assert _args(sess.get_outputs()) == [("Y", "tensor(float)", [3, 1])]
    strided = np.array([[2.0, 1.0], [4.0, 3.0], [6.0, 5.0]], np.float32)[:, [1, 0]]
    for x in (X32, strided, np.ascontiguousarray(strided), X32.T.copy().T):
        np.testing.assert_array_equal(sess.run(["Y"], {"X": x})[0], [[5.0], [11.0], [17.0]])


@LIBS
def test_run_model_multiple_threads(lib) -> None:
    """test_run_model_multiple_threads: one session run from two threads, each with its RunOptions."""
    so = lib.SessionOptions()
    so.log_verbosity_level = 1
    so.logid = "MultiThreadsTest"
    sess = _session(lib, mul_1(), so)
    results: list = []

    def run(tag: str) -> None:
        ro = lib.RunOptions()
        ro.logid = tag
        for _ in range(20):
            results.append(sess.run([], {"X": X32}, run_options=ro)[0])

    threads = [threading.Thread(target=run, args=(f"thread{k}",)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 40
    for r in results:
        np.testing.assert_array_equal(r, SQUARES)


@LIBS
def test_list_as_input(lib) -> None:
    """test_list_as_input / test_string_list_as_input: nested lists are converted to the input's type."""
    np.testing.assert_array_equal(_session(lib, mul_1()).run([], {"X": X32.tolist()})[0], SQUARES)
    words = np.array(["this", "is", "identity", "test"], dtype=str).reshape(2, 2)
    out = _session(lib, identity_string()).run([], {"input:0": words.tolist()})[0]
    assert out.dtype == object
    np.testing.assert_array_equal(out, words)


def test_run_model_symbolic_input() -> None:
    """test_run_model_symbolic_input: a dim named "None" is reported as that name, in and out."""
    for sess in _both(matmul("None")):
        assert _args(sess.get_inputs()) == [("X", "tensor(float)", ["None", 2])]
        assert _args(sess.get_outputs()) == [("Y", "tensor(float)", ["None", 1])]
        np.testing.assert_array_equal(sess.run(["Y"], {"X": X32})[0], [[5.0], [11.0], [17.0]])


def test_boolean_inputs() -> None:
    """test_boolean_inputs / test_graph_optimization_level: the inputs keep the graph's order; And runs
    (with ORT_ENABLE_EXTENDED too)."""
    a = np.array([[True, True], [False, False]])
    b = np.array([[True, False], [True, False]])

    def extended(lib):
        so = lib.SessionOptions()
        assert so.graph_optimization_level == lib.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.graph_optimization_level = lib.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        assert so.graph_optimization_level == lib.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        return so

    for sess in _both(logical_and()) + _both(logical_and(), extended):
        assert _args(sess.get_inputs()) == [("input1:0", "tensor(bool)", [2, 2]),
                                            ("input:0", "tensor(bool)", [2, 2])]
        assert _args(sess.get_outputs()) == [("output:0", "tensor(bool)", [2, 2])]
        out = sess.run(["output:0"], {"input1:0": a, "input:0": b})[0]
        assert out.dtype == np.bool_
        np.testing.assert_array_equal(out, a & b)


@pytest.mark.parametrize("feed", [
    np.array(["this", "is", "identity", "test"], dtype=str).reshape(2, 2),
    np.array(["Olá", "你好", "여보세요", "hello"], dtype=str).reshape(2, 2),
    np.array([b"this", b"is", b"identity", b"test"]).reshape(2, 2),
    np.array(["this", "is", "identity", "test"], object).reshape(2, 2),
    np.array([b"must", b"have", b"same", b"size"], dtype=np.void).reshape(2, 2),
], ids=["str", "unicode", "bytes", "object", "void"])
def test_string_inputs(feed: np.ndarray) -> None:
    """test_string_input1 / test_string_input2 / test_input_bytes / test_input_object / test_input_void:
    each numpy string kind comes back as an object array of the same strings (onnxruntime reads a bytes
    item that fills its width, b"identity" of S8, on into the next item; its test compares the outputs cut
    back to S8, as here)."""
    ours, theirs = (s.run(["output:0"], {"input:0": feed})[0] for s in _both(identity_string())[::-1])
    assert ours.dtype == theirs.dtype == object
    if feed.dtype.kind == "S":
        np.testing.assert_array_equal(theirs.astype("|S8"), feed)
        theirs = np.array(feed.tolist(), dtype=str).astype(object)
    expected = np.array([bytes(x).decode() for x in feed.flat] if feed.dtype.kind == "V" else feed.tolist(),
                        dtype=str).reshape(2, 2) if feed.dtype.kind in "VS" else feed
    assert ours.tolist() == theirs.tolist() == np.asarray(expected, dtype=str).tolist()


def test_raise_wrong_num_inputs() -> None:
    """test_raise_wrong_num_inputs: a missing input is a ValueError naming it and the inputs fed, in
    onnxruntime's words."""
    a = np.array([[True, True], [False, False]])
    for sess in _both(logical_and()):
        with pytest.raises(ValueError) as e:
            sess.run([], {"input:0": a})
        assert "Required inputs (['input1:0']) are missing from input feed (['input:0'])" in str(e.value)
        with pytest.raises(ValueError) as e:  # a misspelt name: the input it misses is named first
            sess.run([], {"input:0": a, "input_1:0": a})
        assert "Required inputs (['input1:0']) are missing from input feed (['input:0', 'input_1:0'])" \
            in str(e.value)


def _error_class(lib, name: str) -> type:
    """onnxruntime's error class ``name`` (Fail, InvalidArgument, ...) as ``lib`` defines it."""
    return getattr(importlib.import_module(f"{lib.__name__}.capi.onnxruntime_pybind11_state"), name)


@pytest.mark.parametrize("feed, outputs, error", [
    ({"X": X32, "Z": X32}, None, "InvalidArgument"),  # an unknown input besides the required ones
    ({"X": X32.astype(np.float64)}, None, "InvalidArgument"),  # another element type
    ({"X": X32.astype(np.int64)}, None, "InvalidArgument"),
    ({"X": X32.reshape(6)}, None, "InvalidArgument"),  # another rank
    ({"X": np.ones((2, 2), np.float32)}, None, "InvalidArgument"),  # another fixed dim
    ({"X": X32}, ["Q"], "InvalidArgument"),  # an unknown output
    ({"X": None}, None, "Fail"),  # None fed to a tensor input
], ids=["name", "double", "int64", "rank", "dim", "output", "none"])
def test_errors_of_wrong_feeds(feed, outputs, error) -> None:
    """test_run_model (and onnxruntime's C++ feed checks it relies on): a feed of an unknown name, another
    type, rank or size, and an unknown output raise the same onnxruntime error class."""
    for lib, sess in zip((ort, onnxtrain), _both(mul_1())):
        with pytest.raises(_error_class(lib, error)):
            sess.run(outputs, feed)


@LIBS
def test_output_names_none_empty_or_listed(lib) -> None:
    """test_run_model / test_list_as_input: None and [] fetch every output; a list fetches those, in its
    order, repeats included (onnxtrain hands back a copy for the repeat, onnxruntime the same array)."""
    model = _bytes([h.make_node("Neg", ["X"], ["N"]), h.make_node("Abs", ["X"], ["A"])],
                   [h.make_tensor_value_info("X", T.FLOAT, [3, 2])],
                   [h.make_tensor_value_info(n, T.FLOAT, [3, 2]) for n in ("N", "A")])
    sess = _session(lib, model)
    for names in (None, []):
        n, a = sess.run(names, {"X": -X32})
        np.testing.assert_array_equal(n, X32)
        np.testing.assert_array_equal(a, X32)
    a, n, a2 = sess.run(["A", "N", "A"], {"X": -X32})
    np.testing.assert_array_equal(a, X32)
    np.testing.assert_array_equal(a2, X32)
    np.testing.assert_array_equal(n, X32)


def test_run_options_terminate_and_log_levels() -> None:
    """test_run_model_multiple_threads' RunOptions: logid, verbosity and severity levels are taken; a
    severity outside -1..4 and terminate set are onnxruntime's Fail at the run."""
    for lib, sess in zip((ort, onnxtrain), _both(mul_1())):
        ro = lib.RunOptions()
        assert (ro.log_severity_level, ro.log_verbosity_level, ro.logid, ro.terminate) == (-1, 0, "", False)
        ro.logid, ro.log_verbosity_level, ro.log_severity_level = "tag", 3, 0
        np.testing.assert_array_equal(sess.run(None, {"X": X32}, ro)[0], SQUARES)
        ro.log_severity_level = 5
        with pytest.raises(_error_class(lib, "Fail")):
            sess.run(None, {"X": X32}, ro)
        ro = lib.RunOptions()
        ro.terminate = True
        with pytest.raises(_error_class(lib, "Fail"), match="terminate flag"):
            sess.run(None, {"X": X32}, ro)
        ro.terminate = False
        np.testing.assert_array_equal(sess.run(None, {"X": X32}, ro)[0], SQUARES)


@LIBS
def test_run_with_ort_values_update_inplace_and_shape_and_type(lib) -> None:
    """test_ort_value's run_with_ort_values: OrtValues in and out; update_inplace changes what the next run
    reads; ortvalue_from_shape_and_type by numpy type or ONNX type number; a size that differs is refused."""
    sess = _session(lib, mul_1())
    value = lib.OrtValue.ortvalue_from_numpy(X32.copy())
    out = sess.run_with_ort_values(["Y"], {"X": value})
    assert len(out) == 1 and out[0].data_type() == "tensor(float)" and out[0].shape() == [3, 2]
    np.testing.assert_array_equal(out[0].numpy(), SQUARES)
    value.update_inplace(2 * X32)
    np.testing.assert_array_equal(sess.run_with_ort_values(None, {"X": value})[0].numpy(), 2 * SQUARES)
    with pytest.raises(RuntimeError):
        value.update_inplace(np.ones(5, np.float32))
    for element in (np.int64, T.INT64):
        empty = lib.OrtValue.ortvalue_from_shape_and_type([2, 3], element)
        assert (empty.shape(), empty.data_type()) == ([2, 3], "tensor(int64)")
    with pytest.raises(RuntimeError):
        lib.OrtValue.ortvalue_from_shape_and_type([-1], np.float32)


def test_session_and_run_options_defaults() -> None:
    """test_graph_optimization_level / test_ort_execution_mode: the options' defaults are onnxruntime's
    (execution_order is None until set here, see the README)."""
    for cls in ("SessionOptions", "RunOptions"):
        theirs, ours = getattr(ort, cls)(), getattr(onnxtrain, cls)()
        for name in dir(theirs):
            if name.startswith("_") or callable(getattr(theirs, name)) or name == "execution_order":
                continue
            assert str(getattr(ours, name)) == str(getattr(theirs, name)), (cls, name)
            assert getattr(ours, name) == getattr(theirs, name), (cls, name)


def test_model_meta() -> None:
    """test_model_meta: producer, graph name, domain, descriptions, version and custom metadata."""
    model = _bytes([h.make_node("Relu", ["x"], ["y"])], [h.make_tensor_value_info("x", T.FLOAT, [2])],
                   [h.make_tensor_value_info("y", T.FLOAT, [2])], producer_name="onnx-caffe2",
                   graph_name="squeezenet_old", doc_string="a model", model_version=3)
    m = onnx.load_from_string(model)
    m.graph.doc_string = "its graph"
    onnx.helper.set_model_props(m, {"author": "me"})
    metas = [s.get_modelmeta() for s in _both(m.SerializeToString())]
    for field in ("producer_name", "graph_name", "domain", "description", "graph_description", "version",
                  "custom_metadata_map"):
        assert getattr(metas[0], field) == getattr(metas[1], field), field
    assert metas[1].producer_name == "onnx-caffe2" and metas[1].graph_name == "squeezenet_old"


@LIBS
def test_profiler_with_session_options(lib, tmp_path) -> None:
    """test_profiler_with_session_options: the trace is a JSON list with one event a line, each holding
    pid, dur, ts, ph, X, name and args; test_profiler_get_start_time_ns: sessions made later start later."""
    starts = []
    for _ in range(3):
        so = lib.SessionOptions()
        so.enable_profiling = True
        so.profile_file_prefix = str(tmp_path / "prof")
        sess = _session(lib, mul_1(), so)
        starts.append(sess.get_profiling_start_time_ns())
        sess.run([], {"X": X32})
        path = sess.end_profiling()
        with open(path) as f:
            lines = f.readlines()
        assert "[" in lines[0] and "]" in lines[-1]
        assert len(lines) >= 3  # the opening line, the events, the closing line
        for line in lines[1:-1]:
            for tag in ("pid", "dur", "ts", "ph", "X", "name", "args"):
                assert tag in line
        with open(path) as f:
            assert isinstance(json.load(f), list)
        os.remove(path)
    assert starts == sorted(starts)


# ---- sequences, optionals and maps --------------------------------------------------------------------
def _seq_type(elem: int) -> onnx.TypeProto:
    return h.make_sequence_type_proto(h.make_tensor_type_proto(elem, None))


def test_sequence_length() -> None:
    """test_sequence_length: a seq(tensor(float)) input; its length as an int64 scalar."""
    model = _bytes([h.make_node("SequenceLength", ["X"], ["Y"])],
                   [h.make_value_info("X", _seq_type(T.FLOAT))], [h.make_tensor_value_info("Y", T.INT64, [])],
                   opset=13)
    x = [np.array([1.0, 0.0, 3.0, 44.0, 23.0, 11.0], np.float32).reshape(2, 3)] * 2
    for sess in _both(model):
        assert _args(sess.get_inputs()) == [("X", "seq(tensor(float))", [])]
        assert sess.get_outputs()[0].type == "tensor(int64)"
        y = sess.run(["Y"], {"X": x})[0]
        assert y.dtype == np.int64 and y.shape == () and y == 2


def test_sequence_construct() -> None:
    """test_sequence_construct: two int64 tensors made a sequence output (a list of arrays)."""
    v = [h.make_tensor_value_info(n, T.INT64, [2, 3]) for n in ("tensor1", "tensor2")]
    model = _bytes([h.make_node("SequenceConstruct", ["tensor1", "tensor2"], ["output_sequence"])], v,
                   [h.make_value_info("output_sequence", _seq_type(T.INT64))], opset=13)
    feeds = {"tensor1": np.array([1, 0, 3, 44, 23, 11], np.int64).reshape(2, 3),
             "tensor2": np.arange(1, 7, dtype=np.int64).reshape(2, 3)}
    for sess in _both(model):
        assert [a.type for a in sess.get_inputs()] == ["tensor(int64)"] * 2
        assert _args(sess.get_outputs()) == [("output_sequence", "seq(tensor(int64))", [])]
        out = sess.run(["output_sequence"], feeds)[0]
        assert isinstance(out, list) and len(out) == 2
        np.testing.assert_array_equal(out, [feeds["tensor1"], feeds["tensor2"]])


@LIBS
def test_sequence_insert(lib) -> None:
    """test_sequence_insert / test_ort_execution_mode: an empty list fed as a sequence, a tensor inserted;
    execution_mode's default and setter."""
    model = _bytes([h.make_node("SequenceInsert", ["input_seq", "tensor"], ["output_sequence"])],
                   [h.make_value_info("input_seq", _seq_type(T.INT64)),
                    h.make_tensor_value_info("tensor", T.INT64, [2, 3])],
                   [h.make_value_info("output_sequence", _seq_type(T.INT64))], opset=13)
    so = lib.SessionOptions()
    assert so.execution_mode == lib.ExecutionMode.ORT_SEQUENTIAL
    so.execution_mode = lib.ExecutionMode.ORT_PARALLEL
    assert so.execution_mode == lib.ExecutionMode.ORT_PARALLEL
    so.execution_mode = lib.ExecutionMode.ORT_SEQUENTIAL
    sess = _session(lib, model, so)
    assert [a.type for a in sess.get_inputs()] == ["seq(tensor(int64))", "tensor(int64)"]
    t = np.array([1, 0, 3, 44, 23, 11], np.int64).reshape(2, 3)
    out = sess.run(["output_sequence"], {"tensor": t, "input_seq": []})[0]
    assert len(out) == 1
    np.testing.assert_array_equal(out[0], t)


def test_run_model_with_optional_sequence_input() -> None:
    """test_run_model_with_optional_sequence_input: an optional(seq(tensor(float))) passed through."""
    opt = h.make_optional_type_proto(_seq_type(T.FLOAT))
    model = _bytes([h.make_node("Identity", ["x"], ["y"])], [h.make_value_info("x", opt)],
                   [h.make_value_info("y", opt)], opset=16)
    x = [np.array([1, 2, 3, 4, 5], np.float32)]
    outs = [s.run(None, {"x": x})[0] for s in _both(model)]
    assert [a.tolist() for a in outs[0]] == [a.tolist() for a in outs[1]] == [[1, 2, 3, 4, 5]]


def test_tree_ensemble_logistic() -> None:
    """test_tree_ensemble_logistic: TreeEnsembleClassifier with LOGISTIC post-transform, on a tree with a
    split, a leaf-only tree and one with a negative weight (the probabilities are onnxruntime's)."""
    x = h.make_tensor_value_info("X", T.FLOAT, [None, 3])
    outs = [h.make_tensor_value_info("label", T.INT64, [None]), h.make_tensor_value_info("probs", T.FLOAT,
                                                                                         [None, 2])]

    def model(modes, values, true_ids, false_ids, leaf_nodes, weights, base=-0.405) -> bytes:
        n = len(modes)
        node = h.make_node("TreeEnsembleClassifier", ["X"], ["label", "probs"], domain="ai.onnx.ml",
                           nodes_treeids=[0] * n, nodes_nodeids=list(range(n)), nodes_featureids=[0] * n,
                           nodes_values=values, nodes_modes=modes, nodes_truenodeids=true_ids,
                           nodes_falsenodeids=false_ids, nodes_missing_value_tracks_true=[0] * n,
                           nodes_hitrates=[1.0] * n, class_treeids=[0] * len(weights),
                           class_nodeids=leaf_nodes, class_ids=[0] * len(weights), class_weights=weights,
                           classlabels_int64s=[0, 1], post_transform="LOGISTIC", base_values=[base])
        m = h.make_model(h.make_graph([node], "t", [x], outs),
                         opset_imports=[h.make_opsetid("", 15), h.make_opsetid("ai.onnx.ml", 3)],
                         ir_version=8)
        return m.SerializeToString()

    feed = {"X": np.array([[0.1, 0.0, 0.0]], np.float32)}
    cases = [model(["BRANCH_LT", "LEAF", "LEAF"], [0.5, 0, 0], [1, 0, 0], [2, 0, 0], [1, 2], [0.3, -0.3]),
             model(["LEAF"], [0.0], [0], [0], [0], [0.0]),
             model(["LEAF"], [0.0], [0], [0], [0], [-0.405], base=0.0)]
    for m in cases:
        theirs, ours = (s.run(None, feed) for s in _both(m))
        np.testing.assert_array_equal(ours[0], theirs[0])
        np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-6)
    p1 = _session(onnxtrain, cases[0]).run(None, feed)[1][0][1]
    np.testing.assert_allclose(p1, 1 / (1 + np.exp(0.105)), atol=1e-5)


# ---- session options ----------------------------------------------------------------------------------
def abs_free_dimensions() -> bytes:
    """Abs of x [Dim1 (DATA_BATCH), Dim2 (DATA_CHANNEL), 5]."""
    x = h.make_tensor_value_info("x", T.FLOAT, ["Dim1", "Dim2", 5])
    dims = x.type.tensor_type.shape.dim
    dims[0].denotation, dims[1].denotation = "DATA_BATCH", "DATA_CHANNEL"
    y = h.make_tensor_value_info("y", T.FLOAT, ["Dim1", "Dim2", 5])
    return _bytes([h.make_node("Abs", ["x"], ["y"])], [x], [y])


@LIBS
def test_free_dimension_overrides(lib) -> None:
    """test_session_options_add_free_dimension_override_by_denotation / _by_name: the inputs' shapes."""
    by_denotation, by_name = lib.SessionOptions(), lib.SessionOptions()
    by_denotation.add_free_dimension_override_by_denotation("DATA_BATCH", 3)
    by_denotation.add_free_dimension_override_by_denotation("DATA_CHANNEL", 5)
    by_name.add_free_dimension_override_by_name("Dim1", 4)
    by_name.add_free_dimension_override_by_name("Dim2", 6)
    assert _session(lib, abs_free_dimensions(), by_denotation).get_inputs()[0].shape == [3, 5, 5]
    sess = _session(lib, abs_free_dimensions(), by_name)
    assert _args(sess.get_inputs()) == [("x", "tensor(float)", [4, 6, 5])]
    x = -np.ones((4, 6, 5), np.float32)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], -x)


@LIBS
def test_session_config_entries(lib) -> None:
    """test_session_options_add_config_entry / test_invalid_session_options_config_entry /
    test_memory_arena_shrinkage (a run config entry read back, then run with)."""
    so = lib.SessionOptions()
    so.add_session_config_entry("CONFIG_KEY", "CONFIG_VAL")
    assert so.get_session_config_entry("CONFIG_KEY") == "CONFIG_VAL"
    with pytest.raises(RuntimeError, match="does not have configuration with key: INVALID_KEY"):
        so.get_session_config_entry("INVALID_KEY")
    ro = lib.RunOptions()
    ro.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    assert ro.get_run_config_entry("memory.enable_memory_arena_shrinkage") == "cpu:0"
    np.testing.assert_array_equal(_session(lib, mul_1()).run([], {"X": X32}, ro)[0], SQUARES)


@LIBS
def test_session_options_add_initializer(lib) -> None:
    """test_session_options_add_initializer: the OrtValue given replaces the model's W."""
    so = lib.SessionOptions()
    w = lib.OrtValue.ortvalue_from_numpy(np.array([[2.0, 1.0], [4.0, 3.0], [6.0, 5.0]], np.float32))
    so.add_initializer("W", w)
    y = _session(lib, mul_1(), so).run(["Y"], {"X": X32})[0]
    np.testing.assert_array_equal(y, [[2.0, 2.0], [12.0, 12.0], [30.0, 30.0]])


def _pads_model(tmp_path) -> str:
    """y = x + Pads_not_on_disk, an initializer (float [4]) kept in an external file that does not exist."""
    pads = T(name="Pads_not_on_disk", data_type=T.FLOAT, dims=[4])
    pads.data_location = T.EXTERNAL
    for key, value in (("location", "Pads_not_on_disk.bin"), ("offset", "0"), ("length", "16")):
        entry = pads.external_data.add()
        entry.key, entry.value = key, value
    path = str(tmp_path / "model_with_external_initializer_come_from_user.onnx")
    with open(path, "wb") as f:
        f.write(_bytes([h.make_node("Add", ["x", "Pads_not_on_disk"], ["y"])],
                       [h.make_tensor_value_info("x", T.FLOAT, [4])],
                       [h.make_tensor_value_info("y", T.FLOAT, [4])], [pads], opset=13))
    return path


@LIBS
def test_session_options_add_external_initializers(lib, tmp_path) -> None:
    """test_session_options_add_external_initializers: the value given stands for the missing file."""
    so = lib.SessionOptions()
    kept = [lib.OrtValue.ortvalue_from_numpy(np.array([0, 0, 1, 1], np.float32))]
    so.add_external_initializers(["Pads_not_on_disk"], kept)
    sess = _session(lib, _pads_model(tmp_path), so)
    np.testing.assert_array_equal(sess.run(None, {"x": np.arange(4, dtype=np.float32)})[0], [0, 1, 3, 4])


@LIBS
def test_session_options_add_external_initializers_from_files_in_memory(lib, tmp_path) -> None:
    """test_session_options_add_external_initializers_from_files_in_memory: the missing file's bytes
    given in memory, by its name."""
    data = np.array([0, 0, 1, 1], np.float32).tobytes()
    so = lib.SessionOptions()
    so.add_external_initializers_from_files_in_memory(["Pads_not_on_disk.bin"], [data], [len(data)])
    sess = _session(lib, _pads_model(tmp_path), so)
    np.testing.assert_array_equal(sess.run(None, {"x": np.arange(4, dtype=np.float32)})[0], [0, 1, 3, 4])


# ---- OrtValue -----------------------------------------------------------------------------------------
@LIBS
def test_ort_value(lib) -> None:
    """test_ort_value: an OrtValue's device, shape, type, size; a run fed one leaves it unchanged;
    ortvalue_from_numpy_with_onnx_type."""
    value = lib.OrtValue.ortvalue_from_numpy(X32)
    assert value.device_name() == "cpu" and value.shape() == [3, 2]
    assert value.data_type() == "tensor(float)" and value.is_tensor()
    assert value.tensor_size_in_bytes() == 24
    np.testing.assert_array_equal(_session(lib, mul_1()).run(["Y"], {"X": value})[0], SQUARES)
    np.testing.assert_array_equal(value.numpy(), X32)
    typed = lib.OrtValue.ortvalue_from_numpy_with_onnx_type(X32, T.FLOAT)
    assert typed.is_tensor() and typed.element_type() == T.FLOAT and typed.shape() == [3, 2]
    np.testing.assert_array_equal(typed.numpy(), X32)


def test_ortvalue_from_numpy_with_onnx_type_reads_the_bits() -> None:
    """ortvalue_from_numpy_with_onnx_type (test_adater_export_read uses it for parameters): an array of
    the same width taken as another element type, bfloat16 from uint16 bits; a width that differs is
    refused."""
    bits = np.array([0x3F80, 0xC000], np.uint16)  # 1.0 and -2.0 in bfloat16
    for lib in (ort, onnxtrain):
        v = lib.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, T.BFLOAT16)
        assert v.element_type() == T.BFLOAT16 and v.data_type() == "tensor(bfloat16)" and v.shape() == [2]
        with pytest.raises(RuntimeError):
            lib.OrtValue.ortvalue_from_numpy_with_onnx_type(X32, T.DOUBLE)
        scalar = lib.OrtValue.ortvalue_from_numpy_with_onnx_type(np.array(7, np.int32), T.FLOAT)
        assert scalar.shape() == [] and scalar.data_type() == "tensor(float)"
        strided = lib.OrtValue.ortvalue_from_numpy_with_onnx_type(X32[:, :1], T.INT32)
        assert strided.shape() == [3, 1] and strided.data_type() == "tensor(int32)"
    cast = _bytes([h.make_node("Cast", ["b"], ["f"], to=T.FLOAT)],
                  [h.make_tensor_value_info("b", T.BFLOAT16, [2])],
                  [h.make_tensor_value_info("f", T.FLOAT, [2])], opset=13)
    for lib, sess in zip((ort, onnxtrain), _both(cast)):
        fed = lib.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, T.BFLOAT16)
        np.testing.assert_array_equal(sess.run_with_ort_values(None, {"b": fed})[0].numpy(), [1.0, -2.0])


@LIBS
def test_ort_value_array_protocol(lib) -> None:
    """test_ort_value_array_protocol: np.asarray of an OrtValue shares its memory; a dtype converts."""
    a = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    v = lib.OrtValue.ortvalue_from_numpy(a)
    same = np.asarray(v)
    assert same.dtype == np.float32 and v.data_ptr() == same.ctypes.data
    np.testing.assert_array_equal(np.array(v), a)
    assert v.data_ptr() == np.asarray(v, dtype=np.float32).ctypes.data
    wide = np.asarray(v, dtype=np.float64)
    assert wide.dtype == np.float64
    np.testing.assert_array_equal(wide, a)
    for arr in (np.array([1, 2, 3], np.int64), np.array([True, False, True])):
        back = np.asarray(lib.OrtValue.ortvalue_from_numpy(arr))
        assert back.dtype == arr.dtype
        np.testing.assert_array_equal(back, arr)


@LIBS
def test_ort_value_dlpack(lib) -> None:
    """test_ort_value_dlpack_protocol / test_ort_value_from_dlpack_protocol_object /
    test_ort_value_from_dlpack_bool / test_ort_value_dlpack_zero_size."""
    a = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32)
    v = lib.OrtValue.ortvalue_from_numpy(a)
    assert v.__dlpack_device__() == (1, 0)
    np.testing.assert_array_equal(lib.OrtValue.from_dlpack(v.__dlpack__()).numpy(), a)
    shared = lib.OrtValue.from_dlpack(v)
    assert shared.data_ptr() == v.data_ptr()
    flat = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    from_numpy = lib.OrtValue.from_dlpack(flat)
    assert from_numpy.shape() == [4]
    np.testing.assert_array_equal(from_numpy.numpy(), flat)
    flags = np.array([True, False, True, False])
    assert lib.OrtValue.from_dlpack(lib.OrtValue.ortvalue_from_numpy(flags)).numpy().dtype == np.bool_
    small = np.array([1, 2, 255], np.uint8)
    assert lib.OrtValue.from_dlpack(lib.OrtValue.ortvalue_from_numpy(small)).numpy().dtype == np.uint8
    for shape in ((1, 8, 0, 128), (0,), (0, 4), (4, 0)):
        empty = lib.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32))
        assert lib.OrtValue.from_dlpack(empty).shape() == list(shape)


@LIBS
def test_run_output_does_not_alias_input_passthrough(lib) -> None:
    """test_run_output_does_not_alias_input_passthrough: an input that is also an output comes back as an
    array of its own, which later runs leave alone."""
    shape = [1, 2, 2, 2]
    x = h.make_tensor_value_info("input_0", T.FLOAT, shape)
    model = _bytes([h.make_node("Add", ["input_0", "ten"], ["plus_10"], name="Add0")], [x],
                   [h.make_tensor_value_info("plus_10", T.FLOAT, shape), x],
                   [numpy_helper.from_array(np.array(10, np.float32), "ten")], opset=21, ir=10)
    so = lib.SessionOptions()
    so.graph_optimization_level = lib.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = _session(lib, model, so)
    kept = []
    for k in range(7):
        feed = np.full(shape, float(k), np.float32)
        outs = sess.run(None, {"input_0": feed})
        assert not np.shares_memory(outs[1], feed)
        kept.append(outs)
    for k, (plus, same) in enumerate(kept):
        np.testing.assert_array_equal(plus, np.full(shape, k + 10.0, np.float32))
        np.testing.assert_array_equal(same, np.full(shape, float(k), np.float32))


# ---- devices, memory infos and allocators -------------------------------------------------------------
def test_ort_device_and_memory_info() -> None:
    """test_ort_device / test_ort_memory_info / test_ort_memory_info_create_v2 / test_create_allocator."""
    for lib in (ort, onnxtrain):
        cpu = lib.OrtDevice.make("cpu", 0)
        assert (cpu.device_id(), cpu.device_type(), cpu.device_mem_type()) == (0, 0, 0)
        info = lib.OrtMemoryInfo("Cpu", lib.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, lib.OrtMemType.DEFAULT)
        assert (info.name, info.device_id, info.mem_type, info.allocator_type) == (
            "Cpu", 0, lib.OrtMemType.DEFAULT, lib.OrtAllocatorType.ORT_ARENA_ALLOCATOR)
        assert (info.device_mem_type, info.device_vendor_id) == (lib.OrtDeviceMemoryType.DEFAULT, 0)
        cuda = lib.OrtMemoryInfo("Cuda", lib.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, lib.OrtMemType.DEFAULT)
        assert cuda.device_vendor_id == 0x10DE
        v2 = lib.OrtMemoryInfo.create_v2("Test", lib.OrtMemoryInfoDeviceType.CPU, 0, 0,
                                         lib.OrtDeviceMemoryType.DEFAULT, 128,
                                         lib.OrtAllocatorType.ORT_ARENA_ALLOCATOR)
        assert (v2.name, v2.device_id, v2.mem_type, v2.allocator_type) == (
            "Test", 0, lib.OrtMemType.DEFAULT, lib.OrtAllocatorType.ORT_ARENA_ALLOCATOR)
        assert (v2.device_mem_type, v2.device_vendor_id) == (lib.OrtDeviceMemoryType.DEFAULT, 0)
        assert cpu.device_vendor_id() == 0 and lib.OrtDevice.make("cuda", 0).device_vendor_id() == 0x10DE
        cfg = lib.OrtArenaCfg(8, 0, 4, 2)
        assert (cfg.max_mem, cfg.arena_extend_strategy, cfg.initial_chunk_size_bytes,
                cfg.max_dead_bytes_per_chunk) == (8, 0, 4, 2)
        keyed = {"max_mem": 32, "arena_extend_strategy": 11, "initial_chunk_size_bytes": 18,
                 "max_dead_bytes_per_chunk": 14, "initial_growth_chunk_size_bytes": 12,
                 "max_power_of_two_extend_bytes": 17}
        cfg = lib.OrtArenaCfg(keyed)
        assert {k: getattr(cfg, k) for k in keyed} == keyed


@LIBS
def test_shared_allocator_using_create_and_register_allocator(lib) -> None:
    """test_shared_allocator_using_create_and_register_allocator: sessions made with and without
    session.use_env_allocators run."""
    info = lib.OrtMemoryInfo("Cpu", lib.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, lib.OrtMemType.DEFAULT)
    lib.create_and_register_allocator(info, None)
    for use in ("1", None):
        so = lib.SessionOptions()
        so.log_severity_level = 1
        if use:
            so.add_session_config_entry("session.use_env_allocators", use)
        np.testing.assert_array_equal(_session(lib, mul_1(), so).run([], {"X": X32})[0], SQUARES)


def test_check_and_normalize_provider_args() -> None:
    """test_check_and_normalize_provider_args: the providers argument normalised as onnxruntime's helper
    does it, and the same arguments refused."""
    from onnxruntime.capi.onnxruntime_inference_collection import check_and_normalize_provider_args as theirs

    from onnxtrain.capi.onnxruntime_inference_collection import check_and_normalize_provider_args as ours

    valid = ["a", "b", "c"]
    for providers, options in ((None, None), (["a"], None), (["a", "b"], None), ([("a", {1: 2}), "b"], None),
                               (["a", "b"], [{1: 2}, {}])):
        assert ours(providers, options, valid) == theirs(providers, options, valid)
    with pytest.warns(UserWarning):
        got = ours(["a", "b", "a"], [{"x": 1}, {}, {"y": 2}], valid)
    assert got == (["a", "b"], [{"x": "1"}, {}])
    for providers, options in ((3, None), ([3], None), (["a"], 3), (["a"], ["not dict"]),
                               (["a", "b"], [{1: 2}]), ([("a", {1: 2})], [{3: 4}])):
        with pytest.raises(ValueError):
            theirs(providers, options, valid)
        with pytest.raises(ValueError):
            ours(providers, options, valid)


# ---- custom ops --------------------------------------------------------------------------------------
def test_register_custom_ops_library_then_a_model_of_its_ops_is_refused_by_name(tmp_path) -> None:
    """test_register_custom_ops_library (its library is not loaded here): a model using an op of a custom
    domain is refused naming the node's op, with the library registered or not."""
    from onnxtrain.capi.onnxruntime_pybind11_state import Fail

    lib_path = tmp_path / "libcustom_op_library.so"
    lib_path.write_bytes(b"")
    model = h.make_model(h.make_graph([h.make_node("CustomOpOne", ["a", "b"], ["c"], domain="test.customop")],
                                      "g", [h.make_tensor_value_info(n, T.FLOAT, [3, 5]) for n in "ab"],
                                      [h.make_tensor_value_info("c", T.FLOAT, [3, 5])]),
                         opset_imports=[h.make_opsetid("", 17), h.make_opsetid("test.customop", 1)],
                         ir_version=8).SerializeToString()
    so = onnxtrain.SessionOptions()
    with pytest.warns(UserWarning):
        so.register_custom_ops_library(str(lib_path))
    for options in (so, None):
        with pytest.raises(Fail, match="CustomOpOne"):
            onnxtrain.InferenceSession(model, options)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail, match="CustomOpOne"):
        ort.InferenceSession(model, providers=CPU)


# ---- IOBinding (onnxruntime_test_python_iobinding.py) -------------------------------------------------
@LIBS
def test_bind_input_to_cpu_arr(lib) -> None:
    """test_bind_input_to_cpu_arr: bind_cpu_input, bind_output by name, copy_outputs_to_cpu."""
    sess = _session(lib, mul_1())
    binding = sess.io_binding()
    binding.bind_cpu_input("X", X32)
    binding.bind_output("Y")
    sess.run_with_iobinding(binding)
    binding.synchronize_outputs()
    np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], SQUARES)


@LIBS
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.uint32, np.int64, np.uint64, np.int16,
                                   np.uint16, np.int8, np.uint8, np.float16, np.bool_])
def test_bind_input_types(lib, dtype) -> None:
    """test_bind_input_types: an Identity of each numpy type, its input bound as an OrtValue and as a raw
    pointer, its output bound to the CPU."""
    x = np.arange(8).reshape(-1, 2).astype(dtype)
    elem = onnx.helper.np_dtype_to_tensor_dtype(x.dtype)
    model = _bytes([h.make_node("Identity", ["X"], ["Y"])], [h.make_tensor_value_info("X", elem, [None, 2])],
                   [h.make_tensor_value_info("Y", elem, [None, 2])], opset=17, ir=7)
    sess = _session(lib, model)
    value = lib.OrtValue.ortvalue_from_numpy(x)
    for bind in ("ortvalue", "pointer"):
        binding = sess.io_binding()
        if bind == "ortvalue":
            binding.bind_ortvalue_input("X", value)
        else:
            binding.bind_input("X", "cpu", 0, dtype, list(x.shape), value.data_ptr())
        binding.bind_output("Y", "cpu")
        sess.run_with_iobinding(binding)
        y = binding.get_outputs()[0].numpy()
        assert y.dtype == x.dtype
        np.testing.assert_array_equal(y, x)


@LIBS
def test_bind_input_and_preallocated_output(lib) -> None:
    """test_bind_input_only / test_bind_input_and_preallocated_output on the CPU: an input and an output
    bound by pointer; the run writes into the output's buffer."""
    sess = _session(lib, mul_1())
    source = lib.OrtValue.ortvalue_from_numpy(X32)
    target = lib.OrtValue.ortvalue_from_shape_and_type([3, 2], np.float32, "cpu", 0)
    binding = sess.io_binding()
    binding.bind_input("X", "cpu", 0, np.float32, [3, 2], source.data_ptr())
    binding.bind_output("Y", "cpu", 0, np.float32, [3, 2], target.data_ptr())
    binding.synchronize_inputs()
    sess.run_with_iobinding(binding)
    np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], SQUARES)
    np.testing.assert_array_equal(target.numpy(), SQUARES)


@LIBS
def test_bind_input_and_non_preallocated_output(lib) -> None:
    """test_bind_input_and_non_preallocated_output on the CPU: get_outputs may be called again; a new
    input bound shows in the next run's outputs."""
    sess = _session(lib, mul_1())
    binding = sess.io_binding()
    first, second = lib.OrtValue.ortvalue_from_numpy(X32), lib.OrtValue.ortvalue_from_numpy(2 * X32)
    binding.bind_input("X", "cpu", 0, np.float32, [3, 2], first.data_ptr())
    binding.bind_output("Y", "cpu")
    sess.run_with_iobinding(binding)
    for _ in range(2):
        outs = binding.get_outputs()
        assert len(outs) == 1 and outs[0].device_name() == "cpu"
        np.testing.assert_array_equal(outs[0].numpy(), SQUARES)
    binding.bind_input("X", "cpu", 0, np.float32, [3, 2], second.data_ptr())
    sess.run_with_iobinding(binding)
    np.testing.assert_array_equal(binding.get_outputs()[0].numpy(), 2 * SQUARES)


@LIBS
def test_bind_input_and_bind_output_with_ortvalues(lib) -> None:
    """test_bind_input_and_bind_output_with_ortvalues on the CPU, then clear_binding_inputs/outputs."""
    sess = _session(lib, mul_1())
    binding = sess.io_binding()
    target = lib.OrtValue.ortvalue_from_shape_and_type([3, 2], np.float32, "cpu", 0)
    binding.bind_ortvalue_input("X", lib.OrtValue.ortvalue_from_numpy(X32))
    binding.bind_ortvalue_output("Y", target)
    sess.run_with_iobinding(binding)
    np.testing.assert_array_equal(target.numpy(), SQUARES)
    binding.bind_ortvalue_input("X", lib.OrtValue.ortvalue_from_numpy(2 * X32))
    sess.run_with_iobinding(binding)
    np.testing.assert_array_equal(target.numpy(), 2 * SQUARES)
    binding.clear_binding_outputs()
    with pytest.raises(RuntimeError):  # no output left to compute
        sess.run_with_iobinding(binding)
    binding.clear_binding_inputs()
    binding.bind_output("Y")
    with pytest.raises(RuntimeError):  # no input bound
        sess.run_with_iobinding(binding)


# ---- sparse tensors ------------------------------------------------------------------------------------
@LIBS
def test_sparse_tensor_coo_format(lib) -> None:
    """test_sparse_tensor_coo_format: a COO tensor's format, dense shape, type, device and read-only values
    and indices (linear and coordinates), through an OrtValue too; string values; no CUDA copy."""
    cpu = lib.OrtDevice.make("cpu", 0)
    values, linear = np.array([1.0, 2.0, 3.0], np.float32), np.array([3, 5, 15], np.int64)
    sparse = lib.SparseTensor.sparse_coo_from_numpy([9, 9], values, linear, cpu)
    assert sparse.format() == lib.OrtSparseFormat.ORT_SPARSE_COO
    assert sparse.dense_shape() == [9, 9]
    assert (sparse.data_type(), sparse.device_name()) == ("sparse_tensor(float)", "cpu")
    for got, want in ((sparse.values(), values), (sparse.as_coo_view().indices(), linear)):
        assert not got.flags.writeable
        np.testing.assert_array_equal(got, want)
    coords = np.array([[0, 3], [0, 5], [1, 6]], np.int64)
    np.testing.assert_array_equal(
        lib.SparseTensor.sparse_coo_from_numpy([9, 9], values, coords, cpu).as_coo_view().indices(), coords)
    value = lib.OrtValue.ort_value_from_sparse_tensor(sparse)
    assert value.is_sparse_tensor() and not value.is_tensor()
    assert (value.data_type(), value.shape()) == ("sparse_tensor(float)", [9, 9])
    assert value.element_type() == T.FLOAT
    back = value.as_sparse_tensor()
    np.testing.assert_array_equal(back.values(), values)
    assert not back.as_coo_view().indices().flags.writeable
    with pytest.raises(RuntimeError):
        value.numpy()
    with pytest.raises(_error_class(lib, "InvalidArgument")):  # fed to a dense input
        _session(lib, mul_1()).run(None, {"X": value})
    with pytest.raises(RuntimeError):
        lib.OrtValue.ortvalue_from_numpy(values).as_sparse_tensor()
    words = np.array(["xyz", "yxz", "zyx"], dtype=str)
    text = lib.SparseTensor.sparse_coo_from_numpy([9, 9], words, linear, cpu)
    assert text.data_type() == "sparse_tensor(string)" and text.format() == lib.OrtSparseFormat.ORT_SPARSE_COO
    assert text.values().tolist() == words.tolist()
    np.testing.assert_array_equal(text.as_coo_view().indices(), linear)
    with pytest.raises(RuntimeError):
        sparse.to_cuda(lib.OrtDevice.make("cuda", 0))
    with pytest.raises(RuntimeError):  # fewer indices than values
        lib.SparseTensor.sparse_coo_from_numpy([9, 9], values, linear[:2], cpu)
    with pytest.raises(RuntimeError):
        sparse.as_csrc_view()


@LIBS
def test_sparse_tensor_csr_format(lib) -> None:
    """test_sparse_tensor_csr_format: a CSR(C) tensor's format, dense shape, type and read-only inner and
    outer indices; string values; outer indices not of rows + 1 are refused."""
    cpu = lib.OrtDevice.make("cpu", 0)
    values = np.array([1.0, 2.0, 3.0], np.float32)
    inner, outer = np.array([1, 1, 1], np.int64), np.array([0, 1, 2, 3, 3, 3, 3, 3, 3, 3], np.int64)
    sparse = lib.SparseTensor.sparse_csr_from_numpy([9, 9], values, inner, outer, cpu)
    assert sparse.format() == lib.OrtSparseFormat.ORT_SPARSE_CSRC
    assert sparse.dense_shape() == [9, 9]
    assert (sparse.data_type(), sparse.device_name()) == ("sparse_tensor(float)", "cpu")
    view = sparse.as_csrc_view()
    for got, want in ((view.inner(), inner), (view.outer(), outer)):
        assert not got.flags.writeable
        np.testing.assert_array_equal(got, want)
    text = lib.SparseTensor.sparse_csr_from_numpy([9, 9], np.array(["xyz", "yxz", "zyx"]), inner, outer, cpu)
    assert text.data_type() == "sparse_tensor(string)" and text.dense_shape() == [9, 9]
    with pytest.raises(RuntimeError):
        lib.SparseTensor.sparse_csr_from_numpy([9, 9], values, inner, outer[:3], cpu)
    with pytest.raises(RuntimeError):
        sparse.as_coo_view()


def _model_with_ort_config(config: Any) -> bytes:
    m = onnx.load_from_string(mul_1())
    onnx.helper.set_model_props(m, {"ort_config": config if isinstance(config, str) else json.dumps(config)})
    return m.SerializeToString()


@LIBS
def test_loading_session_options_from_model(lib, monkeypatch, tmp_path) -> None:
    """test_loading_session_options_from_model: with ORT_LOAD_CONFIG_FROM_MODEL=1 the session takes the
    thread counts, optimization level and profiling the model's ort_config metadata sets (others keep
    their defaults); without it, the options given."""
    monkeypatch.chdir(tmp_path)  # (the profile file)
    model = _model_with_ort_config({"session_options": {
        "inter_op_num_threads": 5, "intra_op_num_threads": 2, "graph_optimization_level": 1,
        "enable_profiling": 1, "not_an_option_read_from_models": 3}})
    monkeypatch.setenv("ORT_LOAD_CONFIG_FROM_MODEL", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (onnxtrain warns that inter-op threads have no effect)
        sess = _session(lib, model)
    so = sess.get_session_options()
    assert (so.inter_op_num_threads, so.intra_op_num_threads) == (5, 2)
    assert so.execution_mode == lib.ExecutionMode.ORT_SEQUENTIAL
    assert so.graph_optimization_level == lib.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert so.enable_profiling
    np.testing.assert_array_equal(sess.run(None, {"X": X32})[0], SQUARES)
    os.remove(sess.end_profiling())
    monkeypatch.setenv("ORT_LOAD_CONFIG_FROM_MODEL", "0")
    so = _session(lib, model).get_session_options()
    assert (so.inter_op_num_threads, so.enable_profiling) == (0, False)


@pytest.mark.parametrize("config", ["{not json", {"session_options": {"intra_op_num_threads": "2"}},
                                    {"session_options": {"execution_mode": 2}},
                                    {"session_options": {"graph_optimization_level": 50}},
                                    {"session_options": {"enable_profiling": 2}}],
                         ids=["json", "string", "mode", "level", "profiling"])
def test_an_unusable_ort_config_in_the_model_is_refused(config, monkeypatch) -> None:
    """test_loading_session_options_from_model's config parsed as onnxruntime parses it: JSON that does not
    parse, or a value it does not take, is a RuntimeError when the session is made (onnxtrain's names the
    metadata entry)."""
    monkeypatch.setenv("ORT_LOAD_CONFIG_FROM_MODEL", "1")
    with pytest.raises(RuntimeError):
        _session(ort, _model_with_ort_config(config))
    with pytest.raises(RuntimeError, match="ort_config"):
        _session(onnxtrain, _model_with_ort_config(config))


def _three_weights() -> bytes:
    """y = x + the sums of three weights of 96, 100 and 104 bytes (24, 25 and 26 ones)."""
    sizes = (24, 25, 26)
    nodes = [h.make_node("ReduceSum", [f"w{n}"], [f"s{n}"], keepdims=0) for n in sizes]
    nodes.append(h.make_node("Sum", [f"s{n}" for n in sizes] + ["x"], ["y"]))
    scalar = [h.make_tensor_value_info(n, T.FLOAT, []) for n in "xy"]
    return _bytes(nodes, scalar[:1], scalar[1:],
                  [numpy_helper.from_array(np.ones(n, np.float32), f"w{n}") for n in sizes])


@LIBS
def test_model_serialization_with_external_initializers(lib, tmp_path, monkeypatch) -> None:
    """test_model_serialization_with_external_initializers (_to_directory, _to_current_directory): the
    optimized model keeps the initializers of at least the configured size in the named file beside it,
    and loads and runs from there (the original's folder gone)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    so = lib.SessionOptions()
    so.graph_optimization_level = lib.GraphOptimizationLevel.ORT_DISABLE_ALL  # (onnxruntime folds them)
    so.optimized_model_filepath = os.path.join("out", "optimized.onnx")
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "weights.bin")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "100")
    _session(lib, _three_weights(), so)
    assert (tmp_path / "out" / "weights.bin").stat().st_size == 204
    saved = onnx.load(so.optimized_model_filepath, load_external_data=False)
    where = {t.name: {e.key: e.value for e in t.external_data} for t in saved.graph.initializer}
    assert where["w24"] == {} and where["w25"]["location"] == where["w26"]["location"] == "weights.bin"
    assert sorted(int(where[n]["length"]) for n in ("w25", "w26")) == [100, 104]
    again = _session(lib, os.path.abspath(so.optimized_model_filepath))
    np.testing.assert_array_equal(again.run(None, {"x": np.array(1, np.float32)})[0], 76)


def test_get_graph_provider_assignment_info() -> None:
    """test_get_graph_provider_assignment_info / _not_enabled: with session.record_ep_graph_assignment_info
    each node is its own subgraph of the CPU provider (domain, op and name); without it, a Fail."""
    nodes = [h.make_node("Add", ["x", "x"], ["a"], name="add_0"),
             h.make_node("Mul", ["a", "x"], ["m"], name="mul_0"),
             h.make_node("Add", ["m", "x"], ["y"], name="add_1")]
    xy = [h.make_tensor_value_info(n, T.FLOAT, [2]) for n in "xy"]
    model = _bytes(nodes, xy[:1], xy[1:])

    def recording(lib):
        so = lib.SessionOptions()
        so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
        return so

    for sess in _both(model, recording):
        subgraphs = sess.get_provider_graph_assignment_info()
        assert [s.ep_name for s in subgraphs] == ["CPUExecutionProvider"] * 3
        assert [[f"{n.domain}:{n.op_type}/{n.name}" for n in s.get_nodes()] for s in subgraphs] == [
            [":Add/add_0"], [":Mul/mul_0"], [":Add/add_1"]]
    for lib, sess in zip((ort, onnxtrain), _both(model)):
        with pytest.raises(_error_class(lib, "Fail"), match="session.record_ep_graph_assignment_info"):
            sess.get_provider_graph_assignment_info()


def test_ort_value_dlpack_through_the_binding_layer() -> None:
    """test_ort_value_dlpack: a value's capsule (to_dlpack, __dlpack__) read back by the binding layer's
    OrtValue.from_dlpack shares its memory; is_dlpack_uint8_tensor tells a uint8 capsule without consuming
    it (onnxruntime 1.32's inference wheel lacks that function: onnxruntime-training 1.19 is the oracle)."""
    import ctypes

    from onnxtrain.capi import _pybind_state as C
    from tests.ortt import run_script

    shared = ctypes.pythonapi.PyCapsule_GetPointer
    prototype = (shared.restype, shared.argtypes)
    a = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32)
    value = onnxtrain.OrtValue.ortvalue_from_numpy(a)
    for capsule in (value._ortvalue.to_dlpack(), value._ortvalue.__dlpack__()):
        assert not C.is_dlpack_uint8_tensor(capsule)
        again = C.OrtValue.from_dlpack(capsule, False)
        assert again.data_ptr() == value.data_ptr()
        np.testing.assert_array_equal(again.numpy(), a)
    assert (shared.restype, shared.argtypes) == prototype  # the process's own prototype left as it was
    assert value._ortvalue.__dlpack_device__() == (1, 0)
    kinds = ["float32", "uint8", "int8", "int64"]
    theirs = run_script(
        "import json, sys, numpy as np, onnxruntime as ort\n"
        "from onnxruntime.capi import _pybind_state as C\n"
        "print(json.dumps([C.is_dlpack_uint8_tensor(ort.OrtValue.ortvalue_from_numpy(np.ones(3, k))"
        "._ortvalue.to_dlpack()) for k in sys.argv[1:]]))", *kinds)
    ours = []
    for kind in kinds:
        capsule = onnxtrain.OrtValue.ortvalue_from_numpy(np.ones(3, kind)).to_dlpack()
        ours.append(C.is_dlpack_uint8_tensor(capsule))
        np.testing.assert_array_equal(C.OrtValue.from_dlpack(capsule, False).numpy(), np.ones(3, kind))
    assert ours == theirs == [False, True, False, False]


def test_set_default_logger_callback() -> None:
    """test_set_default_logger_callback: a callable (or None) and a severity of 0..4 are taken, others are a
    RuntimeError; on the onnxruntime backend the session's log lines reach the callback with onnxruntime's
    five arguments (the numpy engine writes none)."""
    from onnxtrain.engine.backends import CONFIG_KEY

    records: list[tuple] = []

    def record(*args) -> None:
        records.append(args)

    try:
        for lib in (ort, onnxtrain):
            lib.set_default_logger_callback(lambda *args: None)
            lib.set_default_logger_callback(record, severity=4)
            lib.set_default_logger_callback(None)
            for callback, severity in ((record, 5), (record, -1), ("not a callable", 2)):
                with pytest.raises(RuntimeError):
                    lib.set_default_logger_callback(callback, severity=severity)
        onnxtrain.set_default_logger_callback(record, severity=0)
        so = onnxtrain.SessionOptions()
        so.add_session_config_entry(CONFIG_KEY, "onnxruntime")
        sess = onnxtrain.InferenceSession(mul_1(), so)
        np.testing.assert_array_equal(sess.run(None, {"X": X32})[0], SQUARES)
        assert records
        for severity, category, logid, location, message in records:
            assert isinstance(severity, int) and all(isinstance(v, str) for v in (category, logid, location,
                                                                                  message))
    finally:
        onnxtrain.set_default_logger_callback(None)
        onnxtrain.set_default_logger_severity(2)
        ort.set_default_logger_callback(None)
        ort.set_default_logger_severity(2)


def _ml(nodes, inputs, outputs) -> bytes:
    g = h.make_graph(nodes, "g", inputs, outputs)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("ai.onnx.ml", 1)],
                        ir_version=8).SerializeToString()


def _map_type(key: int, value: int) -> onnx.TypeProto:
    return h.make_map_type_proto(key, h.make_tensor_type_proto(value, None))


@pytest.mark.parametrize("labels", [{"classlabels_strings": ["a", "b", "c"]},
                                    {"classlabels_int64s": [10, 20, 30]}], ids=["strings", "int64s"])
def test_sequence_of_maps_output(labels) -> None:
    """The map outputs of onnxruntime's ML tests (ZipMap, onnxruntime_test_python_mlops.py): a list of dicts,
    typed seq(map(...)), the same keys and values as onnxruntime's."""
    key = T.STRING if "classlabels_strings" in labels else T.INT64
    model = _ml([h.make_node("ZipMap", ["x"], ["y"], domain="ai.onnx.ml", **labels)],
                [h.make_tensor_value_info("x", T.FLOAT, [None, 3])],
                [h.make_value_info("y", h.make_sequence_type_proto(_map_type(key, T.FLOAT)))])
    x = np.array([[0.1, 0.2, 0.7], [0.5, 0.3, 0.2]], np.float32)
    theirs, ours = _both(model)
    assert _args(ours.get_outputs()) == _args(theirs.get_outputs())
    assert ours.run(None, {"x": x})[0] == theirs.run(None, {"x": x})[0]


def test_map_input() -> None:
    """A map input (DictVectorizer, onnxruntime_test_python_mlops.py): a dict is fed; a key of another type
    is onnxruntime's InvalidArgument, a list a RuntimeError."""
    node = h.make_node("DictVectorizer", ["x"], ["y"], domain="ai.onnx.ml", string_vocabulary=["a", "b", "c"])
    model = _ml([node], [h.make_value_info("x", _map_type(T.STRING, T.FLOAT))],
                [h.make_tensor_value_info("y", T.FLOAT, [1, 3])])
    for lib, sess in zip((ort, onnxtrain), _both(model)):
        assert _args(sess.get_inputs()) == [("x", "map(string,tensor(float))", [])]
        y = sess.run(None, {"x": {"a": 1.0, "c": 3.0}})[0]
        assert y.dtype == np.float32
        np.testing.assert_array_equal(y, [[1.0, 0.0, 3.0]])
        with pytest.raises(_error_class(lib, "InvalidArgument")):
            sess.run(None, {"x": {1: 1.0}})
        with pytest.raises(RuntimeError):
            sess.run(None, {"x": [1.0]})


@LIBS
def test_model_serialization_with_original_external_initializers(lib, tmp_path, monkeypatch) -> None:
    """test_model_serialization_with_original_external_initializers_to_current_directory: a model whose
    weights are in a data file of its own is saved optimized with its weights in another file, which loads
    and runs once the original model and data are gone."""
    monkeypatch.chdir(tmp_path)
    source = onnx.load_from_string(_three_weights())
    onnx.save_model(source, "original.onnx", save_as_external_data=True, location="original.bin",
                    size_threshold=0)
    so = lib.SessionOptions()
    so.graph_optimization_level = lib.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.optimized_model_filepath = "optimized.onnx"
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.bin")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "10")
    _session(lib, "original.onnx", so)
    os.remove("original.onnx")
    os.remove("original.bin")
    assert os.path.getsize("optimized.bin") == 300
    again = _session(lib, "optimized.onnx", lib.SessionOptions())
    np.testing.assert_array_equal(again.run(None, {"x": np.array(1, np.float32)})[0], 76)
