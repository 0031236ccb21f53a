"""bench.trees: its forests are checker-clean TreeEnsembleClassifier models and its quick run compares both
engines (labels and scores checked against onnxruntime before timing)."""

from __future__ import annotations

import onnx
import pytest

from bench import trees


@pytest.mark.parametrize("one_class", [False, True])
def test_trees_bench_forest_is_valid_onnx(one_class: bool) -> None:
    model = trees.forest(3, 4, one_class)
    onnx.checker.check_model(model, full_check=True)
    (node,) = model.graph.node
    assert node.op_type == "TreeEnsembleClassifier"
    assert len([a for a in node.attribute if a.name == "nodes_modes"][0].strings) == 3 * (2**5 - 1)


def test_trees_bench_quick_run(capsys) -> None:
    pytest.importorskip("onnxruntime")
    assert trees.main(["--quick", "--repeats", "5"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "ratio" in line]
    assert len(rows) == 2  # one and 1,000 rows
