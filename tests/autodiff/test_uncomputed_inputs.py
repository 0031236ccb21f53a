"""Inputs whose gradient the rules leave out though it is not zero (a loss's class weights, Resize's roi and
scales, RoiAlign's boxes, Dropout's ratio): asked for, their gradient was zeros, silently, where finite
differences say otherwise; it is an error naming the node now. Unread by the loss, such an input's zeros
stay (they are right)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain.autodiff import GradientError, build_gradient_model
from onnxtrain.testing import run_engine


def _model(nodes: list, inputs: dict[str, list[int]], inits: dict[str, np.ndarray]) -> onnx.ModelProto:
    declared = [helper.make_tensor_value_info(k, T.DOUBLE, v) for k, v in inputs.items()]
    g = helper.make_graph(nodes, "g", declared,
                          [helper.make_tensor_value_info("loss", T.DOUBLE, [])],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m, full_check=True)
    return m


def _loss(m: onnx.ModelProto, feeds: dict) -> float:
    return float(run_engine(m, feeds)[0])


LABELS = {"L": np.array([0, 2, 3], np.int64)}
SCORES = {"S": [3, 4], "W": [4]}


@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
def test_a_loss_class_weight_is_refused_by_name(op: str) -> None:
    m = _model([helper.make_node(op, ["S", "L", "W"], ["loss"], reduction="sum", name="the_loss")], SCORES,
               LABELS)
    feeds = {"S": np.random.default_rng(0).standard_normal((3, 4)), "W": np.array([0.5, 1.0, 1.5, 2.0])}
    d = np.zeros(4)
    d[2] = 1e-6  # the derivative the rule would have to give is not zero
    assert abs(_loss(m, {**feeds, "W": feeds["W"] + d}) - _loss(m, {**feeds, "W": feeds["W"] - d})) > 1e-8
    msg = rf"'W' reaches the loss only through input 2 .* 'the_loss' \({op}\)"
    with pytest.raises(GradientError, match=msg):
        build_gradient_model(m, "loss", ["S", "W"])
    g = build_gradient_model(m, "loss", ["S"])  # the scores alone: as before
    onnx.checker.check_model(g, full_check=True)


def test_resize_roi_and_a_dropout_ratio_are_refused() -> None:
    x = {"X": [1, 1, 4, 4], "roi": [8]}
    scales = {"sc": np.array([1, 1, 1.5, 1.5], np.float32)}
    resize = helper.make_node("Resize", ["X", "roi", "sc"], ["Y"], mode="linear",
                              coordinate_transformation_mode="tf_crop_and_resize", name="crop")
    m = _model([resize, helper.make_node("ReduceSum", ["Y"], ["loss"], keepdims=0)], x, scales)
    with pytest.raises(GradientError, match=r"'roi' .* node 'crop' \(Resize\)"):
        build_gradient_model(m, "loss", ["roi"])
    drop = helper.make_node("Dropout", ["X", "ratio", "on"], ["Y"], seed=1, name="drop")
    m = _model([drop, helper.make_node("ReduceSum", ["Y"], ["loss"], keepdims=0)], {"X": [4], "ratio": []},
               {"on": np.array(True)})
    with pytest.raises(GradientError, match=r"'ratio' .* node 'drop' \(Dropout\)"):
        build_gradient_model(m, "loss", ["X", "ratio"])


def test_an_uncomputed_input_off_the_losss_path_keeps_its_zeros() -> None:
    """The class weight feeds a second loss the gradient's loss does not read: its derivative is zero."""
    nodes = [helper.make_node("SoftmaxCrossEntropyLoss", ["S", "L", "W"], ["other"], reduction="sum"),
             helper.make_node("ReduceSum", ["S"], ["loss"], keepdims=0)]
    m = _model(nodes, SCORES, LABELS)
    g = build_gradient_model(m, "loss", ["S", "W"], outputs=["loss"])
    feeds = {"S": np.ones((3, 4)), "W": np.ones(4)}
    got = dict(zip([o.name for o in g.graph.output], run_engine(g, feeds)))
    np.testing.assert_array_equal(got["W_grad"], np.zeros(4))
    np.testing.assert_array_equal(got["S_grad"], np.ones((3, 4)))


def test_a_value_reaching_the_loss_also_through_a_class_weight_is_refused() -> None:
    """``P`` feeds the scores and, through Abs, the class weights: its gradient would hold the scores'
    part alone, which went unsaid; it is an error naming the node."""
    nodes = [helper.make_node("Mul", ["S", "P"], ["S2"]),
             helper.make_node("Abs", ["P"], ["W"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["S2", "L", "W"], ["loss"], reduction="sum",
                              name="the_loss")]
    m = _model(nodes, {"S": [3, 4], "P": [4]}, LABELS)
    g = build_gradient_model(m, "loss", ["S"])  # without P: as before
    onnx.checker.check_model(g, full_check=True)
    with pytest.raises(GradientError, match=r"'P' reaches the loss also through input 2 \('W'\) of node "
                                            r"'the_loss' \(SoftmaxCrossEntropyLoss\)"):
        build_gradient_model(m, "loss", ["S", "P"])
