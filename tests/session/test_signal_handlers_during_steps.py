"""A Python handler of a job's stop notice that raises (SIGTERM turned into SystemExit to save a checkpoint
before a preemption) runs after a training step, as onnxruntime's C++ run returns before Python sees any
signal: the state is the whole step's. Run part way, it left the first weight updated in place and the
moments, the other weights and the step counts not (found by a loop of steps under random signals whose
handler raised), and a checkpoint saved in a ``finally`` then held that mix."""

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

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")


class Preempted(Exception):
    pass


@pytest.fixture
def notice_in_runs(monkeypatch):
    """A SIGTERM handler that raises Preempted, and every numpy plan's run sends SIGTERM (once armed) as it
    returns, before the step stores its results."""
    def handler(signum, frame):
        raise Preempted

    previous = signal.signal(signal.SIGTERM, handler)
    arm = [False]
    real = Plan.run

    def run(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if arm[0]:
            arm[0] = False
            signal.raise_signal(signal.SIGTERM)
        return out

    monkeypatch.setattr(Plan, "run", run)
    yield arm
    signal.signal(signal.SIGTERM, previous)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


def test_legacy_step_is_whole_when_a_handler_raises(notice_in_runs) -> None:
    x, y = batches(1, 16)[0]
    feeds = {"x": x, "y": y, "Learning_Rate": np.array([0.1], np.float32)}
    hit = TrainingSession(mlp_model().SerializeToString(), params("AdamOptimizer"))
    calm = TrainingSession(mlp_model().SerializeToString(), params("AdamOptimizer"))
    calm.run(["loss"], feeds)
    notice_in_runs[0] = True
    with pytest.raises(Preempted):
        hit.run(["loss"], feeds)
    _same(hit.get_state(), calm.get_state())
    _same(dict(enumerate(hit.run(["loss"], feeds))), dict(enumerate(calm.run(["loss"], feeds))))


def test_ondevice_step_is_whole_when_a_handler_raises(tmp_path, notice_in_runs) -> None:
    artifacts.generate_artifacts(mlp_model(), requires_grad=["W1", "b1", "W2", "b2"], loss=None,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=str(tmp_path))
    x, y = batches(1, 16)[0]

    def make():
        state = CheckpointState.load_checkpoint(os.path.join(tmp_path, "checkpoint"))
        module = Module(os.path.join(tmp_path, "training_model.onnx"), state)
        return state, module, Optimizer(os.path.join(tmp_path, "optimizer_model.onnx"), module)

    def snapshot(state, opt) -> dict:
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
    notice_in_runs[0] = True
    with pytest.raises(Preempted):
        hit[1](x, y)
    notice_in_runs[0] = True
    with pytest.raises(Preempted):
        hit[2].step()
    _same(snapshot(hit[0], hit[2]), snapshot(calm[0], calm[2]))


def test_a_handler_set_to_default_or_ignore_is_left_alone() -> None:
    """Only Python handlers are held back: one set to SIG_IGN stays in place through a step, and a
    timeout's (SIGALRM) runs at once."""
    from onnxtrain.interrupts import sigint_deferred

    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    seen: list[int] = []
    before = signal.signal(signal.SIGALRM, lambda signum, frame: seen.append(signum))
    try:
        with sigint_deferred():
            assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
            signal.raise_signal(signal.SIGUSR1)  # ignored, as without the block
            signal.raise_signal(signal.SIGALRM)
            assert seen == [signal.SIGALRM]
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR1, previous)
        signal.signal(signal.SIGALRM, before)
