"""onnxruntime's exception classes, importable where ported scripts import them, catch onnxtrain's errors
of the same kind; each is also the Python class onnxtrain raised before."""

from __future__ import annotations

import numpy as np
import pytest

from onnxtrain import InferenceSession, TrainingSession
from onnxtrain.capi import _pybind_state as C
from tests.session.helpers import batches, mlp_model, params

NAMES = ("Fail", "InvalidArgument", "NoSuchFile", "NoModel", "EngineError", "RuntimeException",
         "InvalidProtobuf", "ModelLoaded", "NotImplemented", "InvalidGraph", "EPFail")


def test_every_name_is_a_runtime_error_class() -> None:
    for name in NAMES:
        cls = getattr(C, name)
        assert isinstance(cls, type) and issubclass(cls, RuntimeError), name
        assert name in C.__all__
    assert len({getattr(C, n) for n in NAMES}) == len(NAMES)


def test_bad_feeds_are_invalid_argument_and_value_or_type_errors() -> None:
    sess = TrainingSession(mlp_model().SerializeToString(), params("SGDOptimizer"))
    x, y = batches(1, 4)[0]
    lr = np.array([0.1], np.float32)
    with pytest.raises(C.InvalidArgument, match="'x'") as e:
        sess.run(["loss"], {"x": x.astype(np.float64), "y": y, "Learning_Rate": lr})
    assert isinstance(e.value, TypeError)
    with pytest.raises(C.InvalidArgument, match="rank") as e:
        sess.run(["loss"], {"x": x[0], "y": y, "Learning_Rate": lr})
    assert isinstance(e.value, ValueError)
    with pytest.raises(C.InvalidArgument, match="unknown output 'nope'"):
        sess.run(["nope"], {"x": x, "y": y, "Learning_Rate": lr})
    with pytest.raises(C.InvalidArgument, match="'nope' is not produced"):
        sess.is_output_fp32_node("nope")


def test_a_failing_run_is_fail() -> None:
    import onnx
    from onnx import TensorProto, helper

    # a Reshape to a size the input does not have fails inside the run
    g = helper.make_graph([helper.make_node("Reshape", ["x", "s"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None]),
                           helper.make_tensor_value_info("s", TensorProto.INT64, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    sess = InferenceSession(model.SerializeToString())
    with pytest.raises(C.Fail, match="Reshape"):
        sess.run(None, {"x": np.zeros(6, np.float32), "s": np.array([4], np.int64)})


def test_module_inputs_of_the_wrong_type_or_rank_are_invalid_argument() -> None:
    from onnxtrain.training.api._graph import InputSpec

    spec = InputSpec("x", np.dtype(np.float32), ("batch", 3))
    with pytest.raises(C.InvalidArgument, match="'x': unexpected data type"):
        spec.check(np.zeros((2, 3), np.float64))
    with pytest.raises(C.InvalidArgument, match="'x': invalid rank"):
        spec.check(np.zeros(3, np.float32))
    assert spec.check(np.zeros((2, 3), np.float32)).shape == (2, 3)


def test_the_compiled_modules_name_holds_the_same_names() -> None:
    """``from onnxruntime.capi.onnxruntime_pybind11_state import Fail`` ports by changing the package."""
    from onnxtrain.capi import onnxruntime_pybind11_state as P

    for name in (*NAMES, "SessionOptions", "OrtValue", "GradientGraphBuilder", "TrainingSession"):
        assert getattr(P, name) is getattr(C, name), name
