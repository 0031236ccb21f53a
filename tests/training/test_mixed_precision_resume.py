"""A mixed-precision Module resumes its dynamic loss scaler from a saved checkpoint.

``CheckpointState.save_checkpoint`` records the scaler's scale and count of clean steps (property
``onnxtrain.loss_scaler``); a Module built over the loaded state continues as the uninterrupted one does.
"""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.checkpoint import load_checkpoint
from onnxtrain.graph_transforms.loss_scaler import DynamicLossScaler
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module, Optimizer
from tests.ortt import PREAMBLE, ensure_ortt, run_script

MICRO = 2  # micro-batches a step accumulates
LOSS_SCALER_PROPERTY = "onnxtrain.loss_scaler"


def _mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = {"W1": rng.standard_normal((4, 8)) * 0.5, "b1": rng.standard_normal(8) * 0.1,
             "W2": rng.standard_normal((8, 3)) * 0.5, "b2": rng.standard_normal(3) * 0.1}
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h0"]), helper.make_node("Add", ["h0", "b1"], ["h"]),
             helper.make_node("Tanh", ["h"], ["a"]), helper.make_node("MatMul", ["a", "W2"], ["o0"]),
             helper.make_node("Add", ["o0", "b2"], ["o"]), helper.make_node("Sub", ["o", "y"], ["d"]),
             helper.make_node("Mul", ["d", "d"], ["d2"]),
             helper.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 4]),
                       helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("mp_resume"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        artifacts.generate_artifacts(_mlp(), requires_grad=["W1", "b1", "W2", "b2"], loss=None,
                                     optimizer=artifacts.OptimType.AdamW, artifact_directory=d,
                                     mixed_precision="float16")
    return d


def _batch(step: int, micro: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 * step + micro)
    x, y = rng.standard_normal((2, 4)).astype(np.float32), rng.standard_normal((2, 3)).astype(np.float32)
    if step == 1 and micro == 1:
        y *= np.float32(3e3)  # the scaled float16 gradients overflow: step 1 is skipped, the scale halves
    return x, y


def _open(folder: str, checkpoint: str) -> tuple[CheckpointState, Module, Optimizer]:
    state = CheckpointState.load_checkpoint(checkpoint)
    # a short window: the doubling after the resume depends on the restored count of clean steps
    module = Module(os.path.join(folder, "training_model.onnx"), state,
                    loss_scaler=DynamicLossScaler(loss_scale=1024.0, up_scale_window=3))
    opt = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    opt.set_learning_rate(0.01)
    return state, module, opt


def _step(module: Module, opt: Optimizer, step: int) -> tuple[bool | None, float, int]:
    for micro in range(MICRO):
        module(*_batch(step, micro))
    opt.step()
    module.lazy_reset_grad()
    scaler = module.loss_scaler
    assert isinstance(scaler, DynamicLossScaler)
    return opt.last_step_finite, scaler.loss_scale, scaler.stable_steps


def test_resumed_run_is_bit_identical(folder, tmp_path):
    """Overflow, one clean step, save; the resumed run matches the uninterrupted one step by step (scale,
    clean steps, skips) and in its weights and moments."""
    state, module, opt = _open(folder, os.path.join(folder, "checkpoint"))
    before_save = [_step(module, opt, s) for s in range(3)]
    assert [f for f, _, _ in before_save] == [True, False, True]
    assert before_save[-1][1:] == (512.0, 1)
    path = str(tmp_path / "ck")
    CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)
    state2, module2, opt2 = _open(folder, path)
    assert module2.loss_scaler.loss_scale == 512.0 and module2.loss_scaler.stable_steps == 1
    after = [_step(module, opt, s) for s in range(3, 9)]
    assert [_step(module2, opt2, s) for s in range(3, 9)] == after
    assert [scale for _, scale, _ in after] == [512.0, 1024.0, 1024.0, 1024.0, 2048.0, 2048.0]
    assert opt2.step_count == opt.step_count
    for name, p in state.parameters:
        np.testing.assert_array_equal(state2.parameters[name].data, p.data, err_msg=name)
    for p, moments in state._optimizer_state().moments.items():
        for key, m in moments.items():
            np.testing.assert_array_equal(state2._optimizer_state().moments[p][key], m, err_msg=f"{p}.{key}")


def test_property_is_reserved_and_kept(folder, tmp_path):
    """The scaler state is an onnxtrain property: hidden from ``properties``, refused as a user name, beside
    the user's own; a state loaded and saved again without a Module keeps it."""
    state, module, opt = _open(folder, os.path.join(folder, "checkpoint"))
    for s in range(2):
        _step(module, opt, s)
    state.properties["loss_scale"] = 7  # the user's own name, not onnxtrain's
    with pytest.raises(ValueError, match="reserved"):
        state.properties[LOSS_SCALER_PROPERTY] = "x"
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    CheckpointState.save_checkpoint(state, first)
    saved = load_checkpoint(first).properties
    assert json.loads(saved[LOSS_SCALER_PROPERTY]) == {"loss_scale": 512.0, "stable_steps": 0}
    loaded = CheckpointState.load_checkpoint(first)
    assert dict(loaded.properties) == {"loss_scale": 7}
    CheckpointState.save_checkpoint(loaded, second)
    assert load_checkpoint(second).properties == saved


def test_checkpoint_without_scaler_state(folder, tmp_path):
    """The generated checkpoint (no scaler property) loads as before: the scaler keeps its own initial
    state; an unreadable property is ignored with a warning."""
    _, module, _ = _open(folder, os.path.join(folder, "checkpoint"))
    assert LOSS_SCALER_PROPERTY not in load_checkpoint(os.path.join(folder, "checkpoint")).properties
    assert module.loss_scaler.loss_scale == 1024.0 and module.loss_scaler.stable_steps == 0
    default = Module(os.path.join(folder, "training_model.onnx"),
                     CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint")))
    assert default.loss_scaler.loss_scale == 65536.0
    ckpt = load_checkpoint(os.path.join(folder, "checkpoint"))
    ckpt.properties[LOSS_SCALER_PROPERTY] = "not json"
    from onnxtrain.checkpoint import save_checkpoint

    path = str(tmp_path / "bad")
    save_checkpoint(ckpt, path)
    with pytest.warns(UserWarning, match="not a loss scaler state"):
        bad = CheckpointState.load_checkpoint(path)
    assert Module(os.path.join(folder, "training_model.onnx"), bad).loss_scaler.loss_scale == 65536.0


_ORT_SCRIPT = PREAMBLE + r"""
from onnxruntime.training.api import CheckpointState
state = CheckpointState.load_checkpoint(sys.argv[1])
print(json.dumps(state.properties[sys.argv[2]]))
"""


def test_onnxruntime_training_loads_it(folder, tmp_path):
    """onnxruntime-training 1.19.2 loads the checkpoint and sees the scaler state as a string property."""
    python = ensure_ortt()
    state, module, opt = _open(folder, os.path.join(folder, "checkpoint"))
    for s in range(2):
        _step(module, opt, s)
    path = str(tmp_path / "ck")
    CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)
    got = run_script(_ORT_SCRIPT, path, LOSS_SCALER_PROPERTY, python=python)
    assert json.loads(got) == {"loss_scale": 512.0, "stable_steps": 0}
