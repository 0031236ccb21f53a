"""ONNX's node conformance cases for the ops of the op plan (tiers 1 to 3) and those after opset 21 (tier 4),
one test per case.

The cases come from the installed ``onnx`` package (built once per session: a few seconds). Cases we
know we fail are listed with their reason in ``onnxtrain.conformance.EXPECTED_FAILURES`` and marked
strict xfail here, so a case that starts passing must be taken off that list.
The same figures from the command line: ``python -m onnxtrain.conformance`` ("N of M passed").
"""

from __future__ import annotations

import functools
import warnings

import pytest

from onnxtrain.conformance import EXPECTED_FAILURES, TIER1, TIER2, TIER3, TIER4, load_cases, run_case

MIN_PASS_RATE = 0.95
# tier-3 ops the onnx package has no node case for (their tests live with their kernels)
NO_CASES = {"ConcatFromSequence", "GlobalLpPool", "MaxRoiPool", "Multinomial", "Optional", "RandomNormal",
            "RandomNormalLike", "RandomUniform", "RandomUniformLike", "SequenceAt", "SequenceConstruct",
            "SequenceEmpty", "SequenceErase", "SequenceLength"}


@functools.cache
def cases() -> dict[str, tuple[str, object]]:
    """Case name → (op, case), for every op of tiers 1 to 4 (built once per process)."""
    with warnings.catch_warnings():  # the case generators overflow and divide by zero on purpose
        warnings.simplefilter("ignore")
        return {c.name: (op, c) for op, c in load_cases(TIER1 + TIER2 + TIER3 + TIER4)}


@functools.cache
def outcome(name: str) -> str:
    """'' when case ``name`` passes, else the error (cached: the summary reuses the per-case runs)."""
    try:
        with warnings.catch_warnings():  # a run gives its infs and NaNs silently: a warning fails the case
            warnings.simplefilter("error", RuntimeWarning)
            run_case(cases()[name][1])
    except Exception as e:  # noqa: BLE001 - any failure of the engine is a failed case
        return f"{type(e).__name__}: {e}"
    return ""


def _params() -> list:
    marks = {n: pytest.mark.xfail(reason=r, strict=True) for n, r in EXPECTED_FAILURES.items()}
    return [pytest.param(n, id=n, marks=marks.get(n, ())) for n in sorted(cases())]


@pytest.mark.parametrize("name", _params())
def test_case(name: str) -> None:
    err = outcome(name)
    assert not err, f"{name} [{cases()[name][0]}]: {err[:2000]}"


def test_expected_failures_are_real_cases() -> None:
    """Every entry of EXPECTED_FAILURES names a case that exists and carries a reason."""
    unknown = sorted(set(EXPECTED_FAILURES) - set(cases()))
    assert not unknown, f"EXPECTED_FAILURES lists cases that do not exist: {unknown}"
    assert all(r.strip() for r in EXPECTED_FAILURES.values())


def test_every_op_has_cases() -> None:
    have = {op for op, _ in cases().values()}
    missing = sorted(set(TIER1 + TIER2 + TIER3 + TIER4) - have - NO_CASES)
    assert not missing, f"no conformance case found for {missing}"
    assert not NO_CASES & have, f"NO_CASES lists ops that have cases now: {sorted(NO_CASES & have)}"


def test_pass_rate() -> None:
    names = sorted(cases())
    failed = [n for n in names if outcome(n)]
    rate = 1 - len(failed) / len(names)
    summary = f"{len(names) - len(failed)} of {len(names)} passed ({rate:.1%})"
    assert rate >= MIN_PASS_RATE, f"{summary}; failed: {failed}"
