"""Pools under ceil_mode whose last window would start in the end pad, on the onnxruntime backend: the window
is dropped (torch, onnxruntime's kernels, the numpy engine), ONNX's shape inference counts it, and
onnxruntime's plan of a training graph failed on the inferred shape ("Shape mismatch attempting to re-use
buffer"; found by tests/engine/random_models.py). Oracle: torch's pools and autograd."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxtrain.ir.ceil_pools import ceil_mode_pools
from tests.session.helpers import sgd_matches_torch

pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

# (op, attributes, input's H, W): H drops its last window; W keeps a last window that overhangs the end pad
CASES: dict[str, tuple[str, dict[str, Any], int, int]] = {
    "max": ("MaxPool", {}, 3, 8),
    "avg-without-pads": ("AveragePool", {"count_include_pad": 0}, 3, 8),
    "avg-with-pads": ("AveragePool", {"count_include_pad": 1}, 3, 8),
    "max-both-axes-dropped": ("MaxPool", {}, 3, 4),
    "avg-larger": ("AveragePool", {"count_include_pad": 1}, 5, 7),
}
GEOMETRY = {"kernel_shape": [2, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1}


def _torch_pool(op: str, x: Any, attrs: dict[str, Any]) -> Any:
    if op == "MaxPool":
        return torch.nn.functional.max_pool2d(x, (2, 3), (2, 2), (1, 1), ceil_mode=True)
    return torch.nn.functional.avg_pool2d(x, (2, 3), (2, 2), (1, 1), ceil_mode=True,
                                          count_include_pad=bool(attrs["count_include_pad"]))


def _model(op: str, attrs: dict[str, Any], h: int, w: int, w0: np.ndarray) -> onnx.ModelProto:
    """loss = Σ pool(sigmoid(x · W))²: the pool's gradient reaches the Sigmoid's (where the plan failed)."""
    nodes = [helper.make_node("Mul", ["x", "W"], ["xw"]), helper.make_node("Sigmoid", ["xw"], ["s"]),
             helper.make_node(op, ["s"], ["p"], name="pool", **GEOMETRY, **attrs),
             helper.make_node("Mul", ["p", "p"], ["p2"]),
             helper.make_node("ReduceSum", ["p2"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, ["N", 3, h, w])],
                          [helper.make_tensor_value_info("loss", 1, [])], [numpy_helper.from_array(w0, "W")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_rewritten_pool_has_the_windows_and_inferred_shape_of_the_run(case: str) -> None:
    op, attrs, h, w = CASES[case]
    model = _model(op, attrs, h, w, np.ones((1, 3, 1, 1), np.float32))
    rewritten = ceil_mode_pools(model)
    assert rewritten is not model
    x = np.random.default_rng(0).standard_normal((2, 3, h, w)).astype(np.float32)
    want = _torch_pool(op, torch.tensor(x, dtype=torch.float64), attrs).numpy()
    # ONNX's inference now gives the run's shape; onnxruntime's values are torch's
    inferred = onnx.shape_inference.infer_shapes(rewritten)
    dims = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim][2:]
            for v in inferred.graph.value_info}
    assert dims["p"] == list(want.shape[2:])
    import onnxruntime as ort

    pool_only = helper.make_model(helper.make_graph(
        [n for n in rewritten.graph.node if n.name == "pool"], "pool",
        [helper.make_tensor_value_info("s", 1, ["N", 3, h, w])],
        [helper.make_tensor_value_info("p", 1, None)]),
        opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    got = ort.InferenceSession(pool_only.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"s": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_ceil_mode_pool_trains_on_the_backend_as_torch(case: str) -> None:
    """Three SGD steps on both backends against torch's autograd (the backend failed at the first)."""
    op, attrs, h, w = CASES[case]
    rng = np.random.default_rng(1)
    w0 = rng.standard_normal((1, 3, 1, 1)).astype(np.float32)
    model = _model(op, attrs, h, w, w0).SerializeToString()
    feeds = [rng.standard_normal((n, 3, h, w)).astype(np.float32) for n in (2, 1, 3)]
    sgd_matches_torch(model, w0, feeds,
                      lambda x, wt: _torch_pool(op, torch.sigmoid(x * wt), attrs).pow(2).sum(), 0.05)


def test_pools_that_drop_no_window_or_have_unknown_sizes_are_left_alone() -> None:
    w0 = np.ones((1, 3, 1, 1), np.float32)
    model = _model("MaxPool", {}, 4, 8, w0)  # H 4: windows at -1 and 1, none in the end pad
    assert ceil_mode_pools(model) is model
    dynamic = _model("MaxPool", {}, 3, 8, w0)
    dynamic.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", 1, ["N", 3, "H", "W"]))
    assert ceil_mode_pools(dynamic) is dynamic
