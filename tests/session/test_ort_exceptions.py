"""onnxruntime's exception classes, importable where ported scripts import them, catch onnxtrain's errors
of the same kind; each is also the Python class onnxtrain raised before."""

from __future__ import annotations

import numpy as np
import pytest

from onnxtrain import InferenceSession, SessionOptions, TrainingSession
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


@pytest.mark.parametrize("setting, pattern", [
    ({"loss_output_name": "nope"}, "nope"),
    ({"training_optimizer_name": "Adagrad"}, "Adagrad"),
    ({"gradient_accumulation_mode": "sometimes"}, "gradient_accumulation_mode"),
])
def test_setup_errors_are_fail_and_value_error(setting: dict, pattern: str) -> None:
    """onnxruntime's ConfigureForTraining failures reached Python as its ``Fail`` (a RuntimeError, through
    ``OrtPybindThrowIfError``); onnxtrain's are that and the ValueError they were."""
    p = params("SGDOptimizer")
    for k, v in setting.items():
        setattr(p, k, v)
    with pytest.raises(C.Fail, match=pattern) as e:
        TrainingSession(mlp_model().SerializeToString(), p)
    assert isinstance(e.value, ValueError) and isinstance(e.value, RuntimeError)


def test_unimplemented_settings_are_fail_and_not_implemented_error() -> None:
    """ZeRO stage 2 is refused as onnxruntime's ``Fail`` and the ``NotImplementedError`` it was."""
    p = params("AdamOptimizer")
    p.deepspeed_zero_stage = 2
    with pytest.raises(C.Fail, match="deepspeed_zero_stage=2") as e:
        TrainingSession(mlp_model().SerializeToString(), p)
    assert isinstance(e.value, NotImplementedError)


def test_load_state_errors_are_fail_and_key_or_value_error() -> None:
    """``load_state`` failed in onnxruntime's ``SetStateTensors`` (``ORT_THROW_IF_ERROR``: a RuntimeError):
    an unknown name under ``strict`` is also a KeyError (its message plain, not quoted), a wrong shape
    also a ValueError; the state is unchanged."""
    sess = TrainingSession(mlp_model().SerializeToString(), params("SGDOptimizer"))
    before = sess.get_state()
    zeros = np.zeros_like(before["W1"])
    with pytest.raises(C.Fail) as e:  # a good entry first: it must not stay loaded
        sess.load_state({"W1": zeros, "not_there": np.zeros(2, np.float32)}, strict=True)
    assert isinstance(e.value, KeyError)
    assert str(e.value).startswith("load_state: 'not_there' is not a state tensor")
    with pytest.raises(C.Fail, match="b1") as e:
        sess.load_state({"W1": zeros, "b1": np.zeros((2, 2), np.float32)})
    assert isinstance(e.value, ValueError)
    with pytest.raises(C.Fail, match="expected dtype float32, got float64") as e:  # would lose precision
        sess.load_state({"W1": zeros, "b1": before["b1"].astype(np.float64)})
    assert isinstance(e.value, TypeError)
    after = sess.get_state()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])


def test_a_wrong_output_buffer_fails_before_the_run() -> None:
    """A buffer bound to an output of known type and shape is checked before the run: a training run
    that would update the weights and then fail to store an output leaves the state as it was."""
    p = params("SGDOptimizer", gradient_accumulation_steps=2)
    sess = TrainingSession(mlp_model().SerializeToString(), p)
    x, y = batches(1, 4)[0]
    feeds = {"x": x, "y": y, "Learning_Rate": np.array([0.1], np.float32)}
    before = sess.get_state()
    for output, buffer, cls, pattern in (
        ("logits", np.zeros([4, 5], np.float32), C.InvalidArgument,
         r"shape \[4, 5\], the output has \[4, 4\]"),
        ("logits", np.zeros([4], np.float32), C.InvalidArgument, r"shape \[4\], the output has \[4, 4\]"),
        # the batch size N that the bound x fixes (the check skipped symbolic sizes: the run trained first)
        ("logits", np.zeros([5, 4], np.float32), C.InvalidArgument,
         r"shape \[5, 4\], the output has \[4, 4\]"),
        ("Group_Accumulated_Gradients", np.zeros([2], bool), C.InvalidArgument,
         r"shape \[2\], the output has \[1\]"),
        ("Group_Accumulated_Gradients", np.zeros([1], np.float32), C.InvalidArgument,
         r"is tensor\(float\) \(float32\), the output is tensor\(bool\)"),
    ):
        bind = sess.io_binding()
        for name, a in feeds.items():
            bind.bind_input(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
        bind.bind_output(output, "cpu", 0, buffer.dtype, list(buffer.shape), buffer.ctypes.data)
        with pytest.raises(cls, match=pattern):
            sess.run_with_iobinding(bind)
    after = sess.get_state()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])


@pytest.mark.parametrize("break_it,cls,pattern", [
    (lambda m: m.graph.node[1].input.__setitem__(0, "zz"), "InvalidArgument",
     r"node #1 \(unnamed\) \(Relu\): input 'zz' is not produced"),
    (lambda m: setattr(m.graph.node[1], "op_type", "Reluu"), "InvalidGraph",
     r"node #1 \(unnamed\) \(Reluu\): ONNX defines no op 'Reluu'"),
], ids=["undefined-input", "unknown-op"])
def test_graph_defects_are_load_errors_not_gradient_errors(break_it, cls: str, pattern: str) -> None:
    """(they were a Fail saying no weight reaches the loss, or that Reluu has no gradient rule)"""
    m = mlp_model()
    break_it(m)
    for backend in ("numpy", "onnxruntime"):
        so = SessionOptions()
        so.add_session_config_entry("onnxtrain.backend", backend)
        with pytest.raises(getattr(C, cls), match=pattern):
            TrainingSession(m.SerializeToString(), params("SGDOptimizer"), so)
