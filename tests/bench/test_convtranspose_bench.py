"""bench.convtranspose: its one-node models are checker-clean, every case is strided, and its quick run
compares the engine, the col2im path and onnxruntime (outputs checked against onnxruntime's first)."""

from __future__ import annotations

import onnx
import pytest

from bench import convtranspose


@pytest.mark.parametrize("name,xs,ws,attrs", convtranspose.CASES + convtranspose.QUICK)
def test_cases_are_valid_strided_convtransposes(name, xs, ws, attrs) -> None:
    model = convtranspose.one_node(xs, ws, attrs)
    onnx.checker.check_model(model, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    assert inferred.graph.node[0].op_type == "ConvTranspose"
    assert max(attrs["strides"]) > 1, name


def test_quick_run(capsys) -> None:
    pytest.importorskip("onnxruntime")
    assert convtranspose.main(["--quick"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert len(rows) == len(convtranspose.QUICK)
    assert all(len(r.split()) >= 5 and float(r.split()[-1]) > 0 for r in rows)
