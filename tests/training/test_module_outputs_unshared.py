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


P = np.arange(12, dtype=np.float32).reshape(3, 4) / 10


def _model_of(nodes: list, x_dims: list, outputs: dict[str, list], inits: tuple = ()) -> onnx.ModelProto:
    """A model of ``nodes`` with input x of ``x_dims``, float outputs ``{name: dims}`` (logits first) and the
    weight P (3 × 4) with ``inits``."""
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, x_dims)],
                          [helper.make_tensor_value_info(n, F, dims) for n, dims in outputs.items()],
                          [numpy_helper.from_array(P, "P"), *inits])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _module(model: onnx.ModelProto, folder, extra: list[str]) -> tuple[CheckpointState, Module]:
    """The state and Module of ``model``'s artifacts in ``folder``: P trained by SGD on the MSE of logits,
    ``extra`` its additional outputs."""
    artifacts.generate_artifacts(model, requires_grad=["P"], loss=artifacts.LossType.MSELoss,
                                 loss_input_names=["logits"], additional_output_names=extra,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=folder)
    state = CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    return state, Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"))


def _model() -> onnx.ModelProto:
    """logits = x·Pᵀ; flat = Reshape(P, [-1]); rows = P[1:]."""
    nodes = [helper.make_node("Gemm", ["x", "P"], ["logits"], transB=1),
             helper.make_node("Reshape", ["P", "minus_one"], ["flat"]),
             helper.make_node("Slice", ["P", "one", "three"], ["rows"])]
    inits = [numpy_helper.from_array(np.array([v], np.int64), n)
             for n, v in (("minus_one", -1), ("one", 1), ("three", 3))]
    return _model_of(nodes, ["N", 4], {"logits": ["N", 3], "flat": [12], "rows": [2, 4]}, tuple(inits))


def test_outputs_of_a_parameter_are_not_views_of_it(tmp_path) -> None:
    state, module = _module(_model(), tmp_path, ["flat", "rows"])
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
    nodes = [helper.make_node("Flatten", ["x"], ["flat"], axis=1),
             helper.make_node("Identity", ["flat"], ["flat_id"]),
             helper.make_node("Gemm", ["flat", "P"], ["logits"], transB=1)]
    return _model_of(nodes, ["N", 4, 1], {"logits": ["N", 3], "flat": ["N", 4], "flat_id": ["N", 4]})


def test_outputs_are_apart_from_the_callers_inputs_and_from_each_other(tmp_path) -> None:
    _, module = _module(_passthrough_model(), tmp_path, ["flat", "flat_id"])
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
