"""Every row of the op table, run by our engine and by onnx.reference, in float32 and float64."""

from __future__ import annotations

import numpy as np
import pytest

from tests.op_cases import ALL_CASES, OpCase
from tests.op_cases.harness import feeds_of, one_node_model, run_ours, run_reference, run_reference_body


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.id)
def test_forward_matches_reference(case: OpCase, dtype) -> None:
    if case.skip:
        pytest.skip(case.skip)
    inputs = case.inputs(dtype)
    model = one_node_model(case, inputs)
    ours = run_ours(model, feeds_of(inputs))
    ref = (run_reference_body if case.body_oracle else run_reference)(model, feeds_of(inputs))
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref)):
        b = np.asarray(b)
        if dtype == np.float64 and i in case.f64_dtypes:  # the spec's dtype, not the reference's
            assert a.dtype == case.f64_dtypes[i][0], f"output {i}: dtype {a.dtype}"
            b = b.astype(a.dtype)
        assert a.dtype == b.dtype, f"output {i}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"output {i}: shape {a.shape} != {b.shape}"
        tol = 1e-5 if dtype == np.float32 else 1e-10
        np.testing.assert_allclose(a, b, rtol=max(tol, case.rtol if dtype == np.float32 else tol),
                                   atol=case.atol if dtype == np.float32 else 1e-10, err_msg=case.id)
