"""Fused Where forms whose one-element fill has a higher rank than the other operand (the Where's output
gains its axes: the fusions returned the lower rank), and outputs over one buffer (each returned apart)."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import InferenceSession
from onnxtrain.engine.plan import Plan


def where_model(kind: str) -> bytes:
    if kind == "masked_softmax":
        fill = numpy_helper.from_array(np.full((1, 1, 1), -np.inf, np.float32), "f")
        nodes = [helper.make_node("Constant", [], ["f"], value=fill),
                 helper.make_node("Where", ["c", "f", "a"], ["w"]),
                 helper.make_node("Softmax", ["w"], ["y"], axis=-1)]
        ins = [helper.make_tensor_value_info("c", TensorProto.BOOL, [4, 5]),
               helper.make_tensor_value_info("a", TensorProto.FLOAT, [4, 5])]
        fused = "MaskedSoftmax"
    else:
        fill = numpy_helper.from_array(np.zeros((1, 1, 1), np.float32), "f")
        nodes = [helper.make_node("Constant", [], ["f"], value=fill),
                 helper.make_node("MatMul", ["a", "b"], ["p"]),
                 helper.make_node("Where", ["c", "p", "f"], ["y"])]
        ins = [helper.make_tensor_value_info("c", TensorProto.BOOL, [4, 5]),
               helper.make_tensor_value_info("a", TensorProto.FLOAT, [4, 3]),
               helper.make_tensor_value_info("b", TensorProto.FLOAT, [3, 5])]
        fused = "InplaceWhere"
    g = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    assert fused in [st.node.op_type for st in Plan(model).steps]  # the premise: the fusion applies
    return model.SerializeToString()


@pytest.mark.parametrize("kind", ["masked_softmax", "where_zero"])
def test_a_fill_of_higher_rank_keeps_its_axes(kind: str) -> None:
    model = where_model(kind)
    rng = np.random.default_rng(0)
    cols = 5 if kind == "masked_softmax" else 3
    feeds = {"c": rng.random((4, 5)) < 0.3, "a": rng.standard_normal((4, cols)).astype(np.float32)}
    if kind == "where_zero":
        feeds["b"] = rng.standard_normal((3, 5)).astype(np.float32)
    want = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = InferenceSession(model).run(None, feeds)[0]
    assert got.shape == want.shape == (1, 4, 5)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_outputs_over_one_buffer_are_returned_apart() -> None:
    """s and Identity(s) were one array: writing into s changed t (onnxruntime returns two)."""
    g = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["s"]), helper.make_node("Identity", ["s"], ["t"]),
         helper.make_node("Cast", ["s"], ["u"], to=TensorProto.FLOAT)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3]) for n in ("s", "t", "u")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    s, t, u = InferenceSession(model).run(None, {"x": np.ones(3, np.float32)})
    assert not np.shares_memory(s, t) and not np.shares_memory(s, u) and not np.shares_memory(t, u)
    s[:] = -1
    np.testing.assert_array_equal(t, [2, 2, 2])
    np.testing.assert_array_equal(u, [2, 2, 2])


def test_training_session_outputs_over_one_buffer_are_returned_apart() -> None:
    from onnxtrain import RunOptions, TrainingParameters, TrainingSession

    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["s"]), helper.make_node("Identity", ["s"], ["t"]),
         helper.make_node("ReduceSum", ["s"], ["loss"], keepdims=0)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(np.eye(3, dtype=np.float32), "W")])
    p = TrainingParameters()
    p.loss_output_name, p.training_optimizer_name = "loss", "SGDOptimizer"
    sess = TrainingSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), p)
    x = np.ones((2, 3), np.float32)
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    for out in (sess.run(None, {"x": x, "Learning_Rate": np.array([0.1], np.float32)})[1:3],
                sess.run(["s", "t"], {"x": x}, ro)):
        assert not np.shares_memory(out[0], out[1])


def test_sequence_items_are_returned_apart() -> None:
    """A sequence output's items over the buffer of another output (SequenceConstruct(y, y)) are copies."""
    g = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["y"]),
         helper.make_node("SequenceConstruct", ["y", "y"], ["s"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2]),
         helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, [2])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    y, s = InferenceSession(model).run(None, {"x": np.array([0.5, 1.0], np.float32)})
    assert not np.shares_memory(y, s[0]) and not np.shares_memory(s[0], s[1])
    y[:] = 100
    np.testing.assert_array_equal(np.asarray(s), [[1, 2], [1, 2]])


def test_inference_iobinding_takes_outputs_its_model_misdeclares() -> None:
    """y declared [N] for x [N] but computed 2N long: onnxruntime runs it into a [2N] buffer, so does an
    inference session (a training session checks the declared sizes first: its run changes state)."""
    g = helper.make_graph(
        [helper.make_node("Concat", ["x", "x"], ["y"], axis=0)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    sess = InferenceSession(model.SerializeToString())
    x, out = np.array([1.0, 2.0], np.float32), np.zeros(4, np.float32)
    bind = sess.io_binding()
    bind.bind_cpu_input("x", x)
    bind.bind_output("y", "cpu", 0, np.float32, [4], out.ctypes.data)
    sess.run_with_iobinding(bind)
    np.testing.assert_array_equal(out, [1, 2, 1, 2])


def test_outputs_never_alias_feeds_or_constants() -> None:
    """A sequence's items and a training session's outputs are the caller's too: not the feed x (writing the
    output changed the feed) and not a read-only initializer (as onnxruntime returns copies)."""
    from onnxtrain import RunOptions, TrainingParameters, TrainingSession

    w = numpy_helper.from_array(np.full(4, 7.0, np.float32), "W")
    g = helper.make_graph(
        [helper.make_node("SequenceConstruct", ["x", "W"], ["s"]),
         helper.make_node("Identity", ["x"], ["ix"]), helper.make_node("Mul", ["x", "W"], ["p"]),
         helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0)],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("ix", TensorProto.FLOAT, [4]),
         helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, [4])], [w])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = np.ones(4, np.float32)
    _, ix, s = InferenceSession(model.SerializeToString()).run(None, {"x": x})
    assert not np.shares_memory(s[0], x) and s[1].flags.writeable and not np.shares_memory(ix, x)
    p = TrainingParameters()
    p.loss_output_name, p.training_optimizer_name = "loss", "SGDOptimizer"
    sess = TrainingSession(model, p)
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    ix, s = sess.run(["ix", "s"], {"x": x}, ro)
    assert not np.shares_memory(ix, x) and not np.shares_memory(s[0], x) and s[1].flags.writeable
    assert not np.shares_memory(s[1], sess.get_state()["W"])


def test_path_run_output_of_a_weight_is_a_copy() -> None:
    """A legacy session's path-only run returning Identity(W) handed out the session's own W: writing it
    changed the weight (the onnxruntime backend returned a copy)."""
    from onnxtrain import RunOptions, TrainingParameters, TrainingSession

    g = helper.make_graph(
        [helper.make_node("Identity", ["W"], ["w_out"]), helper.make_node("Mul", ["x", "W"], ["p"]),
         helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("w_out", TensorProto.FLOAT, [3])],
        [numpy_helper.from_array(np.full(3, 0.8, np.float32), "W")])
    p = TrainingParameters()
    p.loss_output_name, p.training_optimizer_name = "loss", "SGDOptimizer"
    sess = TrainingSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), p)
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    w = sess.run(["w_out"], {"x": np.ones(3, np.float32)}, ro)[0]
    w[:] = -1
    np.testing.assert_array_equal(sess.get_state()["W"], np.full(3, 0.8, np.float32))
