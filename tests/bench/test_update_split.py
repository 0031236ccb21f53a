"""bench: the on-device peers report the time of their Optimizer.step (bench/worker.py, bench/run.py)."""

from __future__ import annotations

import types

from bench import run, worker


class FakeApi:
    """An on-device API whose Optimizer.step takes a known share of the step."""

    def __init__(self, clock: list[float]) -> None:
        class Module:
            def __init__(self, path, state, session_options=None):
                pass

            def __call__(self, x, y):
                clock[0] += 3.0
                return 1.0

            def lazy_reset_grad(self):
                pass

        class Optimizer:
            def __init__(self, path, module):
                pass

            def set_learning_rate(self, lr):
                pass

            def step(self):
                clock[0] += 0.5

        self.Module, self.Optimizer = Module, Optimizer
        self.CheckpointState = types.SimpleNamespace(load_checkpoint=lambda path: None)


def test_optimizer_step_time_is_added_up(tmp_path, monkeypatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(worker.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(worker, "_params", lambda folder, graph: [])
    artifacts = types.SimpleNamespace(generate_artifacts=lambda *a, **k: None,
                                      LossType=types.SimpleNamespace(CrossEntropyLoss=0))
    onnxblock = types.SimpleNamespace(optim=types.SimpleNamespace(AdamW=lambda **k: None))
    step, _, _ = worker._on_device_step(artifacts, FakeApi(clock), onnxblock, None, str(tmp_path), "a", None)
    for _ in range(4):
        step(None, types.SimpleNamespace(reshape=lambda *a: None))
    assert step.update_seconds == [2.0]


def test_on_device_peers_train_with_the_other_peers_weight_decay_and_epsilon(tmp_path, monkeypatch) -> None:
    # the generator's AdamW defaults (no weight decay, eps 1e-6) would give the on-device peers another update
    # than the legacy session's and torch's (weight decay 0.01, eps 1e-8)
    from onnxtrain.training import onnxblock

    monkeypatch.setattr(worker, "_params", lambda folder, graph: [])
    given = {}
    artifacts = types.SimpleNamespace(generate_artifacts=lambda *a, **k: given.update(k),
                                      LossType=types.SimpleNamespace(CrossEntropyLoss=0))
    worker._on_device_step(artifacts, FakeApi([0.0]), onnxblock, None, str(tmp_path), "a", None)
    opt = given["optimizer"]
    assert isinstance(opt, onnxblock.optim.AdamW)
    assert (opt.weight_decay, opt.eps) == (worker.WEIGHT_DECAY, worker.EPS) == (0.01, 1e-8)


def test_the_split_note_names_each_on_device_peer() -> None:
    api = run.Peer("api", "native", samples=[0.004, 0.002, 0.003], update_samples=[0.0011, 0.0009, 0.001])
    ort = run.Peer("ort", "", samples=[0.0013, 0.0012, 0.0014], update_samples=[0.0004, 0.0005, 0.0004])
    legacy = run.Peer("legacy", "native", samples=[0.002])
    note = run.update_split([api, ort, legacy])
    assert note == ("time in Optimizer.step per step (the update), medians: onnxtrain Module+Optimizer "
                    "[native]: 1.00 of 3.00 ms; onnxruntime-training 1.19.2: 0.40 of 1.30 ms")
    assert run.update_split([legacy]) == ""
