"""Ctrl-C during a training step in one process: the step completes and KeyboardInterrupt follows it, so
the state is all the step's (a SIGINT between the graph's run and the storing of its results left weights
updated and their moments or counters not), and the next step is the one an uninterrupted run takes. The
same for a Python handler of a job's stop notice that raises (SIGTERM turned into an exception to save a
checkpoint before a preemption): it runs after the step, as after onnxruntime's C++ run (run part way, it
left the first weight updated in place and the rest not, and a checkpoint saved in a ``finally`` that mix)."""

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


class Preempted(Exception):
    """What a job's stop-notice handler raises (SIGTERM turned into an exception to save a checkpoint)."""


def _raise_preempted(signum: int, frame: object) -> None:
    raise Preempted


# (signal, the Python handler put in place for it or None for Python's own, what the step then raises):
# Ctrl-C, and a SIGTERM whose handler raises (a preemption notice), both held back until the step ends
SIGNALS = [(signal.SIGINT, None, KeyboardInterrupt), (signal.SIGTERM, _raise_preempted, Preempted)]


@pytest.fixture(params=SIGNALS, ids=["SIGINT", "SIGTERM"])
def signal_after_runs(request, monkeypatch):
    """``(arm, raised)``: once armed (``arm[0] = True``), the next numpy plan run sends this process the
    signal as it returns, before the step stores its results; ``raised`` is the exception expected."""
    signum, handler, raised = request.param
    previous = signal.signal(signum, handler) if handler is not None else None
    arm = [False]
    real = Plan.run

    def run(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if arm[0]:
            arm[0] = False
            signal.raise_signal(signum)
        return out

    monkeypatch.setattr(Plan, "run", run)
    yield arm, raised
    if handler is not None:
        signal.signal(signum, previous)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


def test_legacy_step_is_whole_when_interrupted(signal_after_runs) -> None:
    arm, raised = signal_after_runs
    x, y = batches(1, 16)[0]
    feeds = {"x": x, "y": y, "Learning_Rate": np.array([0.1], np.float32)}
    hit = TrainingSession(mlp_model().SerializeToString(), params("AdamOptimizer"))
    calm = TrainingSession(mlp_model().SerializeToString(), params("AdamOptimizer"))
    calm.run(["loss"], feeds)
    arm[0] = True
    with pytest.raises(raised):
        hit.run(["loss"], feeds)
    _same(hit.get_state(), calm.get_state())
    _same(dict(enumerate(hit.run(["loss"], feeds))), dict(enumerate(calm.run(["loss"], feeds))))


def test_ondevice_step_is_whole_when_interrupted(tmp_path, signal_after_runs) -> None:
    arm, raised = signal_after_runs
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
    arm[0] = True
    with pytest.raises(raised):
        hit[1](x, y)
    arm[0] = True
    with pytest.raises(raised):
        hit[2].step()
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


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")
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
