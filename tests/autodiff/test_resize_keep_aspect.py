"""The gradient of a Resize whose constant ``sizes`` keep the aspect ratio (one common scale, each axis
its own rounded size): float64 central differences, and the gradient graph on onnxruntime (the op table's
rows feed sizes at run time, for which the rule refuses by name)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.autodiff.builder import GradientError
from onnxtrain.ir.builder import make_model
from onnxtrain.testing import gradcheck, random_loss_model, run_engine

CASES = [  # (shape, sizes, axes or None, attributes)
    ((1, 2, 4, 6), [6, 6], [2, 3], {"mode": "linear", "keep_aspect_ratio_policy": "not_larger"}),
    ((1, 1, 5, 7), [3, 9], [2, 3], {"mode": "linear", "keep_aspect_ratio_policy": "not_smaller"}),
    ((1, 1, 4, 6), [6, 6], [3, 2], {"mode": "nearest", "keep_aspect_ratio_policy": "not_smaller"}),
    ((2, 1, 5, 3), [7, 7], [2, 3], {"mode": "cubic", "keep_aspect_ratio_policy": "not_larger"}),
    ((2, 4, 6), [2, 6, 6], None, {"mode": "linear", "keep_aspect_ratio_policy": "not_smaller"}),
    ((1, 3, 5), [4, 9], [0, 2], {"mode": "linear", "keep_aspect_ratio_policy": "not_larger",
                                 "coordinate_transformation_mode": "align_corners"}),
    ((3, 5, 2), [7, 4], [1, 0], {"mode": "linear", "keep_aspect_ratio_policy": "not_smaller",
                                 "coordinate_transformation_mode": "asymmetric"}),
]


def resize_model(shape, sizes, axes, attrs, dtype=TensorProto.DOUBLE) -> onnx.ModelProto:
    kw = dict(attrs)
    if axes is not None:
        kw["axes"] = axes
    node = helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], name="resize", **kw)
    g = helper.make_graph([node], "r", [helper.make_tensor_value_info("x", dtype, list(shape))],
                          [helper.make_empty_tensor_value_info("y")],
                          [numpy_helper.from_array(np.array(sizes, np.int64), "sizes")])
    return make_model(g, 19)


def _loss_model(case, dtype=TensorProto.DOUBLE):
    shape, sizes, axes, attrs = case
    m = resize_model(shape, sizes, axes, attrs, dtype)
    x = np.random.default_rng(1).uniform(-2, 2, shape).astype(np.float64 if dtype == TensorProto.DOUBLE
                                                              else np.float32)
    y = run_engine(m, {"x": x})[0]
    return random_loss_model(m, [y.shape], [0], dtype=x.dtype.type), x, y


@pytest.mark.parametrize("case", CASES, ids=[f"{c[3]['mode']}_{c[3]['keep_aspect_ratio_policy']}_{i}"
                                             for i, c in enumerate(CASES)])
def test_gradient_matches_central_differences_and_onnxruntime(case) -> None:
    lmodel, x, y = _loss_model(case)
    shape, sizes, axes, _ = case
    resized = list(range(len(shape))) if axes is None else [a % len(shape) for a in axes]
    scale = [s / shape[a] for a, s in zip(resized, sizes)]
    assert len(set(scale)) > 1  # the sizes alone would stretch: the policy matters
    gmodel = build_gradient_model(lmodel, "loss", ["x"])
    onnx.checker.check_model(gmodel, full_check=True)
    gradcheck(lmodel, "loss", ["x"], {"x": x}, rtol=1e-6, atol=1e-8)
    ort = pytest.importorskip("onnxruntime")
    lm32, x32, _ = _loss_model(case, TensorProto.FLOAT)
    g32 = build_gradient_model(lm32, "loss", ["x"])
    ours = run_engine(g32, {"x": x32})
    theirs = ort.InferenceSession(g32.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x32})
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_sizes_fed_at_run_time_are_refused_by_name() -> None:
    node = helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="linear", axes=[2, 3],
                            keep_aspect_ratio_policy="not_larger")
    g = helper.make_graph([node, helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)], "r",
                          [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [1, 1, 4, 6]),
                           helper.make_tensor_value_info("sizes", TensorProto.INT64, [2])],
                          [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])])
    with pytest.raises(GradientError, match="keep_aspect_ratio_policy.*constant"):
        build_gradient_model(make_model(g, 19), "loss", ["x"])
