"""A ``Module`` output that reshapes or slices a parameter is an array of its own: the next update does not
change it and writing into it does not change the weight (the numpy engine returned views of the live
weights), in training and in eval mode, as onnxruntime-training's outputs (arrays of their own)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module, Optimizer

F = TensorProto.FLOAT


def _model() -> onnx.ModelProto:
    """logits = x·Pᵀ; flat = Reshape(P, [-1]); rows = P[1:]."""
    p = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    nodes = [helper.make_node("Gemm", ["x", "P"], ["logits"], transB=1),
             helper.make_node("Reshape", ["P", "minus_one"], ["flat"]),
             helper.make_node("Slice", ["P", "one", "three"], ["rows"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["N", 4])],
                          [helper.make_tensor_value_info("logits", F, ["N", 3]),
                           helper.make_tensor_value_info("flat", F, [12]),
                           helper.make_tensor_value_info("rows", F, [2, 4])],
                          [numpy_helper.from_array(p, "P"),
                           numpy_helper.from_array(np.array([-1], np.int64), "minus_one"),
                           numpy_helper.from_array(np.array([1], np.int64), "one"),
                           numpy_helper.from_array(np.array([3], np.int64), "three")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_outputs_of_a_parameter_are_not_views_of_it(tmp_path) -> None:
    artifacts.generate_artifacts(_model(), requires_grad=["P"], loss=artifacts.LossType.MSELoss,
                                 loss_input_names=["logits"], additional_output_names=["flat", "rows"],
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    module = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    opt = Optimizer(str(tmp_path / "optimizer_model.onnx"), module)
    opt.set_learning_rate(0.5)
    x, y = np.ones((2, 4), np.float32), np.zeros((2, 3), np.float32)
    weight = state.parameters["P"].data
    before = weight.copy()
    _, flat, rows = module(x, y)
    module.eval()
    eval_flat = module(x, y)[1]
    for out, want in ((flat, before.reshape(-1)), (rows, before[1:]), (eval_flat, before.reshape(-1))):
        assert not np.shares_memory(out, weight)
        np.testing.assert_array_equal(out, want)
    opt.step()
    assert not np.array_equal(state.parameters["P"].data, before)  # the step moved the weight
    np.testing.assert_array_equal(flat, before.reshape(-1))  # and not the outputs returned before it
    np.testing.assert_array_equal(eval_flat, before.reshape(-1))
    rows[:] = 0
    assert state.parameters["P"].data[1:].any()


def _passthrough_model() -> onnx.ModelProto:
    """logits = Flatten(x)·Pᵀ; outputs also flat = Flatten(x) (a view of the caller's input) and flat_id =
    Identity(flat) (the same array again)."""
    p = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    nodes = [helper.make_node("Flatten", ["x"], ["flat"], axis=1),
             helper.make_node("Identity", ["flat"], ["flat_id"]),
             helper.make_node("Gemm", ["flat", "P"], ["logits"], transB=1)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["N", 4, 1])],
                          [helper.make_tensor_value_info("logits", F, ["N", 3]),
                           helper.make_tensor_value_info("flat", F, ["N", 4]),
                           helper.make_tensor_value_info("flat_id", F, ["N", 4])],
                          [numpy_helper.from_array(p, "P")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_outputs_are_apart_from_the_callers_inputs_and_from_each_other(tmp_path) -> None:
    artifacts.generate_artifacts(_passthrough_model(), requires_grad=["P"], loss=artifacts.LossType.MSELoss,
                                 loss_input_names=["logits"], additional_output_names=["flat", "flat_id"],
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    module = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    buf = np.arange(8, dtype=np.float32).reshape(2, 4, 1)  # one input buffer, refilled every batch
    y = np.zeros((2, 3), np.float32)
    for mode in ("train", "eval"):
        getattr(module, mode)()
        buf[...] = np.arange(8, dtype=np.float32).reshape(2, 4, 1)
        _, flat, flat_id = module(buf, y)
        kept = flat.copy()
        assert not np.shares_memory(flat, buf) and not np.shares_memory(flat, flat_id)
        buf[...] = -1  # the next batch
        np.testing.assert_array_equal(flat, kept)
        flat[...] = 7  # the caller's output: its other output and the input stay
        np.testing.assert_array_equal(flat_id, kept)
        assert (buf == -1).all()
