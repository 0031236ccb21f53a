"""bench.pow: its one-node models are checker-clean and its quick run compares the engine with onnxruntime
(outputs checked within 1 ulp of onnxruntime's first)."""

from __future__ import annotations

import onnx
import pytest

from bench import pow as pow_bench


@pytest.mark.parametrize("label,exponent,signed", pow_bench.CASES)
def test_cases_are_valid_pows(label, exponent, signed) -> None:
    model = pow_bench.pow_model(pow_bench.QUICK_SHAPE, exponent)
    onnx.checker.check_model(model, full_check=True)
    assert model.graph.node[0].op_type == "Pow"


def test_quick_run(capsys) -> None:
    pytest.importorskip("onnxruntime")
    assert pow_bench.main(["--quick"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == len(pow_bench.CASES)
    assert all(float(r.split()[-1].rstrip("×")) > 0 for r in rows)
