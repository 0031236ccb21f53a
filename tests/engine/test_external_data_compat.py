"""Models whose tensors live in external files load as onnxruntime (side by side, the oracle) loads them:
through symbolic links (a Hugging Face cache: the model and its data links into a blobs folder; onnx's
loader refuses links), and from bytes with the data's folder given as the session config entry
``session.model_external_initializers_file_folder_path`` (or the working directory); a location that
leaves the folder is refused."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.engine.interface import ModelParseError


def _save(folder, name: str = "model.onnx") -> onnx.ModelProto:
    w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(3, 2), "W")
    g = helper.make_graph([helper.make_node("Mul", ["X", "W"], ["Y"])], "g",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, [3, 2])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [3, 2])], [w])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save_model(model, str(folder / name), save_as_external_data=True, location="data.bin",
                    size_threshold=0)
    return model


X = np.ones((3, 2), np.float32)
WANT = np.arange(6, dtype=np.float32).reshape(3, 2)


def test_symbolic_links_to_the_model_and_its_data(tmp_path) -> None:
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "v1"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    _save(blobs)
    os.rename(blobs / "model.onnx", blobs / "guid1")
    os.rename(blobs / "data.bin", blobs / "guid2")
    os.symlink(blobs / "guid1", snapshot / "model.onnx")
    os.symlink(blobs / "guid2", snapshot / "data.bin")
    path = str(snapshot / "model.onnx")
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"X": X})[0]
    np.testing.assert_array_equal(want, WANT)
    np.testing.assert_array_equal(onnxtrain.InferenceSession(path).run(None, {"X": X})[0], want)


def test_bytes_with_external_data_read_from_the_given_folder(tmp_path, monkeypatch) -> None:
    (tmp_path / "m").mkdir()
    _save(tmp_path / "m")
    data = (tmp_path / "m" / "model.onnx").read_bytes()
    monkeypatch.chdir(tmp_path)  # not where the data is
    for lib in (ort, onnxtrain):
        with pytest.raises(Exception, match="data"):
            lib.InferenceSession(data, providers=["CPUExecutionProvider"])
        so = lib.SessionOptions()
        key = "session.model_external_initializers_file_folder_path"
        so.add_session_config_entry(key, str(tmp_path / "m"))
        y = lib.InferenceSession(data, so, providers=["CPUExecutionProvider"]).run(None, {"X": X})[0]
        np.testing.assert_array_equal(y, WANT, err_msg=lib.__name__)


def test_a_path_loaded_models_data_read_from_the_given_folder(tmp_path) -> None:
    """onnxruntime 1.32 reads a model file's external data from the config entry's folder when it is set
    (onnxtrain read it from the model's folder whatever the entry said)."""
    (tmp_path / "weights").mkdir()
    (tmp_path / "model").mkdir()
    _save(tmp_path / "weights")
    os.rename(tmp_path / "weights" / "model.onnx", tmp_path / "model" / "model.onnx")
    path = str(tmp_path / "model" / "model.onnx")
    for lib in (ort, onnxtrain):
        so = lib.SessionOptions()
        so.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                    str(tmp_path / "weights"))
        y = lib.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, {"X": X})[0]
        np.testing.assert_array_equal(y, WANT, err_msg=lib.__name__)


def test_a_location_outside_the_folder_is_refused(tmp_path) -> None:
    (tmp_path / "m").mkdir()
    _save(tmp_path / "m")
    model = onnx.load(str(tmp_path / "m" / "model.onnx"), load_external_data=False)
    for e in model.graph.initializer[0].external_data:
        if e.key == "location":
            e.value = "../m/data.bin"
    onnx.save_model(model, str(tmp_path / "m" / "escape.onnx"))
    with pytest.raises(RuntimeError, match=r"outside the folder"):
        onnxtrain.InferenceSession(str(tmp_path / "m" / "escape.onnx"))


def _external(tensor: onnx.TensorProto, folder, data: bytes, offset: int = 16) -> None:
    """Move ``tensor``'s values to ``folder``/w.bin at ``offset`` (after ``offset`` zero bytes)."""
    (folder / "w.bin").write_bytes(b"\0" * offset + data)
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    for k, v in (("location", "w.bin"), ("offset", str(offset)), ("length", str(len(data)))):
        entry = tensor.external_data.add()
        entry.key, entry.value = k, v
    tensor.data_location = TensorProto.EXTERNAL


def test_external_data_of_a_constant_in_a_local_function(tmp_path) -> None:
    """onnx's loader reads the external tensors of local functions too (they were left unread: the session
    failed as onnx found the location not to be a file)."""
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    fn = helper.make_function("local", "Lin", ["x"], ["y"],
                              [helper.make_node("Constant", [], ["w"], value=numpy_helper.from_array(w, "w")),
                               helper.make_node("MatMul", ["x", "w"], ["y"])],
                              opset_imports=[helper.make_opsetid("", 13)])
    g = helper.make_graph([helper.make_node("Lin", ["x"], ["y"], domain="local")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    opsets = [helper.make_opsetid("", 13), helper.make_opsetid("local", 1)]
    model = helper.make_model(g, opset_imports=opsets, functions=[fn])
    _external(model.functions[0].node[0].attribute[0].t, tmp_path, w.tobytes())
    onnx.save(model, str(tmp_path / "m.onnx"))
    x = np.ones((2, 3), np.float32)
    path = str(tmp_path / "m.onnx")
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(want, x @ w)
    np.testing.assert_array_equal(onnxtrain.InferenceSession(path).run(None, {"x": x})[0], want)


def test_a_data_file_shorter_than_the_tensor_names_tensor_and_file(tmp_path) -> None:
    """A truncated data file: onnxruntime fails naming the tensor's sizes; so does onnxtrain (a bare numpy
    reshape error before)."""
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Mul", ["X", "W"], ["Y"])], "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1000])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1000])],
        [numpy_helper.from_array(np.ones(1000, np.float32), "W")]),
        opset_imports=[helper.make_opsetid("", 17)])
    _external(model.graph.initializer[0], tmp_path, np.ones(1000, np.float32).tobytes(), offset=0)
    onnx.save(model, str(tmp_path / "m.onnx"))
    with open(tmp_path / "w.bin", "r+b") as f:
        f.truncate(2000)
    path = str(tmp_path / "m.onnx")
    with pytest.raises(Exception, match="4000"):
        ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    with pytest.raises(ModelParseError,
                       match=r"tensor 'W' takes 4000 bytes from .*w\.bin at offset 0, the file holds 2000"):
        onnxtrain.InferenceSession(path)


def _share_one_file(model: onnx.ModelProto, folder) -> None:
    """Move the model's two initializers (in place) to ``folder``/w.bin, one after the other, the first
    without a ``length`` entry (the second has one)."""
    first, second = model.graph.initializer
    data = [numpy_helper.to_array(t).tobytes() for t in (first, second)]
    (folder / "w.bin").write_bytes(b"".join(data))
    for t, offset, length in ((first, 0, None), (second, len(data[0]), len(data[1]))):
        t.ClearField("raw_data")
        entries = [("location", "w.bin"), ("offset", str(offset))]
        entries += [("length", str(length))] if length else []
        for k, v in entries:
            e = t.external_data.add()
            e.key, e.value = k, v
        t.data_location = TensorProto.EXTERNAL


def test_a_tensor_without_a_length_reads_the_bytes_its_shape_takes(tmp_path) -> None:
    """Two tensors in one data file, the first without a ``length`` entry: its shape says how much to read,
    as onnxruntime reads it (the rest of the file was read and refused as the wrong size)."""
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4, np.float32)
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Identity", ["A"], ["Y"]), helper.make_node("Identity", ["B"], ["Z"])], "g", [],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("Z", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(a, "A"), numpy_helper.from_array(b, "B")]),
        opset_imports=[helper.make_opsetid("", 17)])
    _share_one_file(model, tmp_path)
    onnx.save(model, str(tmp_path / "m.onnx"))
    path = str(tmp_path / "m.onnx")
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {})
    got = onnxtrain.InferenceSession(path).run(None, {})
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(got[0], a)


def test_the_gradient_builders_read_external_data_as_the_sessions_do(tmp_path) -> None:
    """GradientGraphBuilder and build_gradient_model given a path read a tensor without a ``length`` to the
    end of the shared data file (onnx's loader does): the built model failed to run."""
    from onnxtrain import GradientGraphBuilder
    from onnxtrain.autodiff import build_gradient_model

    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4, np.float32)
    model = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "A"], ["y"]), helper.make_node("ReduceSum", ["y"], ["loss"],
                                                                          keepdims=0),
         helper.make_node("Identity", ["B"], ["z"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(a, "A"), numpy_helper.from_array(b, "B")]),
        opset_imports=[helper.make_opsetid("", 17)])
    _share_one_file(model, tmp_path)
    path = str(tmp_path / "m.onnx")
    onnx.save(model, path)
    x = np.array([[1.0, 2.0]], np.float32)
    builder = GradientGraphBuilder(path, {"loss"}, {"A"}, "loss")
    builder.build()
    for built in (onnx.load_from_string(builder.get_model()), build_gradient_model(path, "loss", ["A"])):
        sess = ort.InferenceSession(built.SerializeToString(), providers=["CPUExecutionProvider"])
        out = dict(zip([o.name for o in built.graph.output], sess.run(None, {"x": x})))
        np.testing.assert_array_equal(out["A_grad"], np.repeat(x.T, 3, axis=1))  # d sum(xA) / dA
