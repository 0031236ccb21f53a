"""MeanVarianceNormalization's gradient (no table row: onnx.reference cannot run its float64 forward)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.ir.builder import make_model
from onnxtrain.testing import gradcheck, random_loss_model, run_engine


def _model(shape: tuple[int, ...], axes: list[int] | None, elem: int) -> onnx.ModelProto:
    kw = {} if axes is None else {"axes": axes}
    node = helper.make_node("MeanVarianceNormalization", ["x0"], ["y0"], **kw)
    g = helper.make_graph(
        [node],
        "mvn",
        [helper.make_tensor_value_info("x0", elem, shape)],
        [helper.make_tensor_value_info("y0", elem, shape)],
    )
    return make_model(g, 17)


@pytest.mark.parametrize("shape,axes", [((2, 3, 2, 2), None), ((3, 5), [1]), ((2, 4, 3), [0, 2])])
def test_mvn_gradient_matches_finite_differences(shape, axes) -> None:
    x = np.random.default_rng(0).uniform(-2, 2, shape)
    lm = random_loss_model(_model(shape, axes, TensorProto.DOUBLE), [shape], [0])
    # (no checker here: the schema's function body has a float32 epsilon, so a float64 MVN model does not
    # type-check; the float32 graph is checked below)
    gradcheck(lm, "loss", ["x0"], {"x0": x}, rtol=1e-5, atol=1e-7)


def test_mvn_gradient_graph_runs_on_onnxruntime() -> None:
    ort = pytest.importorskip("onnxruntime")
    shape = (2, 3, 4, 2)
    x = np.random.default_rng(1).uniform(-2, 2, shape).astype(np.float32)
    # explicit axes: onnx.checker cannot expand the function body with the default axes
    lm = random_loss_model(_model(shape, [0, 2, 3], TensorProto.FLOAT), [shape], [0], dtype=np.float32)
    gm = build_gradient_model(lm, "loss", ["x0"], outputs=["loss"])
    onnx.checker.check_model(gm, full_check=True)
    ours = run_engine(gm, {"x0": x})
    theirs = ort.InferenceSession(gm.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x0": x}
    )
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
