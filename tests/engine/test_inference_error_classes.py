"""Errors and edge feeds of the inference API as onnxruntime (run side by side, the oracle) has them: the
exception classes a ported ``except RuntimeError`` / ``except InvalidGraph`` / ``except InvalidArgument``
clause catches (onnxtrain raised plain ValueErrors, and Fail where onnxruntime refuses a graph or an
argument), a declared dimension of 0 checked, several values fed to an input declared a scalar taken, and
IOBinding's outputs before the first run."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

import onnxtrain
from onnxtrain.capi import onnxruntime_pybind11_state as ot_state

CPU = ["CPUExecutionProvider"]
LIBS = [pytest.param(ort, id="onnxruntime"), pytest.param(onnxtrain, id="onnxtrain")]


def _model(node: Any, x_shape: list[int | None], y_shape: list[int] | None = None) -> bytes:
    nodes = node if isinstance(node, list) else [node]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, y_shape)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    return model.SerializeToString()


RELU = _model(helper.make_node("Relu", ["X"], ["Y"]), [2], [2])

CASES: dict[str, Callable[[Any], Any]] = {
    "update_inplace_wrong_size": lambda lib: lib.OrtValue.ortvalue_from_numpy(np.zeros(6, np.float32))
    .update_inplace(np.ones(4, np.float32)),
    "ortvalue_on_cuda": lambda lib: lib.OrtValue.ortvalue_from_numpy(np.zeros(2, np.float32), "cuda", 0),
    "negative_shape": lambda lib: lib.OrtValue.ortvalue_from_shape_and_type([-1], np.float32),
    "unknown_provider": lambda lib: lib.InferenceSession(RELU, providers=CPU).set_providers(["FooProvider"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("lib", LIBS)
def test_api_misuse_is_a_runtime_error(lib: Any, case: str) -> None:
    with warnings.catch_warnings(), pytest.raises(RuntimeError):
        warnings.simplefilter("ignore")  # onnxruntime warns of the unknown provider before it raises
        CASES[case](lib)


def _without_opset_import(model: bytes) -> bytes:
    m = onnx.load_from_string(model)
    del m.opset_import[:]
    return m.SerializeToString()


LOAD_CASES = {  # model → the class of onnxruntime's error at load
    "op_onnx_does_not_define": (_model(helper.make_node("FooBar", ["X"], ["Y"]), [2]), "InvalidGraph"),
    "input_nothing_defines": (_model(helper.make_node("Add", ["X", "Q"], ["Y"]), [2]), "InvalidArgument"),
    # it loaded at the newest opset (a guess that changes what old ops mean)
    "no_opset_import": (_without_opset_import(RELU), "Fail"),
    # a Fail saying "no kernel", not that the import is missing
    "domain_not_imported": (_model(helper.make_node("Relu", ["X"], ["Y"], domain="my.domain"), [2]),
                            "InvalidGraph"),
    "empty_bytes": (b"", "InvalidArgument"),  # was an InvalidProtobuf only
    "two_nodes_of_one_name": (_model([helper.make_node("Relu", ["X"], ["H"], name="a"),
                                      helper.make_node("Relu", ["H"], ["Y"], name="a")], [2]), "Fail"),
}


@pytest.mark.parametrize("case", sorted(LOAD_CASES))
def test_a_bad_graph_is_refused_with_onnxruntimes_error_class(case: str) -> None:
    model, cls = LOAD_CASES[case]
    with pytest.raises(getattr(ort_state, cls)):
        ort.InferenceSession(model, providers=CPU)
    with pytest.raises(getattr(ot_state, cls)):
        onnxtrain.InferenceSession(model)


@pytest.mark.parametrize("case,pattern", [("no_opset_import", "imports no opset"),
                                          ("domain_not_imported", "no opset import for domain 'my.domain'"),
                                          ("two_nodes_of_one_name", r"several nodes named \['a'\]")])
def test_opset_import_errors_say_so(case: str, pattern: str) -> None:
    with pytest.raises(RuntimeError, match=pattern):
        onnxtrain.InferenceSession(LOAD_CASES[case][0])


@pytest.mark.parametrize("lib", LIBS)
def test_a_declared_zero_dimension_is_checked(lib: Any) -> None:
    s = lib.InferenceSession(_model(helper.make_node("Relu", ["X"], ["Y"]), [0, 3]), providers=CPU)
    assert s.run(None, {"X": np.zeros((0, 3), np.float32)})[0].shape == (0, 3)
    with pytest.raises(lib.capi.onnxruntime_pybind11_state.InvalidArgument, match="X"):
        s.run(None, {"X": np.ones((2, 3), np.float32)})


def test_several_values_fed_to_a_declared_scalar_run_as_onnxruntime() -> None:
    model = _model(helper.make_node("Neg", ["X"], ["Y"]), [], [])
    x = np.array([2.0, 3.0], np.float32)
    want = ort.InferenceSession(model, providers=CPU).run(None, {"X": x})[0]
    np.testing.assert_array_equal(onnxtrain.InferenceSession(model).run(None, {"X": x})[0], want)
    np.testing.assert_array_equal(want, -x)


@pytest.mark.parametrize("lib", LIBS)
def test_outputs_bound_by_name_are_empty_values_before_a_run(lib: Any) -> None:
    s = lib.InferenceSession(RELU, providers=CPU)
    b = s.io_binding()
    b.bind_cpu_input("X", np.array([-1.0, 2.0], np.float32))
    b.bind_output("Y")
    before = b.get_outputs()
    assert len(before) == 1 and not before[0].has_value()
    s.run_with_iobinding(b)
    np.testing.assert_array_equal(b.get_outputs()[0].numpy(), [0.0, 2.0])


@pytest.mark.parametrize("bad", [["CPUExecutionProvider"], "run_options", {"intra_op_num_threads": 1}],
                         ids=["providers_list", "run_options", "dict"])
def test_sess_options_of_another_kind_is_a_type_error(bad: Any) -> None:
    """A providers list passed in the place of sess_options (or RunOptions, a dict): onnxruntime's
    constructor raises a TypeError; onnxtrain failed later on an AttributeError of the list."""
    with pytest.raises(TypeError):
        ort.InferenceSession(RELU, ort.RunOptions() if bad == "run_options" else bad)
    bad = onnxtrain.RunOptions() if bad == "run_options" else bad
    p = onnxtrain.TrainingParameters()
    p.loss_output_name = "Y"
    makers = (lambda: onnxtrain.InferenceSession(RELU, bad), lambda: onnxtrain.TrainingSession(RELU, p, bad))
    for make in makers:
        with pytest.raises(TypeError, match="sess_options must be a SessionOptions"):
            make()
    onnxtrain.InferenceSession(RELU, ort.SessionOptions())  # onnxruntime's own options are read as ours


@pytest.mark.parametrize("op", ["Relu", "Tanh", "Sigmoid"])
def test_a_session_does_not_pickle_with_one_type_error(op: str) -> None:
    """As onnxruntime's: a TypeError naming the class (it was a TypeError or an AttributeError depending on
    the model's kernels, naming a lock or a local function)."""
    import pickle

    model = _model(helper.make_node(op, ["X"], ["Y"]), [2], [2])
    with pytest.raises(TypeError, match="cannot pickle .*InferenceSession"):
        pickle.dumps(ort.InferenceSession(model, providers=CPU))
    with pytest.raises(TypeError, match="cannot pickle 'onnxtrain.inference.InferenceSession' object"):
        pickle.dumps(onnxtrain.InferenceSession(model))
    p = onnxtrain.TrainingParameters()
    p.loss_output_name = "Y"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        training = onnxtrain.TrainingSession(model, p)
    with pytest.raises(TypeError, match="cannot pickle 'onnxtrain.session.TrainingSession' object"):
        pickle.dumps(training)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("key,value", [(1, "2"), ("k", 2)])
def test_config_entries_take_strings_only(lib: Any, key: Any, value: Any) -> None:
    """(onnxtrain stored str(1), str(2): a typo'd value reached the code reading it as text; None too,
    which crashes onnxruntime's binding, so is not run there)"""
    if lib is onnxtrain:
        with pytest.raises(TypeError):
            lib.SessionOptions().add_session_config_entry("k", None)
    with pytest.raises(TypeError):
        lib.SessionOptions().add_session_config_entry(key, value)
    with pytest.raises(TypeError):
        lib.RunOptions().add_run_config_entry(key, value)
