"""ONNX's node conformance cases for the ops of the op plan (tiers 1 to 3) and those after opset 21 (tier 4),
one test per case.

The cases come from the installed ``onnx`` package, which generates them by running each op's numpy
reference (about 20 s for all of them). The tests are named from ``conformance_index.json`` (case → op and
case module) when it was written for the installed onnx version, and each case module is generated when a
test first needs it, so the two test workers share that work; for another onnx version every module is
generated while collecting. ``python tests/engine/test_conformance.py`` rewrites the index.
Cases we know we fail are listed with their reason in ``onnxtrain.conformance.EXPECTED_FAILURES`` and
marked strict xfail here, so a case that starts passing must be taken off that list.
The same figures from the command line: ``python -m onnxtrain.conformance`` ("N of M passed").
"""

from __future__ import annotations

import functools
import json
import os
import sys
import warnings

import onnx
import pytest

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from onnxtrain.conformance import (  # noqa: E402
    EXPECTED_FAILURES,
    TIER1,
    TIER2,
    TIER3,
    TIER4,
    case_modules,
    module_cases,
    run_case,
)

MIN_PASS_RATE = 0.95
# tier-3 ops the onnx package has no node case for (their tests live with their kernels)
NO_CASES = {"ConcatFromSequence", "GlobalLpPool", "MaxRoiPool", "Multinomial", "Optional", "RandomNormal",
            "RandomNormalLike", "RandomUniform", "RandomUniformLike", "SequenceAt", "SequenceConstruct",
            "SequenceEmpty", "SequenceErase", "SequenceLength"}


INDEX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conformance_index.json")
OPS = frozenset(TIER1 + TIER2 + TIER3 + TIER4)


def _quiet_cases(module: str) -> list:
    with warnings.catch_warnings():  # the case generators overflow and divide by zero on purpose
        warnings.simplefilter("ignore")
        return module_cases(module)


def _built_index() -> dict[str, tuple[str, str]]:
    """Case name → (op, case module) for the ops of tiers 1 to 4, generating every case module."""
    return {c.name: (op, m) for m in case_modules() for op, c in _quiet_cases(m) if op in OPS}


@functools.cache
def index() -> dict[str, tuple[str, str]]:
    """Case name → (op, case module): from :data:`INDEX` when it was written for the installed onnx (and
    these tiers), else built."""
    try:
        with open(INDEX) as f:
            saved = json.load(f)
    except FileNotFoundError:
        saved = {}
    if saved.get("onnx") == onnx.__version__ and saved.get("ops") == sorted(OPS):
        return {name: (op, m) for name, (op, m) in saved["cases"].items()}
    return _built_index()


def case(name: str) -> object:
    """Node case ``name``, its module generated on first use."""
    module = index()[name][1]
    found = [c for _, c in _quiet_cases(module) if c.name == name]
    assert found, f"{INDEX}: case {name} is not in module {module}; rewrite the index"
    return found[0]


@functools.cache
def outcome(name: str) -> str:
    """'' when case ``name`` passes, else the error (cached: the summary reuses the per-case runs)."""
    try:
        with warnings.catch_warnings():  # a run gives its infs and NaNs silently: a warning fails the case
            warnings.simplefilter("error", RuntimeWarning)
            run_case(case(name))
    except Exception as e:  # noqa: BLE001 - any failure of the engine is a failed case
        return f"{type(e).__name__}: {e}"
    return ""


def _params() -> list:
    marks = {n: pytest.mark.xfail(reason=r, strict=True) for n, r in EXPECTED_FAILURES.items()}
    return [pytest.param(n, id=n, marks=marks.get(n, ())) for n in sorted(index())]


@pytest.mark.parametrize("name", _params())
def test_case(name: str) -> None:
    err = outcome(name)
    assert not err, f"{name} [{index()[name][0]}]: {err[:2000]}"


def test_expected_failures_are_real_cases() -> None:
    """Every entry of EXPECTED_FAILURES names a case that exists and carries a reason."""
    unknown = sorted(set(EXPECTED_FAILURES) - set(index()))
    assert not unknown, f"EXPECTED_FAILURES lists cases that do not exist: {unknown}"
    assert all(r.strip() for r in EXPECTED_FAILURES.values())


def test_every_op_has_cases() -> None:
    have = {op for op, _ in index().values()}
    missing = sorted(set(TIER1 + TIER2 + TIER3 + TIER4) - have - NO_CASES)
    assert not missing, f"no conformance case found for {missing}"
    assert not NO_CASES & have, f"NO_CASES lists ops that have cases now: {sorted(NO_CASES & have)}"


def test_pass_rate() -> None:
    """The share of cases passing: every case but those of EXPECTED_FAILURES, which ``test_case`` checks
    one by one (a listed case that passes and an unlisted one that fails both fail there)."""
    names = sorted(index())
    failed = [n for n in names if n in EXPECTED_FAILURES]
    rate = 1 - len(failed) / len(names)
    summary = f"{len(names) - len(failed)} of {len(names)} passed ({rate:.1%})"
    assert rate >= MIN_PASS_RATE, f"{summary}; failed: {failed}"


if __name__ == "__main__":  # rewrite the index for the installed onnx
    built = _built_index()
    with open(INDEX + ".tmp", "w") as f:
        json.dump({"onnx": onnx.__version__, "ops": sorted(OPS),
                   "cases": {k: list(v) for k, v in sorted(built.items())}}, f, indent=0)
        f.write("\n")
    os.replace(INDEX + ".tmp", INDEX)
    print(f"{len(built)} cases written to {INDEX}")
