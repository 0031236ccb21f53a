"""Timing helpers shared by the benchmarks: warm-up, interleaved peers, median of repeats, ratios.

Peers are timed in turn inside each repeat (A, B, A, B, ...), so a slow spell of the machine hits all of
them alike; the figure quoted is the median over the repeats of the mean time of one call.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def add_repo_to_path() -> None:
    """Let ``python bench/x.py`` import ``onnxtrain`` and ``tests`` from this checkout."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)


@dataclass
class Timing:
    """Seconds per call of one peer: median over repeats, plus the spread."""

    name: str
    median: float
    best: float
    worst: float
    repeats: int
    number: int

    def __str__(self) -> str:
        return (f"{self.name}: {fmt_time(self.median)} "
                f"(best {fmt_time(self.best)}, {self.repeats}×{self.number})")


def fmt_time(seconds: float) -> str:
    """``12.3 µs`` / ``4.56 ms`` / ``1.23 s``."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


# a peer in another process is sized from a timed run of at least this many seconds: one call alone can take
# 10× its usual time (the first calls after a pause, when threads wake), and a sample sized from it held a
# dozen calls instead of hundreds (the legacy MLP at batch 64: 13 steps per sample, 3.0-4.1 ms per step
# against 1.9-2.1)
CALIBRATE_S = 0.1


def calls_per_sample(run: Callable[[int], float], min_time: float) -> int:
    """Calls for a sample of ``min_time`` seconds, where ``run(n)`` makes n calls (in another process, say)
    and returns their seconds: sized from a timed run of growing length, until it lasts CALIBRATE_S."""
    n = 1
    while True:
        t = run(n)
        if t >= CALIBRATE_S or n >= 1 << 16:
            return max(1, math.ceil(min_time * n / max(t, 1e-9)))
        n = min(1 << 16, max(2 * n, math.ceil(1.5 * n * CALIBRATE_S / max(t, 1e-9))))


def calibrate(fn: Callable[[], object], min_time: float = 0.05) -> int:
    """How many calls of ``fn`` make one timed sample of at least ``min_time`` seconds."""
    number = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        if time.perf_counter() - t0 >= min_time or number >= 1 << 20:
            return number
        number *= 2


def compare(peers: Mapping[str, Callable[[], object]], repeats: int = 7, warmup: int = 2,
            min_time: float = 0.05, pause: float = 0.0) -> dict[str, Timing]:
    """Time every peer, interleaved: ``warmup`` untimed calls each, then ``repeats`` rounds.

    In each round every peer runs ``number`` calls in a row (calibrated once per peer so a sample lasts
    at least ``min_time``); a peer's figure is the median over rounds of the time per call. ``pause``
    seconds pass before each turn: peers in one process whose idle threads busy-wait after their last
    call (OpenBLAS's, about 0.1 s) would otherwise take a core from the next peer's turn.
    """
    if repeats < 5:
        raise ValueError("use at least 5 repeats: a median of fewer is noise")
    for fn in peers.values():
        for _ in range(warmup):
            fn()
    numbers = {name: calibrate(fn, min_time) for name, fn in peers.items()}
    samples: dict[str, list[float]] = {name: [] for name in peers}
    for _ in range(repeats):
        for name, fn in peers.items():
            n = numbers[name]
            if pause:
                time.sleep(pause)
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - t0) / n)
    return {name: Timing(name, statistics.median(s), min(s), max(s), repeats, numbers[name])
            for name, s in samples.items()}


def ratio_line(label: str, ours: float, theirs: float, unit: str = "", target: float | None = None) -> str:
    """One printed result: both figures and ``ours / theirs`` (lower is better), with a target if any."""
    r = ours / theirs
    verdict = "" if target is None else f" (target ≤ {target:g}×: {'met' if r <= target else 'MISSED'})"
    return f"{label}: onnxtrain {ours:.3g}{unit} vs onnxruntime {theirs:.3g}{unit} → ratio {r:.2f}×{verdict}"


def timed_against_onnxruntime(label: str, ours: Any, theirs: Any, feeds: Mapping[str, Any], repeats: int,
                              min_time: float) -> str:
    """The ratio line of one model run by an onnxtrain plan (``ours.run(feeds)``) and an onnxruntime session
    (``theirs.run(None, feeds)``), timed interleaved (:func:`compare`), in ms."""
    peers = {"onnxtrain": lambda: ours.run(feeds), "onnxruntime": lambda: theirs.run(None, feeds)}
    t = compare(peers, repeats=max(5, repeats), min_time=min_time)
    return ratio_line(label, t["onnxtrain"].median * 1e3, t["onnxruntime"].median * 1e3, " ms")


def layer_bench_args(prog: str, doc: str, argv: list[str] | None, repeats: int,
                     quick_repeats: int) -> tuple[bool, int]:
    """(quick, repeats) from the command line of a per-layer bench: ``--repeats`` (default ``repeats``) and
    ``--quick`` (its small layers, ``quick_repeats`` repeats)."""
    p = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--quick", action="store_true",
                   help=f"two small layers, {quick_repeats} repeats (a smoke run)")
    a = p.parse_args(argv)
    return a.quick, quick_repeats if a.quick else a.repeats


def peers_row(label: str, peers: Mapping[str, Callable[[], object]], widths: Sequence[int],
              repeats: int) -> str:
    """One table row of a per-layer bench: ``peers`` timed interleaved (:func:`compare`, 0.1 s apart), their
    medians in ms in the columns ``widths`` (the label's first), and the first peer's time over the last's."""
    t = compare(peers, repeats=repeats, pause=0.1)
    ms = [t[k].median * 1e3 for k in peers]
    cells = "".join(f" {v:{w}.2f}" for v, w in zip(ms, widths[1:], strict=False))
    return f"{label:{widths[0]}s}{cells} {ms[0] / ms[-1]:6.2f}"
