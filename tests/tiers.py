"""The default suite and the full one.

A few breadth sweeps (the control-flow fuzz's seeds, the torch layers exported by dynamo with every dim
dynamic) run a fixed part of their cases by default, to keep the default suite, the one CI runs, within its
time; ``ONNXTRAIN_FULL_TESTS=1`` runs every case. The other cases carry the ``extended`` mark and are
deselected by default (pytest's summary counts them as deselected).
"""

from __future__ import annotations

import os

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
