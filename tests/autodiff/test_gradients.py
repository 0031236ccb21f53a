"""Every differentiable row of the op table: its gradient graph is standard ONNX, matches central
finite differences in float64, and gives the same numbers on onnx.reference and onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.testing import gradcheck, random_loss_model, run_engine
from tests.op_cases import ALL_CASES, OpCase
from tests.op_cases.harness import feeds_of, one_node_model

GRAD_CASES = [c for c in ALL_CASES if c.grad]


def _setup(case: OpCase):
    inputs = case.inputs(np.float64)
    model = one_node_model(case, inputs)
    feeds = feeds_of(inputs)
    outs = run_engine(model, feeds)
    float_outs = [k for k, o in enumerate(outs) if np.asarray(o).dtype == np.float64]
    use = list(case.grad_outputs) if case.grad_outputs is not None else float_outs
    lmodel = random_loss_model(model, [np.shape(o) for o in outs], use)
    wrt_idx = (
        case.wrt
        if case.wrt is not None
        else [i for i, v in enumerate(inputs) if v is not None and np.asarray(v).dtype == np.float64]
    )
    wrt = [f"x{i}" for i in wrt_idx]
    return lmodel, feeds, wrt


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.id)
def test_gradient_numeric(case: OpCase) -> None:
    if case.skip:
        pytest.skip(case.skip)
    lmodel, feeds, wrt = _setup(case)
    gmodel = build_gradient_model(lmodel, "loss", wrt, outputs=["loss"])
    onnx.checker.check_model(gmodel, full_check=True)
    gradcheck(lmodel, "loss", wrt, feeds, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.id)
def test_gradient_graph_portable(case: OpCase) -> None:
    if case.skip:
        pytest.skip(case.skip)
    from onnx.reference import ReferenceEvaluator

    lmodel, feeds, wrt = _setup(case)
    gmodel = build_gradient_model(lmodel, "loss", wrt)
    ours = run_engine(gmodel, feeds)
    if not case.ref_skip:
        ref = ReferenceEvaluator(gmodel).run(None, feeds)
        for o, a, b in zip(gmodel.graph.output, ours, ref):
            # onnx.reference computes a few functions (Erf) in float32, hence not 1e-12
            np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-9, err_msg=f"{case.id}: {o.name}")
    if case.ort_skip:
        if case.ref_skip:
            pytest.skip(f"no oracle: {case.ref_skip}; {case.ort_skip}")
        return
    ort = pytest.importorskip("onnxruntime")
    try:
        sess = ort.InferenceSession(gmodel.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime lacks float64 kernels for some ops (Tan, Elu, ...)
        if "NOT_IMPLEMENTED" in str(e):
            pytest.skip(
                f"onnxruntime has no kernel for this graph in float64 (onnx.reference agreed): {e}"[:300]
            )
        raise
    got = sess.run(None, feeds)
    for o, a, b in zip(gmodel.graph.output, ours, got):
        np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-10, err_msg=f"{case.id}: {o.name} (onnxruntime)")
