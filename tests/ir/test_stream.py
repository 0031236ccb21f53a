"""Models written one initializer at a time (``onnxtrain.ir.stream``): onnx's own parser reads back the model
that ``numpy_helper.from_array`` and ``SerializeToString`` would have written, for every element type, the
arrays' layouts (scalars, empty, strided, big-endian) and the parts of a model that are not the main
graph's initializers (bodies, functions, metadata); with external data, the arrays' bytes go to the data
file and onnx loads the same values."""

from __future__ import annotations

import io
import os

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.ir.io import StagedFiles, save_model_atomic, stage_model
from onnxtrain.ir.stream import array_nbytes, write_model


def _arrays() -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    f = rng.standard_normal((3, 4)).astype(np.float32)
    return [
        ("f32", f),
        ("f32_strided", f.T),  # not contiguous
        ("f32_scalar", np.array(2.5, np.float32)),
        ("f32_empty", np.zeros((0, 3), np.float32)),
        ("f32_big_endian", f.astype(">f4")),
        ("f64", rng.standard_normal(5)),
        ("f16", f.astype(np.float16)),
        ("bf16", f.astype(ml_dtypes.bfloat16)),
        ("f8", f.astype(ml_dtypes.float8_e4m3fn)),
        ("i4", np.array([[-8, 7, 1], [0, -1, 3]], ml_dtypes.int4)),  # two values a byte
        ("u4", np.array([15, 0, 9], ml_dtypes.uint4)),
        ("f4", np.array([0.5, -6.0, 1.0], ml_dtypes.float4_e2m1fn)),
        ("i8", np.arange(-5, 5, dtype=np.int8)),
        ("u16", np.arange(7, dtype=np.uint16)),
        ("i64", np.array([[1 << 40, -3]], np.int64)),
        ("b", np.array([True, False, True])),
        ("s", np.array(["ab", "", "ünï"], dtype=object)),
    ]


def _model() -> onnx.ModelProto:
    """A model with initializers of its own, a body with one, a local function and metadata."""
    body = helper.make_graph([helper.make_node("Add", ["a", "k"], ["b"])], "body", [],
                             [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])],
                             [numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "k")])
    nodes = [helper.make_node("If", ["c"], ["r"], then_branch=body, else_branch=body),
             helper.make_node("Twice", ["r"], ["y"], domain="local")]
    fn = helper.make_function("local", "Twice", ["x"], ["z"], [helper.make_node("Add", ["x", "x"], ["z"])],
                              [helper.make_opsetid("", 17)])
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                          [numpy_helper.from_array(np.array([3.0, 4.0], np.float32), "a"),
                           numpy_helper.from_array(np.arange(300, dtype=np.float32), "big")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
                          functions=[fn], doc_string="doc", producer_name="p")
    helper.set_model_props(m, {"key": "value"})
    return m


def _expected(model: onnx.ModelProto, arrays: list[tuple[str, np.ndarray]]) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.initializer.extend(numpy_helper.from_array(a.astype(a.dtype.newbyteorder("=")), name)
                                 for name, a in arrays)
    return out


def test_write_model_reads_back_as_the_model_onnx_would_write() -> None:
    model, arrays = _model(), _arrays()
    f = io.BytesIO()
    write_model(f, model, arrays)
    assert f.getvalue() == _expected(model, arrays).SerializeToString()  # the very bytes
    back = onnx.load_from_string(f.getvalue())
    assert back == _expected(model, arrays)
    for (name, a), t in zip(arrays, back.graph.initializer[2:]):
        assert t.name == name
        got = numpy_helper.to_array(t)
        assert got.shape == a.shape
        np.testing.assert_array_equal(got.astype(np.float64) if a.dtype != object else got,
                                      a.astype(np.float64) if a.dtype != object else a.astype(str))
    plain = io.BytesIO()
    write_model(plain, model)
    assert plain.getvalue() == model.SerializeToString()


def test_write_model_of_a_model_without_a_graph_or_initializers() -> None:
    for model in (onnx.ModelProto(ir_version=9), helper.make_model(helper.make_graph([], "g", [], []))):
        f = io.BytesIO()
        write_model(f, model)
        assert onnx.load_from_string(f.getvalue()) == model
    f = io.BytesIO()
    write_model(f, onnx.ModelProto(ir_version=9), [("w", np.ones(2, np.float32))])
    assert list(onnx.load_from_string(f.getvalue()).graph.initializer) == [
        numpy_helper.from_array(np.ones(2, np.float32), "w")]


def test_saved_files_hold_the_arrays(tmp_path) -> None:
    model, arrays = _model(), _arrays()
    path = str(tmp_path / "m.onnx")
    save_model_atomic(model, path)
    assert onnx.load(path) == model
    with StagedFiles() as files:
        files.save_model(model, path, arrays)
    assert onnx.load(path) == _expected(model, arrays)


def test_arrays_past_the_threshold_go_to_the_external_data_file(tmp_path) -> None:
    """Arrays of at least ``size_threshold`` bytes are written to the data file (strings stay in the model),
    after the model's own large tensors; onnx loads the same values."""
    model, arrays = _model(), _arrays()
    path = str(tmp_path / "m.onnx")
    with StagedFiles() as files:
        stage_model(files, model, path, external_data="m.data", size_threshold=12, arrays=arrays)
    plain = onnx.load(path, load_external_data=False)
    moved = {t.name for t in plain.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    assert moved == {"big"} | {n for n, a in arrays if a.dtype != object and array_nbytes(a) >= 12}
    assert {"f32", "bf16", "i4", "s", "f32_scalar"} & moved == {"f32", "bf16"}
    assert os.path.getsize(tmp_path / "m.data") == 1200 + sum(
        array_nbytes(a) for n, a in arrays if n in moved)
    back = onnx.load(path)
    for t in back.graph.initializer:
        t.ClearField("data_location")
        del t.external_data[:]
    assert back == _expected(model, arrays)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.int4])
def test_array_nbytes_is_the_raw_data_length(dtype) -> None:
    a = np.ones((3, 5), dtype)
    assert array_nbytes(a) == len(numpy_helper.from_array(a).raw_data)
