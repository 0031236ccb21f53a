"""bench.transpose: its one-node models are checker-clean Transposes (a Reshape after some), and its quick run
compares onnxtrain, numpy's copy and onnxruntime (outputs checked equal to onnxruntime's first)."""

from __future__ import annotations

import onnx
import pytest

from bench import transpose


@pytest.mark.parametrize("name,xs,perm,target", transpose.CASES + transpose.QUICK)
def test_cases_are_valid_transposes_of_the_last_axis(name, xs, perm, target) -> None:
    model = transpose.one_node(xs, perm, target)
    onnx.checker.check_model(model, full_check=True)
    assert [n.op_type for n in model.graph.node] == ["Transpose"] + (["Reshape"] if target else [])
    assert perm[-1] != len(xs) - 1, name  # the last axis moves


def test_quick_run(capsys) -> None:
    pytest.importorskip("onnxruntime")
    assert transpose.main(["--quick"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert len(rows) == len(transpose.QUICK)
    assert all(float(r.split()[-1]) > 0 for r in rows)
