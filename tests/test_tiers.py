"""The default suite and the full one (tests/tiers.py): what the default leaves out, and that it still
exports every audited layer with dynamo."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUZZ = "tests/autodiff/test_control_flow_fuzz.py"


def _collect(path: str, value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ONNXTRAIN_FULL_TESTS"}
    if value is not None:
        env["ONNXTRAIN_FULL_TESTS"] = value
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", path]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_the_default_suite_deselects_the_extended_fuzz_seeds_and_the_full_one_runs_them() -> None:
    from tests.autodiff.test_control_flow_fuzz import DEFAULT_SEEDS, RANDOM_DEFAULT, RANDOM_SEEDS, SEEDS

    every = sum(len(s) for s in SEEDS.values()) + RANDOM_SEEDS
    left_out = every - sum(DEFAULT_SEEDS.values()) - RANDOM_DEFAULT
    assert 0 < left_out < every
    default = _collect(FUZZ, None)
    assert default.returncode == 0, default.stdout[-2000:] + default.stderr[-2000:]
    assert re.search(rf"\({left_out} deselected\)", default.stdout), default.stdout[-500:]
    assert "test_fuzz[loop-0]" in default.stdout and "test_fuzz[loop-99]" not in default.stdout
    full = _collect(FUZZ, "1")
    assert full.returncode == 0 and "deselected" not in full.stdout, full.stdout[-500:]
    assert "test_fuzz[loop-99]" in full.stdout


def test_a_wrong_value_stops_the_run_naming_the_variable() -> None:
    r = _collect(FUZZ, "yes")
    assert r.returncode == 4, (r.returncode, r.stdout[-500:], r.stderr[-500:])
    assert "ONNXTRAIN_FULL_TESTS must be 0 or 1, got 'yes'" in r.stdout + r.stderr


@pytest.mark.parametrize("value", ["", "1"])
def test_every_layer_is_exported_by_dynamo_in_either_suite(value: str, monkeypatch) -> None:
    """A layer whose dynamic dynamo export the default suite leaves out has its static one in the audit."""
    pytest.importorskip("torch")
    monkeypatch.setenv("ONNXTRAIN_FULL_TESTS", value)
    from tests.autodiff import test_torch_layers_audit as audit
    from tests.autodiff import test_torch_layers_dynamic as dynamic
    from tests.autodiff.torch_layer_sizes import (
        DEFAULT_DYNAMO,
        EXPORT_WRONG_DYNAMIC,
        SIZES,
        dynamic_dynamo_cases,
    )

    def dynamo_run(params: list) -> set[str]:
        return {p.values[0] for p in params
                if p.values[1] == "dynamo" and not any(m.name == "extended" for m in p.marks)}

    in_dynamic = dynamo_run(dynamic._dynamic_params())
    in_static = dynamo_run(audit._params(audit.CASES, dynamic_dynamo_cases()))
    wanted = {c for c in SIZES if (c, "dynamo") not in EXPORT_WRONG_DYNAMIC}
    assert in_dynamic == (wanted if value == "1" else wanted & DEFAULT_DYNAMO)
    assert wanted <= in_dynamic | in_static
    assert not in_dynamic & in_static  # each one export, not both


@pytest.mark.parametrize("strength", [1, 2])
def test_covering_keeps_every_value_or_pair_in_the_default_and_every_case_in_all(strength: int) -> None:
    import itertools

    from tests.tiers import covering

    factors = [[("a", 0), ("b", 1), ("c", 2)], ["x", "y"], [1, 2, 3, 4], [None, True]]
    params = covering(*factors, strength=strength)
    every = [tuple(v for value in combo for v in (value if isinstance(value, tuple) else (value,)))
             for combo in itertools.product(*factors)]
    assert [p.values for p in params] == every  # every case once, in product order, tuples spread
    default = [p.values for p in params if not p.marks]
    assert all([m.name for m in p.marks] == ["extended"] for p in params if p.marks)
    assert default == [p.values for p in covering(*factors, strength=strength) if not p.marks]
    columns = [[0, 1], [2], [3], [4]]  # each factor's places in a case

    def value(case: tuple, k: int) -> tuple:
        return tuple(case[i] for i in columns[k])

    for a, b in itertools.combinations(range(len(factors)), strength) if strength == 2 else ():
        wanted = {(value(c, a), value(c, b)) for c in every}
        assert {(value(c, a), value(c, b)) for c in default} == wanted, (a, b)
    for k in range(len(factors)):
        assert {value(c, k) for c in default} == {value(c, k) for c in every}, k
    assert len(default) == (4 if strength == 1 else 12)  # the sizes of the smallest such sets here
