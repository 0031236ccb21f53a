"""Ctrl-C during a training step in one process: the step completes and KeyboardInterrupt follows it, so
the state is all the step's (a SIGINT between the graph's run and the storing of its results left weights
updated and their moments or counters not), and the next step is the one an uninterrupted run takes."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from onnxtrain import TrainingSession
from onnxtrain.engine.plan import Plan
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module, Optimizer
from tests.session.helpers import batches, mlp_model, params


@pytest.fixture
def sigint_after_runs(monkeypatch):
    """Every numpy plan's run sends this process SIGINT as it returns (when armed: ``arm[0] = True``)."""
    arm = [False]
    real = Plan.run

    def run(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if arm[0]:
            signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(Plan, "run", run)
    return arm


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


def test_legacy_step_is_whole_when_interrupted(sigint_after_runs) -> None:
    x, y = batches(1, 16)[0]
    feeds = {"x": x, "y": y, "Learning_Rate": np.array([0.1], np.float32)}
    hit = TrainingSession(mlp_model().SerializeToString(), params("AdamOptimizer"))
    calm = TrainingSession(mlp_model().SerializeToString(), params("AdamOptimizer"))
    calm.run(["loss"], feeds)
    sigint_after_runs[0] = True
    with pytest.raises(KeyboardInterrupt):
        hit.run(["loss"], feeds)
    sigint_after_runs[0] = False
    _same(hit.get_state(), calm.get_state())
    _same(dict(enumerate(hit.run(["loss"], feeds))), dict(enumerate(calm.run(["loss"], feeds))))


def test_ondevice_step_is_whole_when_interrupted(tmp_path, sigint_after_runs) -> None:
    artifacts.generate_artifacts(mlp_model(), requires_grad=["W1", "b1", "W2", "b2"], loss=None,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=str(tmp_path))
    x, y = batches(1, 16)[0]

    def make() -> tuple[CheckpointState, Module, Optimizer]:
        state = CheckpointState.load_checkpoint(os.path.join(tmp_path, "checkpoint"))
        module = Module(os.path.join(tmp_path, "training_model.onnx"), state)
        return state, module, Optimizer(os.path.join(tmp_path, "optimizer_model.onnx"), module)

    def snapshot(state: CheckpointState, opt: Optimizer) -> dict:
        names = ("W1", "b1", "W2", "b2")
        out = {k: state.parameters[k].data.copy() for k in names}
        out.update({f"{k}.grad": state.parameters[k].grad.copy() for k in names})
        out.update({f"{p}.{k}": v.copy() for p, d in opt._opt.moments.items() for k, v in d.items()})
        out["step"] = opt.step_count
        return out

    calm = make()
    calm[1](x, y)
    calm[2].step()
    hit = make()
    sigint_after_runs[0] = True
    with pytest.raises(KeyboardInterrupt):
        hit[1](x, y)
    with pytest.raises(KeyboardInterrupt):
        hit[2].step()
    sigint_after_runs[0] = False
    _same(snapshot(hit[0], hit[2]), snapshot(calm[0], calm[2]))


def test_the_handler_in_place_gets_every_signal() -> None:
    """The handler in place sees one Ctrl-C after the block, and a second one at once with the first (the
    CLI's handler stops on the first at the step's end and raises on the second: a hung step ends)."""
    from onnxtrain.interrupts import sigint_deferred

    seen: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with sigint_deferred():
            signal.raise_signal(signal.SIGINT)
            assert seen == []
        assert seen == [signal.SIGINT]
        with sigint_deferred():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            assert seen == [signal.SIGINT] * 3  # inside the block
        assert signal.getsignal(signal.SIGINT) is not None and len(seen) == 3
        with sigint_deferred(active=False):
            signal.raise_signal(signal.SIGINT)
            assert len(seen) == 4
    finally:
        signal.signal(signal.SIGINT, previous)
