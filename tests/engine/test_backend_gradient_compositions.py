"""Gradient graphs of the autodiff fuzzes run on onnxtrain's onnxruntime backend (its graph optimizations on),
against torch autograd and the numpy engine, and the onnxruntime optimizers the backend turns off for the
graphs among them that those optimizers load wrong."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain import InferenceSession, SessionOptions
from onnxtrain.autodiff import build_gradient_model
from onnxtrain.ir.builder import make_model

ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")


def _backend() -> SessionOptions:
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    return so


def _run(model: onnx.ModelProto, feeds: dict) -> dict:
    sess = InferenceSession(model.SerializeToString(), _backend())
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


# ---- FuseReluClip: a Clip bound that constant folding makes a float64 constant --------------------------
def _relu_clip(bound: str) -> onnx.ModelProto:
    """loss = Σ u·Clip(Relu(x·w), lo, 2) in float64, lo = 0.5 reached through ``bound`` (Expand to shape [],
    Identity or Cast of an initializer): only onnxruntime's constant folding makes it a constant."""
    inits = [numpy_helper.from_array(np.array(0.5), "half"), numpy_helper.from_array(np.array(2.0), "two"),
             numpy_helper.from_array(np.array([0.3, -1.2, 0.8, 1.5]), "w"),
             numpy_helper.from_array(np.array([1.0, 0.5, -0.7, 1.3]), "u"),
             numpy_helper.from_array(np.zeros(0, np.int64), "scalar")]
    lo = {"Expand": helper.make_node("Expand", ["half", "scalar"], ["lo"]),
          "Identity": helper.make_node("Identity", ["half"], ["lo"]),
          "Cast": helper.make_node("Cast", ["half"], ["lo"], to=T.DOUBLE)}[bound]
    nodes = [lo, helper.make_node("Mul", ["x", "w"], ["xw"]), helper.make_node("Relu", ["xw"], ["r"]),
             helper.make_node("Clip", ["r", "lo", "two"], ["y"]), helper.make_node("Mul", ["y", "u"], ["yu"]),
             helper.make_node("ReduceSum", ["yu"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "relu_clip", [helper.make_tensor_value_info("x", T.DOUBLE, [4])],
                              [helper.make_tensor_value_info("loss", T.DOUBLE, [])], inits)
    return make_model(graph, 17)


@pytest.mark.parametrize("bound", ["Expand", "Identity", "Cast"])
def test_relu_then_clip_by_a_folded_float64_bound(bound: str) -> None:
    """onnxruntime's FuseReluClip refused the model at load ("Unexpected data type for Clip 'min' input of
    11") when the float64 bound only became a constant by folding (the fuzz's gradient graphs of a Clip whose
    bound is an Expand of a constant, seeds 1897 and 1983): the forward and its gradient graph, on the
    backend, against torch."""
    model = _relu_clip(bound)
    x = np.array([0.9, 0.2, -1.0, 1.6])
    w = torch.tensor([0.3, -1.2, 0.8, 1.5], dtype=torch.float64, requires_grad=True)
    u = torch.tensor([1.0, 0.5, -0.7, 1.3], dtype=torch.float64)
    loss = (torch.clamp(torch.relu(torch.as_tensor(x) * w), 0.5, 2.0) * u).sum()
    loss.backward()
    np.testing.assert_allclose(_run(model, {"x": x})["loss"], loss.item(), rtol=1e-12)
    got = _run(build_gradient_model(model, "loss", ["w"]), {"x": x})
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-12)
    np.testing.assert_allclose(got["w_grad"], w.grad.numpy(), rtol=1e-12, atol=1e-15)


# ---- ConstantFolding: an If of a constant condition inside a body -----------------------------------------
def test_a_body_if_of_a_constant_condition() -> None:
    """onnxruntime's ConstantFolding inlines an If whose condition it computes from initializers; in the
    backward Loop of the control-flow fuzz's seed 542 (a recomputed If and its gradient If on
    ReduceSum(w) > 0, w an initializer) the recomputed If's used output then went missing and the run
    failed ("Missing Input: Loop_Grad/if_134"). The gradient graph on the backend, against onnxruntime
    with its optimizations off."""
    from tests.engine.control_flow_gen import random_case

    case = random_case(542, grad=True)
    gmodel = build_gradient_model(case.oracle, "loss", case.wrt)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = ort.InferenceSession(gmodel.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
        None, case.feeds)
    got = _run(gmodel, case.feeds)
    for o, w in zip(gmodel.graph.output, want):
        np.testing.assert_allclose(got[o.name], w, rtol=1e-12, atol=1e-14, err_msg=o.name)


def _if_model(in_body: bool, fed_w: bool) -> onnx.ModelProto:
    """y = x · If(ReduceSum(w) > 0, Identity, Sin)(x), in a Loop's body or in the main graph; w an
    initializer, or also a graph input (its value then unknown until fed)."""
    d = T.DOUBLE
    branch = [helper.make_graph([helper.make_node(op, ["v"], [f"o{op}"])], op, [],
                                [helper.make_tensor_value_info(f"o{op}", d, None)])
              for op in ("Identity", "Sin")]
    nodes = [helper.make_node("ReduceSum", ["w"], ["s"], keepdims=0),
             helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(np.array(0.0))),
             helper.make_node("Greater", ["s", "zero"], ["cond"]),
             helper.make_node("If", ["cond"], ["f"], then_branch=branch[0], else_branch=branch[1]),
             helper.make_node("Mul", ["v", "f"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", d, [3]), helper.make_tensor_value_info("n", T.INT64, [])]
    inputs += [helper.make_tensor_value_info("w", d, [2])] if fed_w else []
    if in_body:
        body = helper.make_graph([helper.make_node("Identity", ["c"], ["c_out"])] + nodes, "body",
                                 [helper.make_tensor_value_info("i", T.INT64, []),
                                  helper.make_tensor_value_info("c", T.BOOL, []),
                                  helper.make_tensor_value_info("v", d, [3])],
                                 [helper.make_tensor_value_info("c_out", T.BOOL, []),
                                  helper.make_tensor_value_info("y", d, [3])])
        nodes = [helper.make_node("Loop", ["n", "", "x"], ["out"], body=body)]
    else:
        nodes = [helper.make_node("Identity", ["x"], ["v"]), *nodes,
                 helper.make_node("Identity", ["y"], ["out"])]
    graph = helper.make_graph(nodes, "ifs", inputs, [helper.make_tensor_value_info("out", d, [3])],
                              [numpy_helper.from_array(np.array([0.5, -0.2]), "w")])
    return make_model(graph, 17)


@pytest.mark.parametrize("in_body, fed_w", [(True, False), (True, True), (False, False)])
def test_constant_folding_is_kept_where_no_body_if_folds(in_body: bool, fed_w: bool) -> None:
    """ConstantFolding goes only for an If in a body whose condition folds (not for one in the main graph,
    nor for one whose initializer may be fed); the values, on the backend, equal onnxruntime's unoptimized."""
    from onnxtrain.engine.ort_optimizers import disabled_optimizers

    model = _if_model(in_body, fed_w)
    assert ("ConstantFolding" in disabled_optimizers(model)) == (in_body and not fed_w)
    feeds = {"x": np.array([0.1, -0.4, 0.7]), "n": np.array(3, np.int64)}
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    want = plain.run(None, feeds)
    np.testing.assert_allclose(_run(model, feeds)["out"], want[0], rtol=1e-14)


# ---- a sample of the random compositions on the backend ---------------------------------------------------
@pytest.mark.parametrize("seed", [*range(7, 3000, 150), 1897, 1983, 21003, 21407])
def test_random_composition_gradients_on_the_backend(seed: int) -> None:
    """The random-composition fuzz's gradient graphs (tests/autodiff/random_compositions.py) on the backend,
    onnxruntime's optimizations on, against torch autograd (6,000 seeds passed by hand: 0-2999 and
    21000-23999; 1897 and 1983 were refused at load before FuseReluClip's folded-bound check)."""
    from tests.autodiff.random_compositions import _close, gradient_model, make_case, torch_grads

    case = make_case(seed)
    if not case.wrt:
        pytest.skip("no gradient to take")
    want, fwd = torch_grads(case)
    feeds = {**case.feeds, **{f"{y}_grad": v for y, v in case.other_ys.items()}}
    got = _run(gradient_model(case), feeds)
    assert _close(got["loss"], fwd["loss"], case.float32)
    for w in case.wrt:
        assert _close(got[f"{w}_grad"], want[w], case.float32), w
