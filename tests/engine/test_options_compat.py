"""SessionOptions and feeds as onnxruntime takes them (the oracle, run side by side on the same model):
options copied when a session is made, a missing config entry a RuntimeError, add_initializer and free
dimension overrides, a one-value vector fed to a scalar input. Found by porting onnxruntime's own Python
tests (onnxruntime_test_python.py) with the import changed."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain

F = TensorProto.FLOAT


def _model() -> bytes:
    """y = x · w + lr, x [batch, 2], w an initializer, lr a scalar input."""
    nodes = [helper.make_node("Mul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "lr"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["batch", 2]),
                                helper.make_tensor_value_info("lr", F, [])],
                          [helper.make_tensor_value_info("y", F, ["batch", 2])],
                          [numpy_helper.from_array(np.array([2.0, 3.0], np.float32), "w")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("lib", [ort, onnxtrain], ids=["onnxruntime", "onnxtrain"])
def test_options_and_feeds_as_onnxruntime_takes_them(lib, tmp_path) -> None:
    so = lib.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / f"{lib.__name__}_")
    w = np.array([5.0, 7.0], np.float32)
    w_value = lib.OrtValue.ortvalue_from_numpy(w)  # (onnxruntime keeps the memory, not the array: kept here)
    so.add_initializer("w", w_value)
    so.add_free_dimension_override_by_name("batch", 3)
    sess = lib.InferenceSession(_model(), so, providers=["CPUExecutionProvider"])
    so.enable_profiling = False  # after the session is made: not its options any more
    assert sess.get_inputs()[0].shape == [3, 2]
    x = np.ones((3, 2), np.float32)
    y = sess.run(None, {"x": x, "lr": np.array([0.5], np.float32)})[0]  # a one-value vector for a scalar
    np.testing.assert_array_equal(y, np.tile([5.5, 7.5], (3, 1)))
    assert sess.end_profiling()  # still profiling
    assert sess.end_profiling() == ""  # ended by the first call
    with pytest.raises(RuntimeError):
        so.get_session_config_entry("no.such.key")
    with pytest.raises(RuntimeError):
        lib.RunOptions().get_run_config_entry("nokey")


@pytest.mark.parametrize("lib", [ort, onnxtrain], ids=["onnxruntime", "onnxtrain"])
def test_added_initializers_the_model_lacks_are_skipped(lib) -> None:
    """One SessionOptions holding the weights several models share: each model takes the ones it has (the
    other names were an error)."""
    so = lib.SessionOptions()
    # (onnxruntime keeps the values' memory, not the OrtValues: they are kept here)
    kept = [lib.OrtValue.ortvalue_from_numpy(np.array([5.0, 7.0], np.float32)),
            lib.OrtValue.ortvalue_from_numpy(np.ones(3, np.float32))]
    so.add_initializer("w", kept[0])
    so.add_initializer("decoder_only", kept[1])
    sess = lib.InferenceSession(_model(), so, providers=["CPUExecutionProvider"])
    y = sess.run(None, {"x": np.ones((1, 2), np.float32), "lr": np.array(0.5, np.float32)})[0]
    np.testing.assert_array_equal(y, [[5.5, 7.5]])


@pytest.mark.parametrize("lib", [ort, onnxtrain], ids=["onnxruntime", "onnxtrain"])
def test_external_initializers_supplied_are_not_read_from_their_file(lib, tmp_path, monkeypatch) -> None:
    """A model whose weight lives in an external file, loaded from bytes where that file cannot be found:
    the value given by add_external_initializers is used and the file never read (it was an error)."""
    import onnx

    m = onnx.load_from_string(_model())
    onnx.save_model(m, str(tmp_path / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="m.data", size_threshold=0)
    data = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False).SerializeToString()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    so = lib.SessionOptions()
    kept = [lib.OrtValue.ortvalue_from_numpy(np.array([3.0, 4.0], np.float32))]  # (as above)
    so.add_external_initializers(["w"], kept)
    sess = lib.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    y = sess.run(None, {"x": np.ones((1, 2), np.float32), "lr": np.array(0.0, np.float32)})[0]
    np.testing.assert_array_equal(y, [[3.0, 4.0]])


def test_a_custom_ops_library_is_accepted_with_a_warning(tmp_path) -> None:
    """register_custom_ops_library (scripts register onnxruntime-extensions whatever the model) raised for
    every model; it warns now, and a missing library is onnxruntime's Fail, as there."""
    from onnxtrain.capi.onnxruntime_pybind11_state import Fail

    lib_path = tmp_path / "libcustom.so"
    lib_path.write_bytes(b"")
    so = onnxtrain.SessionOptions()
    with pytest.warns(UserWarning, match="standard ONNX ops only"):
        so.register_custom_ops_library(str(lib_path))
    sess = onnxtrain.InferenceSession(_model(), so)
    y = sess.run(None, {"x": np.ones((1, 2), np.float32), "lr": np.array(0.0, np.float32)})[0]
    np.testing.assert_array_equal(y, [[2.0, 3.0]])
    with pytest.raises(Fail, match="no_such.so"):
        so.register_custom_ops_library(str(tmp_path / "no_such.so"))
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail):
        ort.SessionOptions().register_custom_ops_library(str(tmp_path / "no_such.so"))


@pytest.mark.parametrize("lib", [ort, onnxtrain], ids=["onnxruntime", "onnxtrain"])
def test_an_external_initializer_the_model_lacks_is_an_error(lib) -> None:
    """add_external_initializers, unlike add_initializer, names tensors the model must hold."""
    so = lib.SessionOptions()
    kept = [lib.OrtValue.ortvalue_from_numpy(np.array([3.0, 4.0], np.float32))]  # (onnxruntime keeps memory)
    so.add_external_initializers(["w_typo"], kept)
    fail = lib.capi.onnxruntime_pybind11_state.Fail
    with pytest.raises(fail, match="w_typo"):
        lib.InferenceSession(_model(), so, providers=["CPUExecutionProvider"])


def _two_output_model() -> bytes:
    """``_model`` that also outputs m = x · w, whose path does not read lr."""
    m = helper.make_model(helper.make_graph([], "g", [], []))
    m.ParseFromString(_model())
    m.graph.output.append(helper.make_tensor_value_info("m", F, ["batch", 2]))
    return m.SerializeToString()


@pytest.mark.parametrize("lib", [ort, onnxtrain], ids=["onnxruntime", "onnxtrain"])
def test_an_added_initializer_is_the_callers_memory(lib) -> None:
    """The session reads the caller's array for an add_initializer value (it held a copy, and a second one
    in its model, before): a change made to the array later shows in the next run, as in onnxruntime."""
    w = np.array([5.0, 7.0], np.float32)
    so = lib.SessionOptions()
    kept = lib.OrtValue.ortvalue_from_numpy(w)  # (onnxruntime keeps the memory, not the OrtValue)
    so.add_initializer("w", kept)
    sess = lib.InferenceSession(_two_output_model(), so, providers=["CPUExecutionProvider"])
    feeds = {"x": np.ones((1, 2), np.float32), "lr": np.array(0.5, np.float32)}
    np.testing.assert_array_equal(sess.run(["y"], feeds)[0], [[5.5, 7.5]])
    w[:] = [1.0, 2.0]
    np.testing.assert_array_equal(sess.run(["y"], feeds)[0], [[1.5, 2.5]])
    np.testing.assert_array_equal(sess.run(["m"], feeds)[0], [[1.0, 2.0]])


def test_the_numpy_plans_share_the_added_initializers_arrays() -> None:
    """On the numpy engine the session's plan holds the caller's array itself, and so does the plan of a
    run of only the path to some outputs (it converted the model's copy again)."""
    w = np.array([5.0, 7.0], np.float32)
    so = onnxtrain.SessionOptions()
    so.add_initializer("w", w)
    sess = onnxtrain.InferenceSession(_two_output_model(), so)
    assert sess._plan.initializers["w"] is w
    ro = onnxtrain.RunOptions()
    ro.only_execute_path_to_fetches = True
    np.testing.assert_array_equal(sess.run(["m"], {"x": np.ones((1, 2), np.float32)}, ro)[0], [[5.0, 7.0]])
    plans = [p for _, p in sess._path_plans.values() if p is not None]
    assert plans and all(p.initializers["w"] is w for p in plans)
    # an array that is not contiguous is taken as a contiguous copy, with its values
    strided = np.array([[9.0, 0.0], [8.0, 0.0]], np.float32)[:, 0]
    so2 = onnxtrain.SessionOptions()
    so2.add_initializer("w", strided)
    sess2 = onnxtrain.InferenceSession(_two_output_model(), so2)
    np.testing.assert_array_equal(sess2.run(["m"], {"x": np.ones((1, 2), np.float32)}, ro)[0], [[9.0, 8.0]])


@pytest.mark.parametrize("lib", [ort, onnxtrain], ids=["onnxruntime", "onnxtrain"])
def test_a_scalar_initializer_can_be_added(lib) -> None:
    """A 0-d add_initializer value stays 0-d (it became [1], which the model's [] refused)."""
    g = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                          [numpy_helper.from_array(np.array(1, np.float32), "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    so = lib.SessionOptions()
    kept = lib.OrtValue.ortvalue_from_numpy(np.array(5, np.float32))
    so.add_initializer("w", kept)
    sess = lib.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(sess.run(None, {"x": np.array([0, 1], np.float32)})[0], [5, 6])
