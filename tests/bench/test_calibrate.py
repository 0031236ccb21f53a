"""Steps per sample of a bench peer (``bench.run.calibrate``)."""

from __future__ import annotations

import math

from bench.common import CALIBRATE_S
from bench.run import Peer, calibrate


class FakePeer(Peer):
    """A worker whose steps take ``step`` seconds, except the first, which takes ``first``."""

    def __init__(self, step: float, first: float) -> None:
        super().__init__("api", "")
        self.step, self.first, self.done, self.runs = step, first, 0, []

    def send(self, line: str) -> dict:
        n = int(line.split()[1])
        self.runs.append(n)
        seconds = n * self.step + (self.first - self.step if self.done == 0 else 0.0)
        self.done += n
        return {"seconds": seconds}


def test_one_slow_step_does_not_size_the_samples() -> None:
    # 2 ms steps, the first 40 ms (threads waking after a pause): sized from that step alone, a 0.5 s
    # sample held 13 steps; sized from a run of at least CALIBRATE_S seconds it holds about 250
    peer = FakePeer(step=0.002, first=0.040)
    n = calibrate(peer, 0.5)
    assert 230 <= n <= 250
    assert sum(peer.runs) * 0.002 + 0.038 >= CALIBRATE_S  # the timed runs lasted long enough
    assert len(peer.runs) <= 4


def test_steady_peer_gets_min_time_worth_of_steps() -> None:
    peer = FakePeer(step=0.01, first=0.01)
    assert calibrate(peer, 0.5) == math.ceil(0.5 / 0.01)
    slow = FakePeer(step=0.3, first=0.3)  # one step longer than CALIBRATE_S: one run of one step
    assert calibrate(slow, 0.5) == 2 and slow.runs == [1]


def test_the_onnxruntime_child_is_sized_from_a_timed_run_too() -> None:
    from bench.common import calls_per_sample

    runs: list[int] = []

    def child(n: int) -> float:  # 6 ms a call, the first call after the pause 30 ms
        first = 0.024 if not runs else 0.0
        runs.append(n)
        return 0.006 * n + first

    n = calls_per_sample(child, 1.0)
    assert 160 <= n <= 170  # about 1 s of 6 ms calls; sized from the first call alone it was 34
    assert runs[0] == 1 and len(runs) <= 4
