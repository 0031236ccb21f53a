"""Gradients through float8/float4 values (torch's fake cast ``W.to(float8).to(float32)``): straight through
each Cast, dY rounded through the low type as torch rounds it, checked against torch's autograd, onnxruntime
and onnx.reference; what ONNX cannot express on those types (a sum of two gradients, a Pad's) is an error
naming the node and the type, and a weight cut off by an integer value names the node that cut it."""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import onnx  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from onnx import TensorProto as TP  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402

from onnxtrain import GradientGraphBuilder  # noqa: E402
from onnxtrain.autodiff import build_gradient_model  # noqa: E402
from onnxtrain.autodiff.builder import GradientError  # noqa: E402
from onnxtrain.testing import run_engine  # noqa: E402

W = np.array([[0.1234, 3.3, -1.5], [0.77, 2.0, 40.0]], np.float32)
X = np.array([[1.0, -2.0]], np.float32)
# dWq[i, j] = X[0, i]·C[j]: in range, rounded, negative, zero, and beyond each float8 type's largest value
C = np.array([0.1234, 300.0, 0.0], np.float32)
C_BIG = np.array([7.77, 1e6, -0.0039], np.float32)

# (ONNX type, torch dtype, opset): the first opset with Reshape/Transpose of the type
TORCH_TYPES = [
    ("FLOAT8E4M3FN", torch.float8_e4m3fn, 21),
    ("FLOAT8E5M2", torch.float8_e5m2, 21),
    ("FLOAT8E4M3FNUZ", torch.float8_e4m3fnuz, 21),
    ("FLOAT8E5M2FNUZ", torch.float8_e5m2fnuz, 21),
    ("FLOAT8E8M0", torch.float8_e8m0fnu, 24),
]


def _model(nodes: list[onnx.NodeProto], opset: int, c: np.ndarray,
           inits: tuple[onnx.TensorProto, ...] = ()) -> onnx.ModelProto:
    """loss = ReduceSum(MatMul(x, <nodes' output 'Wq'>) · c), W an initializer."""
    nodes = [*nodes, helper.make_node("MatMul", ["x", "Wq"], ["y"], name="matmul"),
             helper.make_node("Mul", ["y", "c"], ["yc"], name="scale"),
             helper.make_node("ReduceSum", ["yc"], ["loss"], keepdims=0, name="total")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, [1, 2])],
                          [helper.make_tensor_value_info("loss", TP.FLOAT, [])],
                          [numpy_helper.from_array(W, "W"), numpy_helper.from_array(c, "c"), *inits])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 11 if opset >= 24 else 10
    onnx.checker.check_model(m, full_check=True)
    return m


def _fake_cast(to: int, opset: int, c: np.ndarray) -> onnx.ModelProto:
    return _model([helper.make_node("Cast", ["W"], ["W8"], to=to, name="to_low"),
                   helper.make_node("Cast", ["W8"], ["Wq"], to=TP.FLOAT, name="to_float")], opset, c)


def _grad(m: onnx.ModelProto) -> tuple[onnx.ModelProto, np.ndarray]:
    gm = build_gradient_model(m, "loss", ["W"])
    onnx.checker.check_model(gm, full_check=True)
    return gm, np.asarray(run_engine(gm, {"x": X})[-1])


def _torch_grad(dtype: torch.dtype, c: np.ndarray) -> np.ndarray:
    w = torch.tensor(W, requires_grad=True)
    ((torch.tensor(X) @ w.to(dtype).to(torch.float32)) * torch.tensor(c)).sum().backward()
    return w.grad.numpy()


def _ort_grad(gm: onnx.ModelProto) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(gm.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["W_grad"], {"x": X})[0]


@pytest.mark.parametrize("c", [C, C_BIG], ids=["in_range", "overflow"])
@pytest.mark.parametrize("name, dtype, opset", TORCH_TYPES, ids=[t[0] for t in TORCH_TYPES])
def test_fake_cast_gradient_matches_torch_and_onnxruntime(name: str, dtype: torch.dtype, opset: int,
                                                          c: np.ndarray) -> None:
    gm, got = _grad(_fake_cast(getattr(TP, name), opset, c))
    want = _torch_grad(dtype, c)
    assert np.any(want != 0)
    np.testing.assert_array_equal(got, want)  # (NaN where torch overflows to NaN)
    np.testing.assert_array_equal(_ort_grad(gm), want)


def test_float4_fake_cast_gradient_matches_ml_dtypes_rounding() -> None:
    """torch has no unpacked float4: the oracle rounds X^T·c through ml_dtypes' float4_e2m1fn, and
    onnx.reference runs the gradient graph (onnxruntime 1.32 has no float4 Cast)."""
    from onnx.reference import ReferenceEvaluator

    for c in (C, C_BIG):
        gm, got = _grad(_fake_cast(TP.FLOAT4E2M1, 23, c))
        want = (X.T * c).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(ReferenceEvaluator(gm).run(["W_grad"], {"x": X})[0], want)


def test_gradient_crosses_reshapes_of_a_float8_value_and_the_legacy_builder() -> None:
    """Transpose and Reshape of the float8 value (ONNX defines them on float8 from opset 21), through the
    onnxruntime-compatible GradientGraphBuilder too."""
    shape = numpy_helper.from_array(np.array([2, 3], np.int64), "shape")
    nodes = [helper.make_node("Cast", ["W"], ["W8"], to=TP.FLOAT8E4M3FN, name="to_low"),
             helper.make_node("Transpose", ["W8"], ["T8"], perm=[1, 0], name="transpose"),
             helper.make_node("Reshape", ["T8"], ["R8"], name="reshape"),
             helper.make_node("Cast", ["R8"], ["Wq"], to=TP.FLOAT, name="to_float")]
    nodes[2].input.append("shape")
    m = _model(nodes, 21, C, (shape,))
    w = torch.tensor(W, requires_grad=True)
    wq = w.to(torch.float8_e4m3fn).t().reshape(2, 3).to(torch.float32)
    ((torch.tensor(X) @ wq) * torch.tensor(C)).sum().backward()
    gm, got = _grad(m)
    np.testing.assert_array_equal(got, w.grad.numpy())
    np.testing.assert_array_equal(_ort_grad(gm), w.grad.numpy())
    b = GradientGraphBuilder(m.SerializeToString(), {"loss"}, {"W"}, "loss")
    b.build()
    np.testing.assert_array_equal(run_engine(b.get_model(), {"x": X})[-1], w.grad.numpy())


def test_a_float8_value_read_twice_is_an_error_as_in_torch() -> None:
    """Its gradient would be a sum of float8 tensors: no ONNX op adds them, and torch's autograd fails."""
    m = _model([helper.make_node("Cast", ["W"], ["W8"], to=TP.FLOAT8E4M3FN, name="to_low"),
                helper.make_node("Cast", ["W8"], ["A"], to=TP.FLOAT, name="first"),
                helper.make_node("Cast", ["W8"], ["B"], to=TP.FLOAT16, name="second"),
                helper.make_node("Cast", ["B"], ["B32"], to=TP.FLOAT, name="widen"),
                helper.make_node("Add", ["A", "B32"], ["Wq"], name="add")], 21, C)
    w = torch.tensor(W, requires_grad=True)
    q = w.to(torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError):
        (q.to(torch.float32) + q.to(torch.float16).to(torch.float32)).sum().backward()
    with pytest.raises(GradientError, match="'W8', of type float8e4m3fn, is read by several nodes "
                                            "\\('first' \\(Cast\\), 'second' \\(Cast\\)\\)"):
        build_gradient_model(m, "loss", ["W"])


def test_an_op_whose_gradient_onnx_cannot_compute_in_float8_is_named() -> None:
    """Pad takes float8 from opset 21; its gradient (a Slice) does not, rather than a silent zero."""
    pads = numpy_helper.from_array(np.array([0, 0, 1, 0], np.int64), "pads")
    nodes = [helper.make_node("Cast", ["W"], ["W8"], to=TP.FLOAT8E5M2, name="to_low"),
             helper.make_node("Pad", ["W8", "pads"], ["P8"], name="pad"),
             helper.make_node("Cast", ["P8"], ["P"], to=TP.FLOAT, name="to_float"),
             helper.make_node("Slice", ["P", "starts", "ends"], ["Wq"], name="crop")]
    inits = (pads, numpy_helper.from_array(np.array([0], np.int64), "starts"),
             numpy_helper.from_array(np.array([2], np.int64), "ends"))
    m = _model(nodes, 21, C, inits)
    with pytest.raises(GradientError, match="node 'pad' \\(Pad\\): .*'P8', of type float8e5m2"):
        build_gradient_model(m, "loss", ["W"])


def test_a_dequantize_of_a_float8_weight_is_an_error_not_a_zero() -> None:
    scale = numpy_helper.from_array(np.array(0.5, np.float32), "s")
    m = _model([helper.make_node("Cast", ["W"], ["W8"], to=TP.FLOAT8E4M3FN, name="to_low"),
                helper.make_node("DequantizeLinear", ["W8", "s"], ["Wq"], name="dq")], 21, C, (scale,))
    with pytest.raises(GradientError, match="input 0 \\('W8'\\) of node 'dq' \\(DequantizeLinear\\)"):
        build_gradient_model(m, "loss", ["W"])


def test_an_integer_value_between_the_weight_and_the_loss_is_named() -> None:
    m = _model([helper.make_node("Cast", ["W"], ["Wi"], to=TP.INT64, name="to_int"),
                helper.make_node("Cast", ["Wi"], ["Wq"], to=TP.FLOAT, name="to_float")], 21, C)
    why = ("'W' does not reach 'loss' through a differentiable path \\(it passes through "
           "'to_int' \\(Cast\\), whose output 'Wi' is int64, not a float\\)")
    with pytest.raises(GradientError, match=why):
        build_gradient_model(m, "loss", ["W"], zero_unreachable=False)
    with pytest.raises(GradientError, match=why):
        GradientGraphBuilder(m.SerializeToString(), {"loss"}, {"W"}, "loss").build()
