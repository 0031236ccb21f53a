"""bench: the GEMM rate sampled once a round, and each peer's share of it (bench/gemm.py, bench/run.py)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from bench import gemm, run


def test_share_of_the_rounds_own_rate() -> None:
    # 2 GFLOP a step; the machine twice as fast in the second round: the peer's step time halves with it
    shares = run.round_peak_shares(2e9, [0.02, 0.01, 0.02], [200.0, 400.0, 100.0])
    assert shares == pytest.approx(0.5)  # rounds give 100/200, 200/400, 100/100: median 0.5
    # against the run's best rate alone, the slow rounds would read as 25 %
    assert pytest.approx(0.25) == 2e9 / 0.02 / 1e9 / 400.0
    with pytest.raises(ValueError, match="2 for 3 rounds"):
        run.round_peak_shares(1e9, [0.1, 0.1, 0.1], [100.0, 100.0])


def test_serve_answers_each_run_until_quit() -> None:
    out = io.StringIO()
    gemm.serve(64, 2, io.StringIO("run\nrun\nquit\nrun\n"), out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # nothing after quit
    rates = [json.loads(x)["gflops"] for x in lines]
    assert all(np.isfinite(r) and r > 0 for r in rates)
    with pytest.raises(SystemExit, match="unknown command 'go'"):
        gemm.serve(64, 1, io.StringIO("go\n"), io.StringIO())


class FakePeer:
    """A peer whose step takes a fixed time; records the order it ran in."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log, self.proc = name, log, object()
        self.number, self.samples, self.update_samples, self.steal = 1, [], [], []
        self.loss, self.stats = 0.0, {}

    def send(self, line: str) -> dict:
        if line.startswith("run"):
            self.log.append(self.name)
            return {"seconds": 0.001 * int(line.split()[1]), "loss": 1.0}
        return {}


class FakeProbe:
    def __init__(self, rates: list[float], log: list[str]) -> None:
        self.rates, self.log = rates, log

    def sample(self) -> float:
        self.log.append("probe")
        return self.rates.pop(0)


def test_measure_samples_the_probes_first_in_each_round(monkeypatch) -> None:
    monkeypatch.setattr(run, "SETTLE_S", 0.0)
    monkeypatch.setattr(run, "calibrate", lambda p, t: 1)
    log: list[str] = []
    peers = [FakePeer("a", log), FakePeer("b", log)]
    for p in peers:  # measure's closing "stats"/"quit" exchange
        p.proc = type("P", (), {"stdin": io.StringIO(), "wait": lambda self, timeout: 0})()
    probes = [FakeProbe([100.0, 300.0, 50.0], log), FakeProbe([200.0, 100.0, 60.0], log)]
    peaks = run.measure(peers, 3, 0, 0.0, probes)
    assert peaks == [200.0, 300.0, 60.0]  # the best probe of each round
    rounds = [log[i:i + 4] for i in range(2, len(log), 4)]  # after the two warm-ups
    first = ["probe", "probe"]
    assert rounds == [[*first, "a", "b"], [*first, "b", "a"], [*first, "a", "b"]]
    assert run.measure(peers, 1, 0, 0.0) == []  # no probes, no rates
