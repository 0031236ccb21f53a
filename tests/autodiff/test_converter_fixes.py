"""Old-opset ops whose meaning onnx's version converter changes on the way to the gradient builder's opset
(Resize-10 and Upsample sample with asymmetric coordinates; Hardmax before 13 works on the input read as a
matrix; Clip's bounds and Pad's value before 11 take the input's type): the gradient graph computes the
model's own forward, and its gradients match finite differences of the model (run at its opset by the
engine) and onnxruntime's forward of it."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine import compile_model
from onnxtrain.testing import gradcheck


def _model(node: onnx.NodeProto, opset: int, x_shape: list[int], y_shape: list[int], dtype: int,
           inits: list[onnx.TensorProto] = ()) -> onnx.ModelProto:
    """loss = ReduceSum(node(x) · w) with a fixed random weight w of the node's output shape."""
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    w = np.random.default_rng(1).standard_normal(y_shape).astype(np_dtype)
    g = helper.make_graph(
        [node, helper.make_node("Mul", ["y", "w"], ["yw"]), helper.make_node("ReduceSum", ["yw"], ["loss"],
                                                                             keepdims=0)],
        "g", [helper.make_tensor_value_info("x", dtype, x_shape)],
        [helper.make_tensor_value_info("loss", dtype, [])], [*inits, numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 7
    return m


def _scales(values: list[float]) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.float32), "sc")


CASES = {
    # name: (node, opset, x shape, output shape, initializers)
    "upsample9_linear": (helper.make_node("Upsample", ["x", "sc"], ["y"], mode="linear"), 9,
                         [1, 1, 3, 4], [1, 1, 6, 6], [_scales([1, 1, 2.0, 1.5])]),
    "upsample9_nearest_fraction": (helper.make_node("Upsample", ["x", "sc"], ["y"], mode="nearest"), 9,
                                   [1, 1, 3, 4], [1, 1, 7, 6], [_scales([1, 1, 2.5, 1.5])]),
    "upsample7_linear": (helper.make_node("Upsample", ["x"], ["y"], mode="linear", scales=[1.0, 1, 2, 2]), 7,
                         [1, 2, 3, 3], [1, 2, 6, 6], []),
    "resize10_nearest_down": (helper.make_node("Resize", ["x", "sc"], ["y"], mode="nearest"), 10,
                              [1, 1, 5, 6], [1, 1, 3, 4], [_scales([1, 1, 0.6, 0.7])]),
    "resize10_nearest_down_and_up": (helper.make_node("Resize", ["x", "sc"], ["y"], mode="nearest"), 10,
                                     [1, 1, 5, 4], [1, 1, 3, 7], [_scales([1, 1, 0.6, 1.75])]),
    "resize10_linear": (helper.make_node("Resize", ["x", "sc"], ["y"], mode="linear"), 10,
                        [1, 1, 4, 4], [1, 1, 7, 5], [_scales([1, 1, 1.75, 1.25])]),
    "clip6": (helper.make_node("Clip", ["x"], ["y"], min=-0.5, max=0.4), 10, [3, 4], [3, 4], []),
    "pad2_value": (helper.make_node("Pad", ["x"], ["y"], pads=[1, 0, 0, 2], value=0.5), 2, [3, 4], [4, 6],
                   []),
    # an idle value: the converted Pad-13 kept it (refused by the checker)
    "pad2_reflect_value": (helper.make_node("Pad", ["x"], ["y"], mode="reflect", pads=[1, 0, 0, 2],
                                            value=0.5), 2, [3, 4], [4, 6], []),
    "pad2_edge_value": (helper.make_node("Pad", ["x"], ["y"], mode="edge", pads=[0, 1, 2, 1], value=0.0), 2,
                        [3, 4], [5, 6], []),
    "hardmax11_axis1": (helper.make_node("Hardmax", ["x"], ["y"], axis=1), 11, [2, 3, 4], [2, 3, 4], []),
    "hardmax7_axis0": (helper.make_node("Hardmax", ["x"], ["y"], axis=0), 7, [2, 3, 4], [2, 3, 4], []),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gradient_graph_keeps_the_old_meaning(name: str) -> None:
    node, opset, xs, ys, inits = CASES[name]
    x = np.random.default_rng(0).standard_normal(xs)
    model = _model(node, opset, xs, ys, TensorProto.DOUBLE, inits)
    grad = build_gradient_model(model, "loss", ["x"])
    onnx.checker.check_model(grad, full_check=True)
    got = compile_model(grad).run({"x": x})[0]
    assert got == pytest.approx(compile_model(model).run({"x": x})[0], rel=1e-12)
    gradcheck(model, "loss", ["x"], {"x": x}, rtol=1e-6)


# onnxruntime has no kernel for opset 2's Mul: that case is checked against the engine only
@pytest.mark.parametrize("name", [n for n in CASES if not n.startswith("pad2_")])
def test_the_model_s_forward_is_onnxruntime_s(name: str) -> None:
    """The oracle's side: onnxruntime runs the float32 model at its own opset, and the gradient graph's
    loss (at opset 17) equals it."""
    node, opset, xs, ys, inits = CASES[name]
    x = np.random.default_rng(0).standard_normal(xs).astype(np.float32)
    _assert_loss_is_onnxruntime_s(_model(node, opset, xs, ys, TensorProto.FLOAT, inits), x)


def _assert_loss_is_onnxruntime_s(model: onnx.ModelProto, x: np.ndarray) -> None:
    """onnxruntime's loss of the model at its own opset equals the gradient graph's (at opset 17)."""
    ort = pytest.importorskip("onnxruntime")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    want = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    got = compile_model(build_gradient_model(model, "loss", ["x"])).run({"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_resize_10_scales_from_a_constant_node_and_computed() -> None:
    """Scales given by a Constant node are read as an initializer's are (the gradient graph rounds the
    downsampled axis up, as onnxruntime's forward does); scales computed in the graph cannot be read: the
    copy rounds down, with a warning naming the node."""
    xs, ys = [1, 1, 5, 6], [1, 1, 3, 4]
    sc = numpy_helper.from_array(np.array([1, 1, 0.6, 0.7], np.float32), "v")
    x = np.random.default_rng(0).standard_normal(xs).astype(np.float32)
    for computed in (False, True):
        model = _model(helper.make_node("Resize", ["x", "sc"], ["y"], mode="nearest", name="rs"), 10, xs, ys,
                       TensorProto.FLOAT)
        made = [helper.make_node("Constant", [], ["c" if computed else "sc"], value=sc)]
        made += [helper.make_node("Abs", ["c"], ["sc"])] if computed else []
        nodes = made + list(model.graph.node)
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        if computed:
            with pytest.warns(UserWarning, match="rs of opset 10 take scales computed in the graph"):
                build_gradient_model(model, "loss", ["x"])
            continue
        _assert_loss_is_onnxruntime_s(model, x)
