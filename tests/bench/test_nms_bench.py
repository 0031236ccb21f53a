"""bench.nms: its model is a checker-clean NonMaxSuppression node and its quick run compares both engines
(selected indices checked equal to onnxruntime's before timing)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from bench import nms


@pytest.mark.parametrize("center", [False, True])
def test_nms_bench_model_is_valid_onnx(center: bool) -> None:
    model = nms.model(center)
    onnx.checker.check_model(model, full_check=True)
    (node,) = model.graph.node
    assert node.op_type == "NonMaxSuppression"
    feeds = nms.inputs(2, 3, 100, 10, center)
    assert feeds["boxes"].shape == (2, 100, 4) and feeds["scores"].shape == (2, 3, 100)
    assert feeds["boxes"].dtype == feeds["scores"].dtype == np.float32


def test_nms_bench_quick_run(capsys) -> None:
    pytest.importorskip("onnxruntime")
    assert nms.main(["--quick", "--repeats", "5"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "ratio" in line]
    assert len(rows) == 2  # corner and centre boxes
