"""bench: CPU steal per timed sample, and the ratios over the rounds without it (bench/steal.py, run.py)."""

from __future__ import annotations

import os

import pytest

from bench import run, steal

STAT = ("cpu  4003236 0 424826 12126080 21984 0 4414 12373 0 0\n"
        "cpu0 2001618 0 212413 6063040 10992 0 2207 6186 0 0\n")


def test_steal_is_read_from_the_summed_cpu_line() -> None:
    assert steal.steal_seconds(STAT) == pytest.approx(12373 / os.sysconf("SC_CLK_TCK"))


def test_a_kernel_without_steal_gives_none() -> None:
    assert steal.steal_seconds("cpu  1 2 3 4 5 6 7\n") is None
    assert steal.steal_seconds("intr 1 2 3\n") is None
    assert steal.steal_seconds("cpu  1 2 3 4 5 6 7 x\n") is None


def test_this_machine_reports_a_growing_count_or_none() -> None:
    first = steal.steal_seconds()
    if first is None:
        pytest.skip("no /proc/stat steal here")
    assert 0 <= first <= steal.steal_seconds()


def test_share_is_of_all_the_cpus_time() -> None:
    assert steal.stolen_share(10.0, 10.5, seconds=0.5, cpus=2) == pytest.approx(0.5)
    assert steal.stolen_share(10.0, 10.0, seconds=0.5, cpus=2) == 0.0
    assert steal.stolen_share(None, 10.0, seconds=0.5, cpus=2) is None
    assert steal.stolen_share(10.0, 11.0, seconds=0.0, cpus=2) is None


def test_a_round_is_quiet_only_when_every_peer_was() -> None:
    shares = [[0.0, 0.05, 0.01, None], [0.0, 0.0, 0.019, 0.0]]
    assert steal.quiet_rounds(shares) == [0, 2]
    assert steal.quiet_rounds(shares, limit=0.1) == [0, 1, 2]
    assert steal.quiet_rounds([]) == []
    with pytest.raises(ValueError, match="different numbers of rounds"):
        steal.quiet_rounds([[0.0], [0.0, 0.0]])


def test_notes_give_the_steal_and_the_quiet_rounds_ratios() -> None:
    ort = run.Peer("ort", "", samples=[1.0, 1.0, 1.0, 1.0, 1.0], steal=[0.0, 0.0, 0.3, 0.0, 0.0])
    api = run.Peer("api", "native", samples=[2.0, 2.0, 0.5, 4.0, 2.0], steal=[0.0, 0.0, 0.0, 0.0, 0.01])
    notes = run.steal_notes("MLP", [ort, api], ort)
    assert notes[0] == ("MLP: CPU steal (the host running other guests) in the timed samples: median 0.0 %, "
                        "at most 30.0 % of the CPUs' time; 4 of 5 rounds quiet (every peer under 2 %)")
    # rounds 0, 1, 3, 4: ratios 0.5, 0.5, 0.25, 0.5 (round 2, where onnxruntime-training lost time, left out)
    assert notes[1] == ("MLP: × ORT-T over the quiet rounds only (medians): "
                        "onnxtrain Module+Optimizer [native]: 0.50")


def test_too_few_quiet_rounds_give_no_ratio_and_no_steal_no_note() -> None:
    ort = run.Peer("ort", "", samples=[1.0] * 5, steal=[0.5, 0.5, 0.5, 0.0, 0.0])
    api = run.Peer("api", "native", samples=[2.0] * 5, steal=[0.0] * 5)
    assert len(run.steal_notes("MLP", [ort, api], ort)) == 1
    blind = [run.Peer("api", "native", samples=[2.0] * 5, steal=[None] * 5)]
    assert run.steal_notes("MLP", blind, None) == []
