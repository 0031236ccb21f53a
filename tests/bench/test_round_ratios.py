"""The bench's per-round speed ratios (``bench.run.round_ratios``)."""

from __future__ import annotations

import pytest

from bench.run import round_ratios


def test_quartiles_of_the_paired_ratios() -> None:
    ref = [1.0, 1.0, 2.0, 2.0, 4.0]  # seconds per step of the reference, round by round
    ours = [2.0, 1.0, 2.0, 1.0, 2.0]  # ratios 0.5, 1, 1, 2, 2
    assert round_ratios(ref, ours) == (1.0, 1.0, 2.0)
    # a load that doubles both peers' times in one round leaves that round's ratio as it is
    assert round_ratios([1.0, 2.0, 1.0], [2.0, 4.0, 2.0]) == (0.5, 0.5, 0.5)
    assert round_ratios([3.0], [1.5]) == (2.0, 2.0, 2.0)


def test_rounds_must_pair_up() -> None:
    with pytest.raises(ValueError, match="3 and 2"):
        round_ratios([1.0, 1.0, 1.0], [1.0, 1.0])
    with pytest.raises(ValueError):
        round_ratios([], [])
