"""The Optimizer's update over flat buffers (onnxtrain/training/api/flat_update.py): each step's new weights
and moments are, bit for bit, what onnx.reference computes from the per-parameter optimizer model on the
same inputs; arrays a caller holds stay live; models it does not apply to run as they are."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.reference
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import SessionOptions
from onnxtrain.training import artifacts, onnxblock
from onnxtrain.training.api import CheckpointState, Module, Optimizer
from onnxtrain.training.api.flat_update import SINGLE_MIN

WIDE = 416  # W2 is WIDE × WIDE: at least SINGLE_MIN values, a group of its own
assert WIDE * WIDE >= SINGLE_MIN


def _model(dtype: type = np.float32) -> onnx.ModelProto:
    """x·W1 + b1 → ReLU → ·W2 + b2 → ReLU → ·W3 (6 → WIDE → WIDE → 3)."""
    rng = np.random.default_rng(3)
    shapes = {"W1": (6, WIDE), "b1": (WIDE,), "W2": (WIDE, WIDE), "b2": (WIDE,), "W3": (WIDE, 3)}
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.2).astype(dtype), n)
             for n, s in shapes.items()]
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h1"]), helper.make_node("Add", ["h1", "b1"], ["a1"]),
        helper.make_node("Relu", ["a1"], ["r1"]), helper.make_node("MatMul", ["r1", "W2"], ["h2"]),
        helper.make_node("Add", ["h2", "b2"], ["a2"]), helper.make_node("Relu", ["a2"], ["r2"]),
        helper.make_node("MatMul", ["r2", "W3"], ["logits"]),
    ]
    f = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", f, ["N", 6])],
                          [helper.make_tensor_value_info("logits", f, ["N", 3])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


OPTIMIZERS = {
    "adamw": lambda: onnxblock.optim.AdamW(),
    "adamw-decay-uncorrected": lambda: onnxblock.optim.AdamW(bias_correction=False, betas=(0.8, 0.99),
                                                             eps=1e-7, weight_decay=0.05),
    "sgd": lambda: onnxblock.optim.SGD(),
}


def _artifacts(folder: Path, optimizer: Any, dtype: type = np.float32, **kw: Any) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    artifacts.generate_artifacts(_model(dtype), requires_grad=["W1", "b1", "W2", "b2", "W3"],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=optimizer,
                                 artifact_directory=str(folder), **kw)
    return str(folder)


def _open(folder: str, backend: str | None = None, flat: str | None = None
          ) -> tuple[CheckpointState, Module, Optimizer]:
    so = SessionOptions()
    if backend is not None:
        so.add_session_config_entry("onnxtrain.backend", backend)
    if flat is not None:
        so.add_session_config_entry("onnxtrain.flat_update", flat)
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    module = Module(os.path.join(folder, "training_model.onnx"), state, session_options=so)
    return state, module, Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)


def _batch(i: int, dtype: type = np.float32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + i)
    return rng.standard_normal((16, 6)).astype(dtype), rng.integers(0, 3, 16).astype(np.int64)


def _reference_step(folder: str, state: CheckpointState, opt: Optimizer) -> dict[str, np.ndarray]:
    """The per-parameter optimizer model run by onnx.reference on the state's current values."""
    model = onnx.load(os.path.join(folder, "optimizer_model.onnx"))
    feeds = {"learning_rate": np.array([opt.get_learning_rate()], np.float32),
             "step": np.array([opt.step_count + 1], np.int64)}
    for p in opt._params:
        feeds[p] = state.parameters[p].data.copy()
        feeds[f"{p}_grad"] = state.parameters[p].grad.copy()
        for k, m in opt._opt.moments[p].items():
            feeds[f"{p}.{k}"] = m.copy()
    names = [o.name for o in model.graph.output]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dict(zip(names, onnx.reference.ReferenceEvaluator(model).run(names, feeds)))


@pytest.mark.parametrize("backend,dtype",
                         [(None, np.float32), ("onnxruntime", np.float32), (None, np.float64)])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_step_is_the_per_parameter_model_bit_for_bit(tmp_path, name, backend, dtype) -> None:
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    folder = _artifacts(tmp_path, OPTIMIZERS[name](), dtype)
    state, module, opt = _open(folder, backend)
    assert opt._flat is not None
    groups = {tuple(g.params): g.single for g in opt._flat.groups}
    assert groups == {("W1", "b1", "b2", "W3"): False, ("W2",): True}
    opt.set_learning_rate(0.05)
    for i in range(3):
        module(*_batch(i, dtype))
        want = _reference_step(folder, state, opt)
        opt.step()
        module.lazy_reset_grad()
        for p in opt._params:
            np.testing.assert_array_equal(state.parameters[p].data, want[f"{p}.out"], err_msg=p)
            for k, m in opt._opt.moments[p].items():  # (SGD's moment is never updated: stays zero)
                np.testing.assert_array_equal(m, want.get(f"{p}.{k}.out", 0), err_msg=f"{p}.{k}")
    assert opt.step_count == 3
    # the merged parameters now live in one buffer, the large one in its own array
    merged = next(g for g in opt._flat.groups if not g.single)
    assert all(np.shares_memory(state.parameters[p].data, merged.flat) for p in merged.params)
    assert state.parameters["W2"].data.base is None


@pytest.mark.parametrize("backend", [None, "onnxruntime"])
def test_arrays_held_before_the_first_step_stay_live(tmp_path, backend) -> None:
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    folder = _artifacts(tmp_path, onnxblock.optim.AdamW(weight_decay=0.01))
    state, module, opt = _open(folder, backend)
    held = state.parameters["b1"].data  # taken before any step: must see every update
    start = held.copy()
    for i in range(2):
        module(*_batch(i))
        opt.step()
        module.lazy_reset_grad()
    assert state.parameters["b1"].data is held and not np.array_equal(held, start)
    assert opt._flat.groups[0].held == {"b1"}
    # the others moved into the flat buffer (the training plan's kept binding did not count as a holder)
    merged = opt._flat.groups[0]
    assert all(np.shares_memory(state.parameters[p].data, merged.flat) for p in merged.params if p != "b1")
    # an edit of the held array reaches the next step, as the live weights' would
    held[:] = 0.5
    module(*_batch(3))
    want = _reference_step(folder, state, opt)
    opt.step()
    np.testing.assert_array_equal(held, want["b1.out"])
    np.testing.assert_array_equal(state.parameters["W3"].data, want["W3.out"])


def test_a_saved_and_resumed_run_matches_one_without_the_break(tmp_path) -> None:
    folder = _artifacts(tmp_path, onnxblock.optim.AdamW(weight_decay=0.01))
    state, module, opt = _open(folder)
    for i in range(2):
        module(*_batch(i))
        opt.step()
        module.lazy_reset_grad()
    path = str(tmp_path / "resume.ckpt")
    CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)
    for i in range(2, 4):
        module(*_batch(i))
        opt.step()
        module.lazy_reset_grad()
    resumed = CheckpointState.load_checkpoint(path)
    module2 = Module(os.path.join(folder, "training_model.onnx"), resumed)
    opt2 = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module2)
    assert opt2._flat is not None and opt2.step_count == 2
    for i in range(2, 4):
        module2(*_batch(i))
        opt2.step()
        module2.lazy_reset_grad()
    for p in opt._params:
        np.testing.assert_array_equal(resumed.parameters[p].data, state.parameters[p].data, err_msg=p)


def test_a_parameter_replaced_between_steps_is_taken_in(tmp_path) -> None:
    folder = _artifacts(tmp_path, onnxblock.optim.SGD())
    state, module, opt = _open(folder)
    module(*_batch(0))
    opt.step()
    new = np.full_like(state.parameters["W1"].data, 0.25)
    state._params["W1"].data = new  # what a load that swaps arrays would do
    module.lazy_reset_grad()
    module(*_batch(1))
    want = _reference_step(folder, state, opt)
    opt.step()
    np.testing.assert_array_equal(state.parameters["W1"].data, want["W1.out"])


def test_models_it_does_not_apply_to_run_as_they_are(tmp_path) -> None:
    clip = onnxblock.optim.ClipGradNorm(1.0)
    clipped = _artifacts(tmp_path / "clip", onnxblock.optim.AdamW(clip_grad=clip))
    assert _open(clipped)[2]._flat is None  # the global norm would sum in another order
    mixed = _artifacts(tmp_path / "mp", onnxblock.optim.AdamW(), mixed_precision="float16")
    assert _open(mixed)[2]._flat is None
    plain = _artifacts(tmp_path / "plain", onnxblock.optim.AdamW())
    assert _open(plain, flat="0")[2]._flat is None
    with pytest.raises(ValueError, match="onnxtrain.flat_update"):
        _open(plain, flat="yes")
    # an edited model (epsilon changed by hand) is not what its metadata generates: run as it is
    path = os.path.join(plain, "optimizer_model.onnx")
    model = onnx.load(path)
    eps = [t for t in model.graph.initializer if t.data_type == TensorProto.FLOAT
           and numpy_helper.to_array(t).reshape(-1).tolist() == [np.float32(1e-6)]]
    assert len(eps) == 1
    eps[0].CopyFrom(numpy_helper.from_array(np.array(1e-3, np.float32).reshape(eps[0].dims), eps[0].name))
    onnx.save(model, path)
    state, module, opt = _open(plain)
    assert opt._flat is None
    module(*_batch(0))
    want = _reference_step(plain, state, opt)
    opt.step()
    np.testing.assert_allclose(state.parameters["W2"].data, want["W2.out"], rtol=1e-6, atol=1e-7)


_ORTT_SCRIPT = r"""
from onnxruntime.training import artifacts
import numpy as np
base, folder = json.loads(sys.argv[1])
artifacts.generate_artifacts(onnx.load(base), requires_grad=["W1", "b1", "W2", "b2", "W3"],
                             loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                             artifact_directory=folder)
state, module, opt = open_artifacts(folder, 0.05)
for i in range(3):
    rng = np.random.default_rng(100 + i)
    x, y = rng.standard_normal((16, 6)).astype(np.float32), rng.integers(0, 3, 16).astype(np.int64)
    module(x, y)
    opt.step()
    module.lazy_reset_grad()
print(json.dumps({p: state.parameters[p].data.tolist() for p in ["W1", "b1", "W2", "b2", "W3"]}))
"""


def test_onnxruntime_training_artifacts_train_as_there(tmp_path) -> None:
    """onnxruntime-training's AdamWOptimizer model, translated on load, is the model onnxtrain's AdamW block
    makes: it runs flat, and three steps give the weights onnxruntime-training's own three give."""
    from tests.ortt import PREAMBLE, ensure_ortt, run_script

    python = ensure_ortt()
    model = _model()
    model.ir_version = 10  # what onnxruntime 1.19 reads
    base = str(tmp_path / "mlp.onnx")
    onnx.save(model, base)
    folder = tmp_path / "ortt"
    folder.mkdir()
    theirs = run_script(PREAMBLE + _ORTT_SCRIPT, json.dumps([base, str(folder)]), python=python)
    state, module, opt = _open(str(folder))
    assert opt._flat is not None
    opt.set_learning_rate(0.05)
    for i in range(3):
        module(*_batch(i))
        opt.step()
        module.lazy_reset_grad()
    # the gradients differ in their last bits (MLAS against OpenBLAS sums), which Adam's m/sqrt(v) scales up
    # where a gradient is near zero: a few weights within 1/1000 of the three steps' size (lr 0.05), the
    # rest much closer
    for p, want in theirs.items():
        got, want = state.parameters[p].data, np.array(want, np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1.5e-4, err_msg=p)
        assert np.median(np.abs(got - want)) <= 1e-7, p


def test_two_optimizers_over_one_state_take_turns(tmp_path) -> None:
    """Two Optimizers over one state (each moves the weights and moments into its own buffers when its turn
    comes) step as one per-parameter Optimizer does."""
    folder = _artifacts(tmp_path, onnxblock.optim.AdamW(weight_decay=0.01))
    state, module, opt = _open(folder)
    other = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    plain_state, plain_module, plain_opt = _open(folder, flat="0")
    for i in range(4):
        for m in (module, plain_module):
            m(*_batch(i))
        (opt if i % 2 == 0 else other).step()
        plain_opt.step()
        for m in (module, plain_module):
            m.lazy_reset_grad()
    for p in plain_opt._params:
        np.testing.assert_array_equal(state.parameters[p].data, plain_state.parameters[p].data, err_msg=p)
        for k, mom in plain_opt._opt.moments[p].items():
            np.testing.assert_array_equal(state._optimizer_state().moments[p][k], mom, err_msg=f"{p}.{k}")
