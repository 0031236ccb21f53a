"""bench.gemm_shapes: the listed products are the MLP step's, and both engines run each of them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bench import gemm_shapes
from bench.flops import step_flops


def _mlp(batch: int) -> tuple:
    """The bench MLP as plain ONNX (Gemm with transB=1 and Relu, weights out × in, as torch exports it)."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i, (n_in, n_out) in enumerate(gemm_shapes.LAYERS):
        w, b = f"w{i}", f"b{i}"
        inits += [numpy_helper.from_array(rng.standard_normal((n_out, n_in), np.float32), w),
                  numpy_helper.from_array(np.zeros(n_out, np.float32), b)]
        nodes.append(helper.make_node("Gemm", [x, w, b], [f"h{i}"], transB=1))
        x = f"h{i}"
        if i < len(gemm_shapes.LAYERS) - 1:
            nodes.append(helper.make_node("Relu", [x], [f"r{i}"]))
            x = f"r{i}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return model, {"x": rng.standard_normal((batch, gemm_shapes.LAYERS[0][0]), np.float32)}


@pytest.mark.parametrize("batch", [64, 256])
def test_the_cases_are_the_step_products_counted_from_the_graph(batch: int) -> None:
    model, feeds = _mlp(batch)
    cases = gemm_shapes.step_cases(batch)
    assert sum(c.flops for c in cases) == step_flops(model, feeds)["step"]
    assert len(cases) == 8  # three forwards, two input gradients (the first layer needs none), three weights


def test_each_case_runs_on_both_engines_and_makes_a_table() -> None:
    pytest.importorskip("onnxruntime")
    rows = gemm_shapes.measure([4], repeats=5, min_time=0.001, pause=0.0)
    assert [r[1] for r in rows] == gemm_shapes.step_cases(4)
    assert all(r[2] > 0 and r[3] > 0 for r in rows)
    lines = gemm_shapes.table(rows).splitlines()
    assert len(lines) == 2 + 8 + 1 and "the step's GEMMs" in lines[-1]


def test_a_case_model_computes_its_product() -> None:
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(1)
    for case in gemm_shapes.step_cases(3):
        feeds = gemm_shapes.feeds_for(case, rng)
        a = feeds["a"].T if case.trans_a else feeds["a"]
        b = feeds["b"].T if case.trans_b else feeds["b"]
        want = a.astype(np.float64) @ b + (feeds["c"] if case.bias else 0)
        m = gemm_shapes.gemm_model(case)
        onnx.checker.check_model(m, full_check=True)
        got = ReferenceEvaluator(m).run(None, feeds)[0]
        assert got.shape == case.out
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_bad_batches_are_refused(capsys) -> None:
    pytest.importorskip("onnxruntime")
    with pytest.raises(SystemExit):
        gemm_shapes.main(["--batches", "64,x"])
    assert "--batches" in capsys.readouterr().err
