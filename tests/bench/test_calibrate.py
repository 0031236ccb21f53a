"""Steps per sample of a bench peer (``bench.run.calibrate``)."""

from __future__ import annotations

import math

from bench.run import CALIBRATE_S, Peer, calibrate


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
