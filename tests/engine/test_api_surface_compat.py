"""Names of onnxruntime's Python API that ported scripts (and onnxruntime's own tests) use, against
onnxruntime side by side: run_async with its callback, the providers' order (the CPU's last), OrtDevice.make,
OrtValueVector and IOBinding.get_outputs_as_ortvaluevector, enum values printed by name,
get_version_string."""

from __future__ import annotations

import threading

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnxtrain
from onnxtrain.capi.onnxruntime_pybind11_state import OrtValueVector


def _model() -> bytes:
    g = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("lib", [ort, onnxtrain], ids=["onnxruntime", "onnxtrain"])
def test_the_api_surface(lib) -> None:
    sess = lib.InferenceSession(_model(), providers=["CPUExecutionProvider"])
    done, got = threading.Event(), {}

    def callback(outputs, data, error) -> None:
        got.update(outputs=outputs, data=data, error=error)
        done.set()

    sess.run_async(["y"], {"x": np.array([1.0, -2.0], np.float32)}, callback, 7)
    assert done.wait(10)
    np.testing.assert_array_equal(got["outputs"][0], [-1.0, 2.0])
    assert got["data"] == 7 and not got["error"]
    # a failed run hands the callback [] and the error's text; a missing input is refused at the call
    done.clear()
    sess.run_async(["y"], {"x": np.array([1, 2], np.int64)}, callback, 8)
    assert done.wait(10)
    assert got["outputs"] == [] and got["data"] == 8 and "float" in got["error"]
    with pytest.raises(ValueError, match=r"[Mm]issing"):
        sess.run_async(["y"], {"z": np.ones(2, np.float32)}, callback, 9)
    assert lib.get_all_providers()[-1] == "CPUExecutionProvider"
    assert lib.OrtDevice.make("cpu", 0).device_type() == 0  # the CPU
    io = sess.io_binding()
    io.bind_cpu_input("x", np.ones(2, np.float32))
    io.bind_output("y")
    sess.run_with_iobinding(io)
    assert len(io.get_outputs_as_ortvaluevector()) == 1
    assert str(lib.GraphOptimizationLevel.ORT_ENABLE_ALL) == "GraphOptimizationLevel.ORT_ENABLE_ALL"
    assert isinstance(lib.get_version_string(), str)


@pytest.mark.parametrize("lib", [ort, onnxtrain], ids=["onnxruntime", "onnxtrain"])
def test_the_inference_collection_module(lib) -> None:
    """``from onnxruntime.capi.onnxruntime_inference_collection import OrtValue`` ports by the import's
    package name (the module was missing)."""
    import importlib

    mod = importlib.import_module(f"{lib.__name__}.capi.onnxruntime_inference_collection")
    assert mod.OrtValue is lib.OrtValue and mod.InferenceSession is lib.InferenceSession
    assert mod.IOBinding is lib.IOBinding and isinstance(mod.InferenceSession(_model()), mod.Session)


@pytest.mark.parametrize("lib", [ort, onnxtrain], ids=["onnxruntime", "onnxtrain"])
def test_output_names_that_are_not_strings_are_a_type_error(lib) -> None:
    """A nested list of output names: onnxruntime's binding refuses the argument's type; onnxtrain said the
    output was unknown, listing the same name among the session's."""
    sess = lib.InferenceSession(_model(), providers=["CPUExecutionProvider"])
    with pytest.raises(TypeError):
        sess.run([["y"]], {"x": np.ones(2, np.float32)})


def test_the_training_builds_value_helpers() -> None:
    """What onnxruntime-training's own OrtValue tests used (its builds had them, plain onnxruntime has not):
    ``OrtValue.proto_type()`` (the element type number), ``OrtValueVector.to_dlpack`` sharing each value's
    memory, and ``GradientGraphBuilder`` importable from the training package."""
    torch = pytest.importorskip("torch")
    import onnxtrain.training

    arrays = [np.arange(6, dtype=np.float32).reshape(3, 2), np.array([1, 0, 1], np.int64)]
    values = [onnxtrain.OrtValue.ortvalue_from_numpy(a)._ortvalue for a in arrays]
    assert [v.proto_type() for v in values] == [TensorProto.FLOAT, TensorProto.INT64]
    vector = OrtValueVector()
    vector.reserve(2)
    for v in values:
        vector.push_back(v)
    assert [vector.element_type_at(i) for i in range(2)] == [TensorProto.FLOAT, TensorProto.INT64]
    capsules = vector.to_dlpack(None)
    assert all("PyCapsule" in str(type(c)) for c in capsules)
    back = [onnxtrain.capi.onnxruntime_pybind11_state.OrtValue.from_dlpack(c, False) for c in capsules]
    tensors = vector.to_dlpack(torch.from_dlpack)
    for a, v, t in zip(arrays, back, tensors):
        assert v.data_ptr() == a.ctypes.data == t.data_ptr()  # shared, not copied
        np.testing.assert_array_equal(t.numpy(), a)
    assert onnxtrain.training.GradientGraphBuilder is onnxtrain.GradientGraphBuilder
