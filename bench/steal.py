"""CPU steal: time a virtual machine's CPUs were ready to run but the host ran other guests instead.

On a shared host it comes in bursts and slows whichever peer is running at the time; a round in which
one peer lost CPU time and its partner did not gives a ratio that says more about the host than about
either peer. The bench records the steal of every timed sample (``/proc/stat``, summed over the CPUs)
and reports its ratios to onnxruntime-training again over the rounds in which no peer lost more than
:data:`QUIET_SHARE` of the CPUs' time.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

QUIET_SHARE = 0.02  # a sample is quiet when steal took less than this share of the CPUs' time
_STEAL_FIELD = 8  # /proc/stat "cpu" line: user nice system idle iowait irq softirq steal ...


def steal_seconds(stat_text: str | None = None) -> float | None:
    """CPU seconds stolen from this machine since boot, summed over its CPUs (the ``cpu`` line of
    ``/proc/stat``, or of ``stat_text``); None where the kernel does not report steal."""
    if stat_text is None:
        try:
            with open("/proc/stat") as f:
                stat_text = f.readline()
        except OSError:
            return None
    for line in stat_text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            if len(fields) <= _STEAL_FIELD:
                return None
            try:
                ticks = int(fields[_STEAL_FIELD])
            except ValueError:
                return None
            return ticks / os.sysconf("SC_CLK_TCK")
    return None


def stolen_share(before: float | None, after: float | None, seconds: float, cpus: int) -> float | None:
    """The share of ``cpus`` CPUs' time over ``seconds`` of wall time that steal took, from two
    :func:`steal_seconds` readings; None when either reading is missing or no time passed."""
    if before is None or after is None or seconds <= 0 or cpus <= 0:
        return None
    return max(after - before, 0.0) / (seconds * cpus)


def quiet_rounds(shares: Sequence[Sequence[float | None]], limit: float = QUIET_SHARE) -> list[int]:
    """Indices of the rounds in which every peer's sample lost less than ``limit`` of the CPUs' time to
    steal. ``shares`` holds each peer's per-round shares (:func:`stolen_share`), all of one length; a
    round with a missing share is not quiet."""
    lengths = {len(s) for s in shares}
    if len(lengths) > 1:
        raise ValueError(f"peers have different numbers of rounds: {sorted(lengths)}")
    rounds = lengths.pop() if lengths else 0
    return [r for r in range(rounds)
            if all(s[r] is not None and s[r] < limit for s in shares)]
