"""Quantization-aware training: a QuantizeLinear -> DequantizeLinear pair gets the straight-through
estimator (onnxtrain/autodiff/rules/quantize.py), checked against torch's fake quantizers' autograd; the
gradient graph is standard ONNX (onnx.checker, onnx.reference and onnxruntime agree)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain.autodiff import GradientError, build_gradient_model
from onnxtrain.ir.builder import make_model
from onnxtrain.testing import run_engine

RNG = np.random.default_rng(3)
A = RNG.standard_normal((2, 4)).astype(np.float32)
W = RNG.standard_normal((2, 5)).astype(np.float32)


def _qat_model(scale: np.ndarray, zp: np.ndarray, axis: int = 1, d_scale: np.ndarray | None = None,
               q_attrs: dict | None = None) -> onnx.ModelProto:
    """loss = sum((a @ DequantizeLinear(QuantizeLinear(x))) * w) with x of shape (4, 5)."""
    inits = [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(zp, "zp"),
             numpy_helper.from_array(A, "a"), numpy_helper.from_array(W, "w")]
    s_d = "s"
    if d_scale is not None:
        inits.append(numpy_helper.from_array(d_scale, "s_d"))
        s_d = "s_d"
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], name="quant", axis=axis,
                         **(q_attrs or {})),
        helper.make_node("DequantizeLinear", ["q", s_d, "zp"], ["y"], name="dequant", axis=axis,
                         **{k: v for k, v in (q_attrs or {}).items() if k == "block_size"}),
        helper.make_node("MatMul", ["a", "y"], ["ay"]),
        helper.make_node("Mul", ["ay", "w"], ["ayw"]),
        helper.make_node("ReduceSum", ["ayw"], ["loss"], keepdims=0),
    ]
    g = helper.make_graph(nodes, "qat", [helper.make_tensor_value_info("x", T.FLOAT, [4, 5])],
                          [helper.make_tensor_value_info("loss", T.FLOAT, [])], inits)
    opset = 21 if q_attrs and "block_size" in q_attrs else 19  # onnx.reference has DequantizeLinear-19+
    return make_model(g, opset)


def _x(scale: np.ndarray, zp: np.ndarray, lo: int, hi: int, axis: int = 1) -> np.ndarray:
    """x with values inside, outside and on the edges of the range, and on .5 ties at the edges."""
    shape = [1, 1]
    shape[axis] = -1
    s = scale.reshape(shape) if scale.ndim else scale
    z = zp.astype(np.float32).reshape(shape) if zp.ndim else np.float32(zp)
    codes = np.array([[lo - 3, lo - 0.5, lo, lo + 0.5, hi - 0.5],
                      [hi, hi + 0.5, hi + 3, 0.0, 1.5],
                      [lo + 1, hi - 1, -2.5, 2.5, 7.0],
                      [lo - 40, hi + 40, lo + 0.25, hi - 0.25, 3.0]], np.float32)
    return ((codes - z) * s).astype(np.float32)


def _grads(model: onnx.ModelProto, x: np.ndarray) -> tuple[onnx.ModelProto, np.ndarray]:
    g = build_gradient_model(model, "loss", ["x"])
    onnx.checker.check_model(g, full_check=True)
    return g, run_engine(g, {"x": x})[-1]


# scales are powers of two: torch multiplies by 1/scale where ONNX divides, and then both are exact
@pytest.mark.parametrize("qdt,zp", [(np.uint8, 128), (np.int8, -3), (np.int8, 0)])
def test_per_tensor_matches_torch_fake_quantize(qdt, zp) -> None:
    torch = pytest.importorskip("torch")
    scale, zp_arr = np.asarray(0.25, np.float32), np.asarray(zp, qdt)
    info = np.iinfo(qdt)
    x = _x(scale, zp_arr, int(info.min), int(info.max))
    _, dx = _grads(_qat_model(scale, zp_arr), x)
    tx = torch.tensor(x, requires_grad=True)
    y = torch.fake_quantize_per_tensor_affine(tx, float(scale), zp, int(info.min), int(info.max))
    ((torch.from_numpy(A) @ y) * torch.from_numpy(W)).sum().backward()
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-6, atol=1e-7)
    mask = (tx.grad.numpy() != 0).mean()
    assert 0.3 < mask < 0.9  # both sides of the range are exercised


def test_per_axis_matches_torch_fake_quantize() -> None:
    torch = pytest.importorskip("torch")
    scale = np.asarray([0.5, 1.0, 2.0, 0.25, 4.0], np.float32)
    zp = np.asarray([-4, 0, 9, 100, -100], np.int8)
    x = _x(scale, zp, -128, 127, axis=1)
    _, dx = _grads(_qat_model(scale, zp, axis=1), x)
    tx = torch.tensor(x, requires_grad=True)
    y = torch.fake_quantize_per_channel_affine(tx, torch.from_numpy(scale),
                                               torch.from_numpy(zp.astype(np.int32)), 1, -128, 127)
    ((torch.from_numpy(A) @ y) * torch.from_numpy(W)).sum().backward()
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-6, atol=1e-7)


def test_per_axis_on_the_first_axis_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    scale = np.asarray([0.5, 1.0, 2.0, 0.25], np.float32)
    zp = np.asarray([10, 0, 200, 128], np.uint8)
    x = _x(scale, zp, 0, 255, axis=0)
    g, dx = _grads(_qat_model(scale, zp, axis=0), x)
    assert "Unsqueeze" in {n.op_type for n in g.graph.node}  # the scale broadcast along axis 0
    tx = torch.tensor(x, requires_grad=True)
    y = torch.fake_quantize_per_channel_affine(tx, torch.from_numpy(scale),
                                               torch.from_numpy(zp.astype(np.int32)), 0, 0, 255)
    ((torch.from_numpy(A) @ y) * torch.from_numpy(W)).sum().backward()
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-6, atol=1e-7)


def test_gradient_graph_is_portable() -> None:
    ort = pytest.importorskip("onnxruntime")
    from onnx.reference import ReferenceEvaluator

    scale, zp = np.asarray([0.5, 1.0, 2.0, 0.25, 4.0], np.float32), np.asarray([-4, 0, 9, 100, -100], np.int8)
    x = _x(scale, zp, -128, 127)
    g, dx = _grads(_qat_model(scale, zp), x)
    ref = ReferenceEvaluator(g).run(None, {"x": x})[-1]
    sess = ort.InferenceSession(g.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(dx, ref)
    np.testing.assert_array_equal(dx, sess.run(None, {"x": x})[-1])


@pytest.mark.parametrize("case", ["other_scale", "blocked"])
def test_unmatched_pairs_carry_no_gradient(case: str) -> None:
    scale, zp = np.asarray(0.5, np.float32), np.asarray(3, np.uint8)
    if case == "other_scale":
        m = _qat_model(scale, zp, d_scale=np.asarray(0.25, np.float32))
    else:
        m = _qat_model(np.full((4, 3), 0.5, np.float32), np.full((4, 3), 3, np.uint8),
                       q_attrs={"block_size": 2})
    with pytest.raises(GradientError, match="does not reach"):
        build_gradient_model(m, "loss", ["x"], zero_unreachable=False)


def _run_ort(g: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(g.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[-1]


def _torch_dx(x: np.ndarray, w: np.ndarray, scale: np.ndarray, zp: np.ndarray, lo: int, hi: int,
              axis: int | None) -> np.ndarray:
    """d/dx of sum(fake_quantize(x) * w) by torch's fake quantizers."""
    torch = pytest.importorskip("torch")
    tx = torch.tensor(x.astype(np.float32), requires_grad=True)
    if axis is None:
        y = torch.fake_quantize_per_tensor_affine(tx, float(scale), int(zp), lo, hi)
    else:
        y = torch.fake_quantize_per_channel_affine(tx, torch.from_numpy(scale.astype(np.float32)),
                                                   torch.from_numpy(zp.astype(np.int32)), axis, lo, hi)
    (y * torch.from_numpy(w.astype(np.float32))).sum().backward()
    return tx.grad.numpy()


def _pair_model(x_type: int, scale: np.ndarray, zp: np.ndarray, w: np.ndarray, opset: int,
                q_attrs: dict | None = None, d_attrs: dict | None = None) -> onnx.ModelProto:
    """loss = sum(DequantizeLinear(QuantizeLinear(x)) * w), the product in x's type."""
    y_type = (d_attrs or {}).get("output_dtype") or helper.np_dtype_to_tensor_dtype(scale.dtype)
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], **(q_attrs or {})),
             helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"], **(d_attrs or {}))]
    y = "y"
    if y_type != x_type:
        nodes.append(helper.make_node("Cast", ["y"], ["yc"], to=x_type))
        y = "yc"
    nodes += [helper.make_node("Mul", [y, "w"], ["yw"]),
              helper.make_node("ReduceSum", ["yw"], ["loss"], keepdims=0)]
    inits = [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(zp, "zp"),
             numpy_helper.from_array(w, "w")]
    g = helper.make_graph(nodes, "pair", [helper.make_tensor_value_info("x", x_type, list(w.shape))],
                          [helper.make_tensor_value_info("loss", x_type, [])], inits)
    return make_model(g, opset)


def test_int4_per_axis_gradient_runs_on_onnxruntime() -> None:
    """The 4-bit zero point is broadcast after its Cast (onnxruntime has no 4-bit Unsqueeze)."""
    from onnx.helper import tensor_dtype_to_np_dtype

    scale = np.asarray([0.5, 1.0, 2.0, 0.25], np.float32)
    zp = np.asarray([1, 0, -3, 7]).astype(tensor_dtype_to_np_dtype(T.INT4))
    x = _x(scale, zp.astype(np.int8), -8, 7, axis=0)
    w = RNG.standard_normal(x.shape).astype(np.float32)
    g = build_gradient_model(_pair_model(T.FLOAT, scale, zp, w, 21, {"axis": 0}, {"axis": 0}), "loss", ["x"])
    onnx.checker.check_model(g, full_check=True)
    want = _torch_dx(x, w, scale, zp.astype(np.int8), -8, 7, axis=0)
    np.testing.assert_array_equal(run_engine(g, {"x": x})[-1], want)
    np.testing.assert_array_equal(_run_ort(g, {"x": x}), want)


@pytest.mark.parametrize("x_type,scale_dt,y_type", [
    (T.FLOAT, np.float16, None),  # x and the scale of other types (opset 23)
    (T.FLOAT16, np.float32, None),
    (T.FLOAT, np.float32, T.FLOAT16),  # DequantizeLinear's output_dtype other than x's type
])
def test_mixed_types_gradient_has_x_type(x_type: int, scale_dt, y_type: int | None) -> None:
    """dx has x's type whatever the pair's scale and output types; every value is exact in float16."""
    xdt = helper.tensor_dtype_to_np_dtype(x_type)
    scale, zp = np.asarray(0.5, scale_dt), np.asarray(-3, np.int8)
    x = _x(scale.astype(np.float32), zp, -128, 127).astype(xdt)
    w = (RNG.integers(-64, 64, x.shape) / 8).astype(xdt)
    m = _pair_model(x_type, scale, zp, w, 23, d_attrs={"output_dtype": y_type} if y_type else None)
    g = build_gradient_model(m, "loss", ["x"])
    onnx.checker.check_model(g, full_check=True)
    dx = run_engine(g, {"x": x})[-1]
    assert dx.dtype == xdt
    want = _torch_dx(x, w, scale, zp, -128, 127, axis=None)
    np.testing.assert_array_equal(dx.astype(np.float32), want)
    np.testing.assert_array_equal(_run_ort(g, {"x": x}).astype(np.float32), want)
