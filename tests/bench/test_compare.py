"""bench.common.compare: interleaved rounds, and the pause before each peer's turn."""

from __future__ import annotations

import time

from bench.common import compare


def test_pause_comes_before_each_turn() -> None:
    calls: list[tuple[str, float]] = []

    def peer(name: str):
        def run() -> None:
            calls.append((name, time.perf_counter()))
            time.sleep(0.002)

        return run

    timings = compare({"a": peer("a"), "b": peer("b")}, repeats=5, warmup=0, min_time=0.001, pause=0.03)
    assert set(timings) == {"a", "b"} and all(t.repeats == 5 for t in timings.values())
    # after calibration, the timed rounds alternate a, b; each switch of peer waited the pause
    switches = [t1 - t0 for (n0, t0), (n1, t1) in zip(calls, calls[1:]) if n0 != n1]
    assert len(switches) >= 9 and sorted(switches)[1] >= 0.03
    assert all(0.002 <= t.median < 0.03 for t in timings.values())  # the pause is not timed
