"""bench/op_breakdown.py: both engines' profiles grouped by op, per forward."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from bench import op_breakdown as ob


def test_ops_fall_into_their_groups() -> None:
    assert ob.group_of("MatMul") == ob.group_of("FusedMatMulAdd") == "matrix products"
    assert ob.group_of("FusedElementwise") == ob.group_of("BiasGelu") == "elementwise"
    assert ob.group_of("MaskedSoftmax") == "softmax"
    assert ob.group_of("Transpose") == "layout and shapes"
    assert ob.group_of("NonMaxSuppression") == ob.OTHER


def test_kernel_time_per_run_leaves_fences_and_session_events_out() -> None:
    events = [
        {"cat": "Session", "name": "model_run", "dur": 900.0},
        {"cat": "Node", "name": "mm_fence_before", "dur": 1.0, "args": {"op_name": "MatMul"}},
        {"cat": "Node", "name": "mm_kernel_time", "dur": 300.0, "args": {"op_name": "MatMul"}},
        {"cat": "Node", "name": "sm_kernel_time", "dur": 100.0, "args": {"op_name": "Softmax"}},
        {"cat": "Node", "name": "mm_kernel_time", "dur": 500.0, "args": {"op_name": "Gemm"}},
    ]
    kept = ob.kernel_events(events)
    assert [e["dur"] for e in kept] == [300.0, 100.0, 500.0]
    assert ob.kernel_ms(kept, runs=2) == {"matrix products": 0.4, "softmax": 0.05}


def test_breakdown_profiles_both_engines_on_the_same_model() -> None:
    pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Softmax", ["r"], ["y"], axis=-1),
    ]
    f = TensorProto.FLOAT
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, [4, 16])],
                          [helper.make_tensor_value_info("y", f, [4, 8])], [w])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    result = ob.breakdown(model, {"x": rng.standard_normal((4, 16)).astype(np.float32)}, runs=3, warmup=2)
    for engine in ("onnxtrain", "onnxruntime"):
        assert result[engine]["matrix products"] > 0 and result[engine]["softmax"] > 0
    lines = ob.table(result)
    assert lines[-1].split()[0] == "total" and any("matrix products" in ln for ln in lines)
