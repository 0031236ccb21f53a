"""Dilated Convs with auto_pad SAME_* on the onnxruntime backend: onnxruntime 1.32 refuses them, so the
backend gives them explicit pads (onnxtrain/engine/ort_same_pads.py). Oracles: onnx.reference on the
original node, torch autograd for a training step."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxtrain
from onnxtrain.engine.ort_same_pads import dilated_same_pads
from onnxtrain.ir.builder import value_types
from tests.session.helpers import backend_options, params

ort = pytest.importorskip("onnxruntime")

# kernel, stride, dilation, H×W (None: sizes known only at run time)
CASES = [(3, 1, 2, None), (4, 1, 2, None), (3, 2, 2, (9, 10)), (2, 3, 3, (10, 11))]


def _conv(auto_pad: str, k: int, stride: int, dil: int, hw: tuple[int, int] | None) -> onnx.ModelProto:
    dims = ["H", "W"] if hw is None else list(hw)
    node = helper.make_node("Conv", ["x", "w"], ["y"], auto_pad=auto_pad, dilations=[dil, dil],
                            strides=[stride, stride])
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, *dims]),
                                        helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 2, k, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, "P", "Q"])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
@pytest.mark.parametrize("case", CASES)
def test_the_explicit_pads_give_the_same_values(auto_pad: str, case: tuple) -> None:
    k, stride, dil, hw = case
    model = _conv(auto_pad, k, stride, dil, hw)
    out = dilated_same_pads(model, lambda: value_types(model))
    attrs = {a.name: helper.get_attribute_value(a) for a in out.graph.node[0].attribute}
    assert "auto_pad" not in attrs and len(attrs["pads"]) == 4
    onnx.checker.check_model(out, full_check=True)
    rng = np.random.default_rng(k + stride)
    size = hw or (7, 8)
    x = rng.standard_normal((1, 2, *size)).astype(np.float32)
    w = rng.standard_normal((3, 2, k, k)).astype(np.float32)
    want = ReferenceEvaluator(model).run(None, {"x": x, "w": w})[0]
    got = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "w": w})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_stride_over_unknown_sizes_is_left_as_it_is() -> None:
    model = _conv("SAME_UPPER", 3, 2, 2, None)
    assert dilated_same_pads(model, lambda: value_types(model)) is model


def test_the_backend_trains_a_dilated_same_conv_as_torch() -> None:
    """torch's padding="same" puts the odd pad at the end, as SAME_UPPER; a 4-wide kernel makes it odd."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((4, 3, 4, 4)).astype(np.float32) * 0.2
    nodes = [helper.make_node("Conv", ["x", "W"], ["y"], auto_pad="SAME_UPPER", dilations=[2, 2]),
             helper.make_node("Mul", ["y", "y"], ["y2"]),
             helper.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0)]
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, "H", "W"])
    loss_info = helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])
    g = helper.make_graph(nodes, "g", [x_info], [loss_info], [numpy_helper.from_array(w0, "W")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    sess = onnxtrain.TrainingSession(model.SerializeToString(), params("SGDOptimizer"),
                                     backend_options("onnxruntime"))
    wt = torch.tensor(w0, requires_grad=True)
    opt = torch.optim.SGD([wt], lr=1e-3)
    for size in ((7, 6), (5, 9)):
        x = rng.standard_normal((2, 3, *size)).astype(np.float32)
        loss = sess.run(["loss"], {"x": x, "Learning_Rate": np.array([1e-3], np.float32)})[0]
        opt.zero_grad()
        ref = torch.nn.functional.conv2d(torch.tensor(x), wt, padding="same", dilation=2).pow(2).sum()
        ref.backward()
        opt.step()
        np.testing.assert_allclose(loss, ref.item(), rtol=1e-5)
        np.testing.assert_allclose(sess.get_state()["W"], wt.detach().numpy(), rtol=1e-5, atol=1e-6)


def _pool(op: str, auto_pad: str, k: int, stride: int, dil: int, hw: tuple | None) -> onnx.ModelProto:
    dims = ["H", "W"] if hw is None else list(hw)
    node = helper.make_node(op, ["x"], ["y"], kernel_shape=[k, k], auto_pad=auto_pad, dilations=[dil, dil],
                            strides=[stride, stride])
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, *dims])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, "P", "Q"])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
@pytest.mark.parametrize("case", CASES[:3])
def test_a_dilated_same_pool_keeps_its_shape_and_values_on_the_backend(op: str, auto_pad: str, case) -> None:
    # onnxruntime computes a dilated pool's SAME pads as if undilated: a 3×3 pool dilated by 2 shrank 7×8 to
    # 5×6
    from onnxtrain.engine.backends import make_plan

    torch = pytest.importorskip("torch")
    k, stride, dil, hw = case
    model = _pool(op, auto_pad, k, stride, dil, hw)
    rewritten = dilated_same_pads(model, lambda: value_types(model))
    assert rewritten is not model
    onnx.checker.check_model(rewritten, full_check=True)  # the graph handed to onnxruntime
    x = np.random.default_rng(k).standard_normal((1, 2, *(hw or (7, 8)))).astype(np.float32)
    got = make_plan(model, "onnxruntime").run({"x": x})[0]
    want = make_plan(model, "numpy").run({"x": x})[0]
    assert got.shape == want.shape == (1, 2, *(-(-n // stride) for n in x.shape[2:]))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    if op == "MaxPool":  # torch on the input padded as SAME says (the odd pad at the end for SAME_UPPER)
        total = [(-(-n // stride) - 1) * stride + (k - 1) * dil + 1 - n for n in x.shape[2:]]
        pads = [(t // 2, t - t // 2) if auto_pad == "SAME_UPPER" else (t - t // 2, t // 2) for t in total]
        xp = torch.nn.functional.pad(torch.tensor(x), [*pads[1], *pads[0]], value=-np.inf)
        want = torch.nn.functional.max_pool2d(xp, k, stride, 0, dilation=dil).numpy()
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("case, why", [((3, 2, 2, None), "sizes"), ((2, 3, 3, (10, 11)), "kernel's size")])
def test_a_dilated_same_pool_onnxruntime_cannot_run_is_refused(case: tuple, why: str) -> None:
    # a stride over unknown sizes (no pads to give), or pads as wide as the kernel (onnxruntime refuses them)
    model = _pool("MaxPool", "SAME_UPPER", *case)
    with pytest.raises(ValueError, match=f"dilated pool.*{why}.*numpy engine"):
        dilated_same_pads(model, lambda: value_types(model))
