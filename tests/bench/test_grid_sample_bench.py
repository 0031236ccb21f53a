"""bench.grid_sample: its models are checker-clean one-node GridSample models and its quick run compares both
engines (outputs checked against onnxruntime before timing)."""

from __future__ import annotations

import onnx
import pytest

from bench import grid_sample


@pytest.mark.parametrize("mode, padding", grid_sample.MODES)
def test_grid_sample_bench_model_is_valid_onnx(mode: str, padding: str) -> None:
    model = grid_sample.grid_sample_model((2, 3, 5, 6), mode, padding)
    onnx.checker.check_model(model, full_check=True)
    (node,) = model.graph.node
    assert node.op_type == "GridSample"


def test_grid_sample_bench_quick_run(capsys) -> None:
    pytest.importorskip("onnxruntime")
    assert grid_sample.main(["--quick", "--repeats", "5"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "ratio" in line]
    assert len(rows) == len(grid_sample.MODES) * len(grid_sample.QUICK)
