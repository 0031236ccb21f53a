"""Random draws inside control-flow bodies: the gradient recomputes the body, and a Dropout in training mode
or a random op there drew anew, so the gradient followed other masks (other noise) than the forward pass
(off by up to 282 against the forward's own masks, in onnxtrain and in onnxruntime running the same
gradient graph). The forward body now gives its draws to the backward one.

Oracle: each loss here is linear and homogeneous in the weight W (every path multiplies by W once), so
Σ W·∂L/∂W equals L for the draws the forward made, in float64, and in any runtime (ratio 0.5: a scale
exact in float32 too, which onnxruntime computes Dropout's in); a gradient from
other draws breaks it. The gradient graphs pass onnx.checker (full check) and run in onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import onnxtrain
from onnxtrain.autodiff import GradientError, build_gradient_model
from tests.session.helpers import params

D = T.DOUBLE
N = 40
vi = helper.make_tensor_value_info


def _inits() -> list[onnx.TensorProto]:
    w = np.random.default_rng(0).uniform(0.5, 1.5, N)
    return [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array(0.5), "ratio"),
            numpy_helper.from_array(np.array(True), "on")]


def _drawing(op: str, x: str, out: str) -> list[onnx.NodeProto]:
    """``out`` = a random function of ``x``, linear in it: Dropout(x), or x · noise."""
    if op == "Dropout":  # no mask output, as torch exports it
        return [helper.make_node("Dropout", [x, "ratio", "on"], [out], name="drop")]
    return [helper.make_node(op, [x], [out + "_noise"], name="noise", dtype=D),
            helper.make_node("Mul", [x, out + "_noise"], [out])]


def _loop(op: str) -> onnx.ModelProto:
    """h ← h + draw(x·W) over N iterations; loss = Σ h."""
    return _loop_of([helper.make_node("Mul", ["x", "W"], ["xw"]), *_drawing(op, "xw", "d")], "loop")


def _loop_of(step: list[onnx.NodeProto], name: str) -> onnx.ModelProto:
    """h ← h + d over N iterations, ``step`` computing d; loss = Σ h."""
    body = helper.make_graph(
        [*step, helper.make_node("Add", ["h", "d"], ["hn"]), helper.make_node("Identity", ["c"], ["cn"])],
        "b", [vi("i", T.INT64, []), vi("c", T.BOOL, []), vi("h", D, [N])],
        [vi("cn", T.BOOL, []), vi("hn", D, [N])])
    nodes = [helper.make_node("Loop", ["K", "", "h0"], ["hf"], body=body, name=name),
             helper.make_node("ReduceSum", ["hf"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [vi("K", T.INT64, []), vi("x", D, [N]), vi("h0", D, [N])],
                          [vi("loss", D, [])], _inits())
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _scan(op: str) -> onnx.ModelProto:
    """A Scan over the rows of x [3, N]: s ← s + draw(row·W); loss = Σ s."""
    body = helper.make_graph(
        [helper.make_node("Mul", ["row", "W"], ["rw"]), *_drawing(op, "rw", "d"),
         helper.make_node("Add", ["s", "d"], ["sn"])],
        "b", [vi("s", D, [N]), vi("row", D, [N])], [vi("sn", D, [N])])
    nodes = [helper.make_node("Scan", ["s0", "x"], ["sf"], body=body, num_scan_inputs=1, name="scan"),
             helper.make_node("ReduceSum", ["sf"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [vi("x", D, [3, N]), vi("s0", D, [N])], [vi("loss", D, [])], _inits())
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _if(op: str) -> onnx.ModelProto:
    """then: draw(x·W); else: x·W; loss = Σ of the branch's output."""
    then_g = helper.make_graph([helper.make_node("Mul", ["x", "W"], ["xw"]), *_drawing(op, "xw", "d")],
                               "t", [], [vi("d", D, [N])])
    else_g = helper.make_graph([helper.make_node("Mul", ["x", "W"], ["e"])], "e", [], [vi("e", D, [N])])
    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g, name="if"),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [vi("c", T.BOOL, []), vi("x", D, [N])], [vi("loss", D, [])], _inits())
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


FEEDS = {"loop": {"K": np.array(4), "x": np.linspace(1, 2, N), "h0": np.zeros(N)},
         "scan": {"x": np.linspace(1, 2, 3 * N).reshape(3, N), "s0": np.zeros(N)},
         "if": {"c": np.array(True), "x": np.linspace(1, 2, N)}}
MAKERS = {"loop": _loop, "scan": _scan, "if": _if}


@pytest.mark.parametrize("op", ["Dropout", "RandomNormalLike", "RandomUniformLike"])
@pytest.mark.parametrize("kind", ["loop", "scan", "if"])
def test_the_gradient_follows_the_forward_draws(kind: str, op: str) -> None:
    grad_model = build_gradient_model(MAKERS[kind](op), "loss", ["W"])
    onnx.checker.check_model(grad_model, full_check=True)
    w = numpy_helper.to_array(_inits()[0])
    data = grad_model.SerializeToString()
    sessions = (onnxtrain.InferenceSession(data),
                ort.InferenceSession(data, providers=["CPUExecutionProvider"]))
    for session in sessions:
        for _ in range(3):
            loss, grad = session.run(["loss", "W_grad"], FEEDS[kind])
            np.testing.assert_allclose(float(w @ grad), float(loss), rtol=1e-12)


def test_a_legacy_session_step_follows_the_forward_masks() -> None:
    """One SGD step over a Loop whose body drops out: W moves by lr·∂L/∂W of the masks the loss used."""
    p = params(weights_to_train={"W"}, set_gradients_as_graph_outputs=True)
    s = onnxtrain.TrainingSession(_loop("Dropout").SerializeToString(), p)
    w = s.get_state()["W"].copy()
    loss, grad = s.run(["loss", "W_grad"], {**FEEDS["loop"], "Learning_Rate": np.array([0.1], np.float32)})
    np.testing.assert_allclose(float(w @ grad), float(loss), rtol=1e-12)
    np.testing.assert_allclose(s.get_state()["W"], w - np.float64(np.float32(0.1)) * grad, rtol=1e-12)


def test_a_draw_in_a_nested_body_is_refused_by_name() -> None:
    inner = helper.make_graph([helper.make_node("Mul", ["x", "W"], ["xw"]), *_drawing("Dropout", "xw", "d")],
                              "t", [], [vi("d", D, [N])])
    plain = helper.make_graph([helper.make_node("Mul", ["x", "W"], ["e"])], "e", [], [vi("e", D, [N])])
    step = [helper.make_node("If", ["c"], ["d"], then_branch=inner, else_branch=plain, name="inner_if")]
    model = _loop_of(step, "outer")
    with pytest.raises(GradientError, match=r"Dropout node 'drop' draws in a body nested in Loop 'outer'"):
        build_gradient_model(model, "loss", ["W"])


def test_a_nested_dropout_in_inference_form_draws_nothing_and_builds() -> None:
    """A Dropout without training_mode (an eval export) in a body nested in a Loop's draws nothing: the
    nested check took every Dropout for a draw and refused it. Its gradient passes dY through (W·Σ check)."""
    inner = helper.make_graph([helper.make_node("Mul", ["x", "W"], ["xw"]),
                               helper.make_node("Dropout", ["xw"], ["d"], name="drop")],
                              "t", [], [vi("d", D, [N])])
    plain = helper.make_graph([helper.make_node("Mul", ["x", "W"], ["e"])], "e", [], [vi("e", D, [N])])
    step = [helper.make_node("If", ["c"], ["d"], then_branch=inner, else_branch=plain, name="inner_if")]
    model = _loop_of(step, "outer")
    grad_model = build_gradient_model(model, "loss", ["W"])
    onnx.checker.check_model(grad_model, full_check=True)
    w = numpy_helper.to_array(_inits()[0])
    session = onnxtrain.InferenceSession(grad_model.SerializeToString())
    loss, grad = session.run(["loss", "W_grad"], FEEDS["loop"])
    np.testing.assert_allclose(float(w @ grad), float(loss), rtol=1e-12)
