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


@pytest.mark.parametrize("op, inputs, attrs", [
    ("Trilu", [np.arange(4, dtype=np.float32)], {}),  # the spec: rank 2 or more
    ("OneHot", [np.array([0, 1]), np.array([0]), np.array([0.0, 1.0], np.float32)], {}),  # depth 0
], ids=["Trilu rank 1", "OneHot depth 0"])
def test_inputs_onnxruntime_refuses_are_refused(op: str, inputs: list, attrs: dict) -> None:
    """Both ran (a rank-1 Trilu as numpy's, an empty one-hot axis); onnxruntime refuses both, as here."""
    import onnxruntime as ort

    case = OpCase(op, make_inputs=lambda: inputs, attrs=attrs, opset=17)
    model = one_node_model(case, inputs)
    with pytest.raises(Exception):  # noqa: B017 (onnxruntime's own exception classes)
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, feeds_of(inputs))
    with pytest.raises(Exception, match="rank 2 or more" if op == "Trilu" else "depth must be at least 1"):
        run_ours(model, feeds_of(inputs))
