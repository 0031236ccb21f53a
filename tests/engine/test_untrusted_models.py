"""Model files from elsewhere are loaded as onnxruntime 1.32 (side by side, the oracle) loads them: external
data reached through symbolic links must stay in the model's folder (or, for a Hugging Face cache, in the
folder of the file the model's own link resolves to); spans are checked against the data file before
anything is allocated; an initializer that a graph input declares with another shape or type, or of
negative dims, is refused; and every refusal names the tensor and the file. ``generate_artifacts`` refuses
a corrupt file naming it, as the training ``Module`` does."""

from __future__ import annotations

import os
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.engine.interface import InitializerError, ModelParseError
from onnxtrain.training import artifacts
from onnxtrain.training.api._graph import load_model as module_load_model

ort.set_default_logger_severity(3)
CPU = ["CPUExecutionProvider"]
X = np.arange(8, dtype=np.float32).reshape(2, 4)
W = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
B = np.array([0.5, -0.25, 2.0], np.float32)


def _model(w_input: onnx.ValueInfoProto | None = None, w: onnx.TensorProto | None = None) -> onnx.ModelProto:
    """y = x @ W + B, W and B initializers (W also a graph input when ``w_input`` is given)."""
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])]
    inputs += [w_input] if w_input else []
    w = w if w is not None else numpy_helper.from_array(W, "W")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["t"], name="mm"),
                           helper.make_node("Add", ["t", "B"], ["y"], name="add")], "g", inputs,
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
                          [w, numpy_helper.from_array(B, "B")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _external(t: onnx.TensorProto, **entries: object) -> None:
    """Mark ``t`` (in place) as kept in an external file with these entries (location, offset, length)."""
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    for k, v in entries.items():
        e = t.external_data.add()
        e.key, e.value = k, str(v)


def _save(folder, name: str = "m.onnx", data: str | None = "w.bin", **entries: object) -> str:
    """A model file in ``folder`` whose W is external at ``location`` (``w.bin`` by default); W's bytes are
    written to ``folder``/``data`` when ``data`` is given."""
    folder.mkdir(parents=True, exist_ok=True)
    m = _model()
    if data is not None:
        (folder / data).write_bytes(W.tobytes())
    _external(m.graph.initializer[0], **({"location": "w.bin"} | entries))
    path = str(folder / name)
    onnx.save(m, path)
    return path


def _both_refuse(path: str, match: str, error: type = ModelParseError) -> None:
    """onnxruntime refuses ``path``; onnxtrain's InferenceSession refuses it with ``error`` whose message
    names the model file and matches ``match``."""
    with pytest.raises(Exception):  # noqa: B017 (onnxruntime's Fail, InvalidArgument...)
        ort.InferenceSession(path, providers=CPU)
    with pytest.raises(error, match=match) as got:
        onnxtrain.InferenceSession(path)
    assert f"model file {path}" in str(got.value)


def _same_outputs(path: str) -> None:
    want = ort.InferenceSession(path, providers=CPU).run(None, {"x": X})[0]
    np.testing.assert_allclose(want, X @ W + B, rtol=1e-6)
    np.testing.assert_array_equal(onnxtrain.InferenceSession(path).run(None, {"x": X})[0], want)


# -- symbolic links ---------------------------------------------------------------------------------------

def _secret(tmp_path) -> str:
    """A private file outside every model folder, of the size W takes."""
    secret = tmp_path / "private" / "secret.bin"
    secret.parent.mkdir()
    secret.write_bytes(np.full(12, 7, np.float32).tobytes())
    return str(secret)


def test_a_data_file_linking_out_of_the_folder_is_refused(tmp_path) -> None:
    folder = tmp_path / "model"
    path = _save(folder, data=None)
    os.symlink(_secret(tmp_path), folder / "w.bin")
    _both_refuse(path, r"tensor 'W' has its data at 'w\.bin', which resolves through symbolic links to "
                       r".*private/secret\.bin, outside the model's folder")


def test_a_linked_folder_leading_out_is_refused(tmp_path) -> None:
    folder = tmp_path / "model"
    _secret(tmp_path)
    path = _save(folder, data=None, location="sub/secret.bin")
    os.symlink(tmp_path / "private", folder / "sub")
    _both_refuse(path, r"tensor 'W' has its data at 'sub/secret\.bin', which resolves through symbolic links")


def test_the_legacy_builders_refuse_a_link_out_of_the_folder(tmp_path) -> None:
    """GradientGraphBuilder and the legacy TrainingSession read a model file through the same loader."""
    folder = tmp_path / "model"
    path = _save(folder, data=None)
    os.symlink(_secret(tmp_path), folder / "w.bin")
    params = onnxtrain.TrainingParameters()
    params.loss_output_name, params.training_optimizer_name = "y", "SGDOptimizer"
    for build in (lambda: onnxtrain.GradientGraphBuilder(path, {"y"}, {"W"}, "y"),
                  lambda: onnxtrain.TrainingSession(path, params)):
        with pytest.raises(ModelParseError, match="resolves through symbolic links"):
            build()


def _hugging_face_cache(tmp_path, data_target: str = "../../blobs/bbb") -> str:
    """A model laid out as in a Hugging Face cache: snapshots/rev/{m.onnx,w.bin} links into blobs/."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    _save(blobs, name="aaa", data="bbb")
    os.symlink("../../blobs/aaa", snapshot / "m.onnx")
    os.symlink(data_target, snapshot / "w.bin")
    return str(snapshot / "m.onnx")


def test_a_hugging_face_cache_layout_loads(tmp_path) -> None:
    _same_outputs(_hugging_face_cache(tmp_path))


def test_a_hugging_face_layout_whose_data_links_elsewhere_is_refused(tmp_path) -> None:
    _secret(tmp_path)
    path = _hugging_face_cache(tmp_path, data_target="../../private/secret.bin")
    _both_refuse(path, r"tensor 'W' .* resolves through symbolic links to .*private/secret\.bin")


def test_links_that_stay_in_the_folder_load(tmp_path) -> None:
    """A data link into a sub-folder, and the model's folder itself reached through a link."""
    real = tmp_path / "real"
    _save(real, data=None)
    (real / "sub").mkdir()
    (real / "sub" / "weights").write_bytes(W.tobytes())
    os.symlink("sub/weights", real / "w.bin")
    os.symlink(real, tmp_path / "alias")
    _same_outputs(str(real / "m.onnx"))
    _same_outputs(str(tmp_path / "alias" / "m.onnx"))


def test_plain_and_shared_data_files_load(tmp_path) -> None:
    _same_outputs(_save(tmp_path / "plain"))
    folder = tmp_path / "shared"
    folder.mkdir()
    m = _model()
    (folder / "d.bin").write_bytes(W.tobytes() + b"\0" * 4 + B.tobytes())
    _external(m.graph.initializer[0], location="d.bin", offset=0, length=48)
    _external(m.graph.initializer[1], location="d.bin", offset=52, length=12)
    onnx.save(m, str(folder / "m.onnx"))
    _same_outputs(str(folder / "m.onnx"))


# -- spans checked before they are read -------------------------------------------------------------------

@pytest.mark.parametrize("entries, dims", [({"length": 2 ** 50}, None), ({}, [10 ** 8, 10 ** 8])],
                         ids=["length", "dims"])
def test_a_span_beyond_the_file_is_refused_before_it_is_allocated(tmp_path, entries, dims) -> None:
    """A span of petabytes against a 48-byte file (a bare MemoryError before)."""
    m = _model()
    (tmp_path / "w.bin").write_bytes(W.tobytes())
    w = m.graph.initializer[0]
    if dims:
        del w.dims[:]
        w.dims.extend(dims)
    _external(w, location="w.bin", **entries)
    path = str(tmp_path / "m.onnx")
    onnx.save(m, path)
    wanted = entries.get("length") or 4 * 10 ** 16
    _both_refuse(path, rf"tensor 'W' takes {wanted} bytes from .*w\.bin at offset 0, the file holds 48")


@pytest.mark.parametrize("entries, match", [
    ({"offset": "abc"}, r"tensor 'W' \(data at 'w\.bin'\) has offset 'abc', not a whole number"),
    ({"length": "-1"}, r"tensor 'W' \(data at 'w\.bin'\) has length '-1', not a whole number"),
    ({"location": ""}, r"tensor 'W' is kept in an external file but has no location"),
], ids=["offset", "length", "empty"])
def test_bad_entries_are_refused_naming_tensor_and_file(tmp_path, entries, match) -> None:
    _both_refuse(_save(tmp_path, **entries), match)


def test_a_nul_byte_in_the_location_is_refused(tmp_path) -> None:
    """onnxruntime reads the location as a C string (``w.bin``, what precedes the NUL byte); onnxtrain
    refuses it, naming tensor and file (a bare ValueError before)."""
    path = _save(tmp_path, location="w.bin\0.x")
    with pytest.raises(ModelParseError, match=r"tensor 'W' has its data at 'w\.bin\\x00\.x', a location "
                                              r"holding a NUL byte") as got:
        onnxtrain.InferenceSession(path)
    assert f"model file {path}" in str(got.value)


# -- initializers -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("declared, elem", [([3, 3], TensorProto.FLOAT), ([4], TensorProto.FLOAT),
                                            (["N"], TensorProto.FLOAT), ([4, 3], TensorProto.INT64)],
                         ids=["dims", "rank", "symbolic-rank", "type"])
def test_an_input_declaring_its_initializer_otherwise_is_refused(tmp_path, declared, elem) -> None:
    path = str(tmp_path / "m.onnx")
    onnx.save(_model(helper.make_tensor_value_info("W", elem, declared)), path)
    shown = f"{TensorProto.DataType.Name(elem)}[{', '.join(map(str, declared))}]"
    _both_refuse(path, re.escape(f"graph input 'W' is also an initializer and is declared {shown}, where the "
                                 "initializer is FLOAT[4, 3]"), InitializerError)


@pytest.mark.parametrize("declared", [["K", 3], [None, 3], None, [4, 3]],
                         ids=["symbol", "unknown", "none", "same"])
def test_an_input_declaring_its_initializer_loosely_runs(tmp_path, declared) -> None:
    """Symbolic or unknown dims (or no shape) fit the initializer: run with and without W fed."""
    path = str(tmp_path / "m.onnx")
    onnx.save(_model(helper.make_tensor_value_info("W", TensorProto.FLOAT, declared)), path)
    _same_outputs(path)
    fed = {"x": X, "W": 2 * W}
    want = ort.InferenceSession(path, providers=CPU).run(None, fed)[0]
    np.testing.assert_allclose(want, X @ (2 * W) + B, rtol=1e-6)
    np.testing.assert_array_equal(onnxtrain.InferenceSession(path).run(None, fed)[0], want)


@pytest.mark.parametrize("dims", [[-4, -4], [-1, 12], [12, -1]])
def test_negative_initializer_dims_are_refused(tmp_path, dims) -> None:
    w = numpy_helper.from_array(W, "W")
    del w.dims[:]
    w.dims.extend(dims)
    path = str(tmp_path / "m.onnx")
    onnx.save(_model(w=w), path)
    _both_refuse(path, rf"tensor 'W' has negative dims \{dims}", InitializerError)


# -- generate_artifacts on a corrupt file ------------------------------------------------------------------

@pytest.mark.parametrize("cut", ["truncated", "empty"])
def test_generate_artifacts_names_a_corrupt_file(tmp_path, cut) -> None:
    whole = _model().SerializeToString()
    path = str(tmp_path / f"{cut}.onnx")
    with open(path, "wb") as f:
        f.write(whole[:len(whole) // 2] if cut == "truncated" else b"")
    with pytest.raises(Exception):  # noqa: B017 (onnxruntime's InvalidProtobuf / InvalidArgument)
        ort.InferenceSession(path, providers=CPU)
    prefix = f"Load model from {path} failed: not a valid ONNX model"
    if cut == "truncated":  # the training Module's loader words it so
        with pytest.raises(ValueError) as module_error:
            module_load_model(path, "training")
        assert str(module_error.value).startswith(prefix)
    with pytest.raises(ValueError) as got:
        artifacts.generate_artifacts(path, requires_grad=["W"], loss=artifacts.LossType.MSELoss,
                                     artifact_directory=str(tmp_path / "out"))
    assert str(got.value).startswith(prefix)
