"""An inference session holds its weights once: on the numpy engine the plan holds the arrays and the
session's model only their names, types and dims; on the onnxruntime backend the plan converts a weight only
when it is read. Values are checked against plain onnxruntime (the oracle) on the same model."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.engine.interface import KEPT_VALUES, heavy, without_values


def _model() -> onnx.ModelProto:
    """y = relu(x · W1 + b) · W2, and h = x · W1 (an output whose path does not read W2); W1 and W2 big,
    b and the Reshape's shape small."""
    rng = np.random.default_rng(0)
    inits = {"W1": rng.standard_normal((64, 128)).astype(np.float32),
             "W2": rng.standard_normal((128, 40)).astype(np.float32),
             "b": rng.standard_normal(128).astype(np.float32), "shape": np.array([-1, 40], np.int64)}
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Add", ["h", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["r"]), helper.make_node("MatMul", ["r", "W2"], ["m"]),
             helper.make_node("Reshape", ["m", "shape"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 40]),
                           helper.make_tensor_value_info("h", TensorProto.FLOAT, ["n", 128])],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="test")
    m.ir_version = 9
    return m


def _oracle(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def test_the_numpy_sessions_model_holds_no_second_copy_of_the_weights() -> None:
    model = _model()
    kept = model.SerializeToString()
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    want = _oracle(model, {"x": x})
    sess = onnxtrain.InferenceSession(model)
    got = sess.run(None, {"x": x})
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    inits = {t.name: t for t in sess._model.graph.initializer}
    assert not inits["W1"].raw_data and not inits["W2"].raw_data  # names, types and dims only
    assert list(inits["W1"].dims) == [64, 128] and inits["W1"].data_type == TensorProto.FLOAT
    b = numpy_helper.to_array(model.graph.initializer[2])
    np.testing.assert_array_equal(numpy_helper.to_array(inits["b"]), b)  # small ones keep their values
    assert model.SerializeToString() == kept  # the caller's model is not changed
    # a run of only the path to h builds another plan from the emptied model: it shares the session's arrays
    ro = onnxtrain.RunOptions()
    ro.only_execute_path_to_fetches = True
    np.testing.assert_allclose(sess.run(["h"], {"x": x}, ro)[0], want[1], rtol=1e-5, atol=1e-5)
    plans = [p for _, p in sess._path_plans.values() if p is not None]
    assert all(p.initializers["W1"] is sess._plan.initializers["W1"] for p in plans)


def test_a_dump_of_the_model_holds_the_weights(tmp_path) -> None:
    so = onnxtrain.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "dump.onnx")
    model = _model()
    onnxtrain.InferenceSession(model.SerializeToString(), so)
    dump = onnx.load(str(tmp_path / "dump.onnx"))
    dumped = {t.name: numpy_helper.to_array(t) for t in dump.graph.initializer}
    for t in model.graph.initializer:
        np.testing.assert_array_equal(dumped[t.name], numpy_helper.to_array(t))


def test_without_values_copies_everything_but_the_big_tensors_values() -> None:
    """The emptied copy equals the model with those tensors' data cleared, and nothing else changed; a model
    with no big tensor is returned as it is."""
    model = _model()
    model.metadata_props.add(key="k", value="v")
    hollow = without_values(model)
    want = onnx.ModelProto()
    want.CopyFrom(model)
    for t in want.graph.initializer:
        if t.name in ("W1", "W2"):
            t.ClearField("raw_data")
    assert hollow == want
    assert [heavy(t) for t in model.graph.initializer] == [True, True, False, False]
    small = helper.make_model(helper.make_graph([], "g", [], [], [numpy_helper.from_array(
        np.zeros(KEPT_VALUES, np.float32), "z")]))
    assert without_values(small) is small
    with pytest.raises(ValueError):  # reading an emptied tensor's values fails loudly
        numpy_helper.to_array(hollow.graph.initializer[0])


def test_the_backend_converts_a_weight_only_when_read() -> None:
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    model = _model()
    sess = onnxtrain.InferenceSession(model.SerializeToString(), so)
    x = np.ones((2, 64), np.float32)
    for a, b in zip(sess.run(None, {"x": x}), _oracle(model, {"x": x})):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    arrays = sess._plan.initializers
    assert not isinstance(arrays, dict) and sorted(arrays) == ["W1", "W2", "b", "shape"]
    np.testing.assert_array_equal(arrays["W2"], numpy_helper.to_array(model.graph.initializer[1]))
    assert not arrays["W2"].flags.writeable


def test_the_backends_rewritten_graph_keeps_no_copy_of_the_weights() -> None:
    """A graph onnxtrain rewrites for onnxruntime (here a ``Where(mask, x, 0)``) is a copy of the model: once
    onnxruntime has loaded it, it keeps its weights' names, types and dims only."""
    w = np.random.default_rng(2).standard_normal((64, 128)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Greater", ["m", "zero"], ["c"]),
             helper.make_node("Where", ["c", "m", "zero"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 128])],
                          [numpy_helper.from_array(w, "W"),
                           numpy_helper.from_array(np.array(0, np.float32), "zero")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    sess = onnxtrain.InferenceSession(model.SerializeToString(), so)
    x = np.random.default_rng(3).standard_normal((3, 64)).astype(np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], _oracle(model, {"x": x})[0], rtol=1e-6)
    rewritten = sess._plan.onnxruntime_model
    assert rewritten is not sess._plan.model and "Mul" in [n.op_type for n in rewritten.graph.node]
    kept = {t.name: t for t in rewritten.graph.initializer}
    assert not kept["W"].raw_data and list(kept["W"].dims) == [64, 128]
