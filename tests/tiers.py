"""The default suite and the full one.

Breadth sweeps (the control-flow fuzz's seeds, the torch layers exported by dynamo with every dim dynamic,
option combinations, random models) run a fixed part of their cases by default, to keep the default suite,
the one CI runs, within its time: a combinatorial sweep every pair of values (or every value) of its
factors (:func:`covering`), a sample of models the ones that differ most; ``ONNXTRAIN_FULL_TESTS=1`` runs
every case. The other cases carry the ``extended`` mark and are
deselected by default (pytest's summary counts them as deselected).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence

import pytest

VARIABLE = "ONNXTRAIN_FULL_TESTS"


def full() -> bool:
    """Whether this run takes every case of the sweeps (``ONNXTRAIN_FULL_TESTS=1``)."""
    value = os.environ.get(VARIABLE, "").strip()
    if value not in ("", "0", "1"):
        raise pytest.UsageError(f"{VARIABLE} must be 0 or 1, got {value!r}")
    return value == "1"


def extended(*values: object, id: str | None = None) -> object:  # noqa: A002 - pytest.param's name
    """A case of a sweep that runs in the full suite only."""
    return pytest.param(*values, id=id, marks=pytest.mark.extended)


def _values(value: object) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def covering(*factors: Sequence, strength: int = 2) -> list:
    """Every combination of the factors' values, as pytest params: the cases in which every pair of values of
    two factors (``strength=2``, chosen greedily in product order) or every value of each factor
    (``strength=1``, the diagonal) occurs at least once run by default, the others are extended; the same
    subset at every run. A value that is a tuple gives several arguments."""
    if strength not in (1, 2):
        raise ValueError(f"strength must be 1 or 2, got {strength}")
    sizes = [len(f) for f in factors]
    combos = list(itertools.product(*(range(n) for n in sizes)))

    def pairs(combo: tuple) -> set:
        return {(a, combo[a], b, combo[b]) for a, b in itertools.combinations(range(len(combo)), 2)}

    if strength == 1:  # the diagonal: value r of each factor (modulo its size) in case r
        chosen = {tuple(r % n for n in sizes) for r in range(max(sizes))}
    else:
        chosen = set()
        left = set().union(*(pairs(c) for c in combos))
        while left:
            best = max(range(len(combos)), key=lambda n: (len(pairs(combos[n]) & left), -n))
            chosen.add(combos[best])
            left -= pairs(combos[best])
    params = []
    for combo in combos:
        values = tuple(v for k, i in enumerate(combo) for v in _values(factors[k][i]))
        marks = () if combo in chosen else (pytest.mark.extended,)
        params.append(pytest.param(*values, marks=marks))
    return params
