"""bench.depthwise: its gradient graph is checker-clean and its quick run compares both engines (it checks
their results against each other before timing them)."""

from __future__ import annotations

import onnx
import pytest

from bench import depthwise


def test_depthwise_bench_graph_is_valid_onnx() -> None:
    gm = depthwise.gradient_graph(2, 8, 10, 2)
    onnx.checker.check_model(gm, full_check=True)
    assert [o.name for o in gm.graph.output] == ["loss", "x_grad", "w_grad"]


def test_depthwise_bench_quick_run(capsys) -> None:
    pytest.importorskip("onnxruntime")
    assert depthwise.main(["--quick"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "stride" in line]
    assert len(rows) == len(depthwise.QUICK)
