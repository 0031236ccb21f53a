"""What a feed that is not a numpy array becomes: lists take the input's type, as in onnxruntime (Python
numbers too where the training sessions convert them); None, strings for numeric inputs and objects with a
dtype of their own (torch tensors, numpy scalars) are not converted to the input's type (numpy made None a
NaN and cast a float64 torch tensor)."""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import onnxruntime
import pytest
import torch
from onnx import TensorProto, helper

import onnxtrain
from onnxtrain.capi.feeds import feed_array
from onnxtrain.errors import InvalidArgument, InvalidFeed
from onnxtrain.training.api._graph import InputSpec

LIBS = [onnxruntime, onnxtrain]
IDS = ["onnxruntime", "onnxtrain"]


def _session(lib: Any, elem: int, shape: list | None) -> Any:
    vi = helper.make_tensor_value_info
    g = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"], name="add0")], "g",
                          [vi("x", elem, shape)], [vi("y", elem, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    so = lib.SessionOptions()
    so.log_severity_level = 4
    return lib.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("lib", LIBS, ids=IDS)
@pytest.mark.parametrize("shape", [[], None, [2, 3]], ids=["scalar", "no-shape", "2x3"])
def test_none_is_a_missing_input(lib: Any, shape: list | None) -> None:
    fail = importlib.import_module(f"{lib.__name__}.capi.onnxruntime_pybind11_state").Fail
    with pytest.raises(fail):
        _session(lib, TensorProto.FLOAT, shape).run(None, {"x": None})


def test_none_is_named() -> None:
    with pytest.raises(InvalidFeed, match="input 'x': None was fed"):
        _session(onnxtrain, TensorProto.FLOAT, []).run(None, {"x": None})


@pytest.mark.parametrize("feed,elem", [
    (torch.tensor([0.1, 1e-9], dtype=torch.float64), TensorProto.FLOAT),
    (torch.tensor([1.7, 2.9]), TensorProto.INT64),
    (np.float64(1.5), TensorProto.FLOAT),
], ids=["torch-float64-to-float", "torch-float-to-int64", "numpy-float64-scalar"])
@pytest.mark.parametrize("lib", LIBS, ids=IDS)
def test_a_feed_with_its_own_dtype_is_not_cast(lib: Any, feed: Any, elem: int) -> None:
    with pytest.raises(RuntimeError):
        _session(lib, elem, None).run(None, {"x": feed})


@pytest.mark.parametrize("feed", ["1.5", b"1.5"], ids=["str", "bytes"])
def test_a_string_is_not_a_number(feed: Any) -> None:
    """(refused by the InferenceSession as onnxruntime refuses a str, and by the feed conversion the training
    sessions share)"""
    with pytest.raises(InvalidArgument, match="input 'x'"):
        _session(onnxtrain, TensorProto.FLOAT, None).run(None, {"x": feed})
    with pytest.raises(InvalidArgument, match="input 'x': a (str|bytes) was fed to a tensor of float32"):
        feed_array("x", feed, np.dtype(np.float32))


@pytest.mark.parametrize("feed", [[1.25, 2.5], [[3], [True]]], ids=["floats", "mixed"])
@pytest.mark.parametrize("elem", [TensorProto.FLOAT, TensorProto.INT64])
def test_lists_take_the_inputs_type(feed: Any, elem: int) -> None:
    want = _session(onnxruntime, elem, None).run(None, {"x": feed})[0]
    got = _session(onnxtrain, elem, None).run(None, {"x": feed})[0]
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("feed", [3, 2.5, True, (1, 2)], ids=["int", "float", "bool", "tuple"])
def test_python_numbers_and_tuples_take_the_inputs_type_in_the_shared_conversion(feed: Any) -> None:
    """(the InferenceSession refuses them, as onnxruntime's: see test_inference_ort_parity.py; the training
    sessions and Module convert them as they convert lists)"""
    got = feed_array("x", feed, np.dtype(np.int64))
    np.testing.assert_array_equal(got, np.asarray(feed, np.int64))
    assert got.dtype == np.int64


def test_the_on_device_input_check_refuses_none_and_cast() -> None:
    spec = InputSpec.of(helper.make_tensor_value_info("x", TensorProto.FLOAT, []))
    with pytest.raises(InvalidFeed, match="None was fed"):
        spec.check(None)
    with pytest.raises(InvalidArgument, match="float64"):
        spec.check(torch.tensor(1.5, dtype=torch.float64))
    assert spec.check(1.5).dtype == np.float32


@pytest.mark.parametrize("make", [np.matrix, lambda a: np.ma.masked_array(a, mask=[[0, 1], [0, 0]])],
                         ids=["matrix", "masked"])
def test_array_subclasses_are_fed_as_their_data(make: Any) -> None:
    """An np.matrix reached the kernels as one (ReduceSum failed on matrix.sum's keywords) and a masked array
    dropped its masked values from a sum; onnxruntime takes their data."""
    vi = helper.make_tensor_value_info
    g = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["y"]),
                           helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0)], "g",
                          [vi("x", TensorProto.FLOAT, [2, 2])],
                          [vi("y", TensorProto.FLOAT, None), vi("s", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10).SerializeToString()
    x = make(np.array([[1, 2], [3, 4]], np.float32))
    want = onnxruntime.InferenceSession(m, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = onnxtrain.InferenceSession(m).run(None, {"x": x})
    for a, b in zip(got, want):
        assert type(a) is np.ndarray
        np.testing.assert_array_equal(a, b)
