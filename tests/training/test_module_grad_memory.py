"""A ``Module`` call that overwrites the gradients (after ``lazy_reset_grad``) lets go of the old gradient
arrays that only the state holds before the run, so the numpy engine computes the new ones in their memory
instead of beside them; gradients a caller holds are still written into, and a failed call leaves zeros.
Oracle: the gradient of a mean squared error written out in numpy, in float64."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module

N_IN, N_OUT, BATCH = 1024, 512, 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("grad_memory")
    w = (np.random.default_rng(0).standard_normal((N_IN, N_OUT)) * 0.03).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, N_IN])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, N_OUT])],
                          [numpy_helper.from_array(w, "W")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    artifacts.generate_artifacts(model, requires_grad=["W"], loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=str(out))
    return str(out)


def _batch(i: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(10 + i)
    return (rng.standard_normal((BATCH, N_IN)).astype(np.float32),
            rng.standard_normal((BATCH, N_OUT)).astype(np.float32))


def _want(w: np.ndarray, x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """d/dW of mean((x·W − t)²) in float64."""
    x64, w64, t64 = (a.astype(np.float64) for a in (x, w, t))
    return 2.0 / t.size * x64.T @ (x64 @ w64 - t64)


def _module(folder: str) -> tuple[Module, CheckpointState]:
    state = CheckpointState.load_checkpoint(folder + "/checkpoint")
    return Module(folder + "/training_model.onnx", state), state


def test_an_overwriting_call_lets_the_old_gradient_go_before_its_run(folder, monkeypatch) -> None:
    """The old gradient array is gone when the run starts (its memory is free for the new one), and the
    call's gradient is right."""
    m, state = _module(folder)
    w = state.parameters["W"].data.copy()
    m(*_batch(0))
    m.lazy_reset_grad()
    old = weakref.ref(state.parameters["W"].grad)
    seen = []
    run = m._overwrite_plan.run

    def watched(*args, **kwargs):
        seen.append(old() is None)
        return run(*args, **kwargs)

    monkeypatch.setattr(m._overwrite_plan, "run", watched)
    x, t = _batch(1)
    m(x, t)
    assert seen == [True]
    np.testing.assert_allclose(state.parameters["W"].grad, _want(w, x, t), rtol=1e-4, atol=1e-6)


def test_a_held_gradient_is_written_into_and_an_accumulating_call_adds(folder) -> None:
    m, state = _module(folder)
    w = state.parameters["W"].data.copy()
    m(*_batch(0))
    held = state.parameters["W"].grad
    m(*_batch(1))  # accumulates
    want = _want(w, *_batch(0)) + _want(w, *_batch(1))
    np.testing.assert_allclose(held, want, rtol=1e-4, atol=1e-6)
    m.lazy_reset_grad()
    m(*_batch(2))  # overwrites: the caller's array sees the new gradient
    assert state.parameters["W"].grad is held
    np.testing.assert_allclose(held, _want(w, *_batch(2)), rtol=1e-4, atol=1e-6)


def test_a_failed_overwriting_call_leaves_zeros(folder, monkeypatch) -> None:
    """Inputs refused before the run leave the gradients as they were; a run that fails after the old
    gradients were let go leaves zeros in their place, and the next call computes them."""
    m, state = _module(folder)
    w = state.parameters["W"].data.copy()
    m(*_batch(0))
    m.lazy_reset_grad()
    old = state.parameters["W"].grad.copy()
    x, t = _batch(1)
    with pytest.raises(Exception, match="x|shape|dimension"):
        m(x[:, :10], t)
    np.testing.assert_array_equal(state.parameters["W"].grad, old)

    def broken(*args, **kwargs):
        raise RuntimeError("the run failed")

    monkeypatch.setattr(m._overwrite_plan, "run", broken)
    with pytest.raises(RuntimeError, match="the run failed"):
        m(x, t)
    np.testing.assert_array_equal(state.parameters["W"].grad, np.zeros((N_IN, N_OUT), np.float32))
    monkeypatch.undo()
    m(x, t)
    np.testing.assert_allclose(state.parameters["W"].grad, _want(w, x, t), rtol=1e-4, atol=1e-6)
