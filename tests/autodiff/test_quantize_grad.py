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


def test_unmatched_pair_is_an_error_naming_its_nodes() -> None:
    """Different scales: no straight-through estimator applies; a gradient that must cross the pair is an
    error naming it (not a silent zero), also with zero_unreachable (the default)."""
    scale, zp = np.asarray(0.5, np.float32), np.asarray(3, np.uint8)
    m = _qat_model(scale, zp, d_scale=np.asarray(0.25, np.float32))
    for zero_unreachable in (True, False):
        with pytest.raises(GradientError, match=r"QuantizeLinear 'quant' -> DequantizeLinear 'dequant' "
                                                r"\(the two read different scales\).*'x'"):
            build_gradient_model(m, "loss", ["x"], zero_unreachable=zero_unreachable)
    # a value not behind the pair still gets its gradient
    g = build_gradient_model(m, "loss", ["a"])
    x = _x(scale, zp, 0, 255)
    y = (np.clip(np.round(x / 0.5) + 3, 0, 255) - 3) * 0.25
    np.testing.assert_allclose(run_engine(g, {"x": x})[-1], W @ y.T, rtol=1e-6)


def _between_model(op: str, q_type: int, zp: int, opset: int = 19) -> onnx.ModelProto:
    """loss = sum(DequantizeLinear(op(QuantizeLinear(x))) * w), x of shape (4, 5), scale 0.25."""
    dt = helper.tensor_dtype_to_np_dtype(q_type)
    w = np.random.default_rng(5).standard_normal((4, 5)).astype(np.float32)
    inits = [numpy_helper.from_array(np.asarray(0.25, np.float32), "s"), numpy_helper.from_array(w, "w"),
             numpy_helper.from_array(np.asarray(zp, dt), "zp")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], name="quant")]
    if op == "Relu":
        nodes.append(helper.make_node("Relu", ["q"], ["qc"], name="between"))
    elif op == "Identity+Clip":
        nodes.append(helper.make_node("Identity", ["q"], ["qi"], name="copy"))
        nodes.append(helper.make_node("Clip", ["qi", "lo", "hi"], ["qc"], name="between"))
    else:  # Clip, with the bounds as graph inputs when "Clip(fed)"
        nodes.append(helper.make_node("Clip", ["q", "lo", "hi"], ["qc"], name="between"))
    nodes += [helper.make_node("DequantizeLinear", ["qc", "s", "zp"], ["y"], name="dequant"),
              helper.make_node("Mul", ["y", "w"], ["yw"]),
              helper.make_node("ReduceSum", ["yw"], ["loss"], keepdims=0)]
    inputs = [helper.make_tensor_value_info("x", T.FLOAT, [4, 5])]
    return make_model(helper.make_graph(nodes, "between", inputs,
                                        [helper.make_tensor_value_info("loss", T.FLOAT, [])], inits), opset)


def _with_bounds(m: onnx.ModelProto, lo: int, hi: int, q_type: int, fed: bool = False) -> onnx.ModelProto:
    dt = helper.tensor_dtype_to_np_dtype(q_type)
    if fed:
        m.graph.input.extend([helper.make_tensor_value_info(n, q_type, []) for n in ("lo", "hi")])
    else:
        m.graph.initializer.extend(numpy_helper.from_array(np.asarray(v, dt), n)
                                   for n, v in (("lo", lo), ("hi", hi)))
    return m


@pytest.mark.parametrize("q_type,zp,lo,hi,between", [
    (T.UINT8, 10, 0, 127, "Clip"),  # torch's 7-bit fake quantizer, as both exporters write it
    (T.INT8, 0, -64, 63, "Clip"),
    (T.INT8, -3, -100, 127, "Identity+Clip"),
    (T.UINT8, 200, 100, 255, "Clip"),
])
def test_integer_clip_between_narrows_the_range_as_torch(q_type, zp, lo, hi, between) -> None:
    m = _with_bounds(_between_model(between, q_type, zp), lo, hi, q_type)
    scale = np.asarray(0.25, np.float32)
    x = _x(scale, np.asarray(zp), lo, hi)
    g = build_gradient_model(m, "loss", ["x"])
    onnx.checker.check_model(g, full_check=True)
    w = numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == "w"))
    want = _torch_dx(x, w, scale, np.asarray(zp), lo, hi, axis=None)
    assert 0.3 < (want != 0).mean() < 0.9  # both sides of the clipped range, and its edges, are exercised
    np.testing.assert_array_equal(run_engine(g, {"x": x})[-1], want)
    np.testing.assert_array_equal(_run_ort(g, {"x": x}), want)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_torch_7bit_fake_quantize_export(dynamo: bool) -> None:
    """torch.fake_quantize_per_tensor_affine(quant_min=0, quant_max=127), exported by TorchScript as
    QuantizeLinear(uint8) -> Clip(0, 127) -> DequantizeLinear; torch's dynamo exporter (optimize=False)
    writes the Clip's max as a Cast of a Constant, which was refused as a bound that is not constant."""
    import io
    import warnings

    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 8, generator=gen) * 2, torch.randn(3, 8, generator=gen)

    class M(torch.nn.Module):
        def forward(self, x):
            return (torch.fake_quantize_per_tensor_affine(x, 0.03, 10, 0, 127) * w).sum()

    b = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            m = torch.onnx.export(M(), (x,), dynamo=True, optimize=False, opset_version=18, input_names=["x"],
                                  output_names=["loss"], verbose=False).model_proto
        else:
            torch.onnx.export(M(), (x,), b, dynamo=False, opset_version=17, input_names=["x"],
                              output_names=["loss"])
            m = onnx.load_from_string(b.getvalue())
    ops = [n.op_type for n in m.graph.node if n.op_type not in ("Constant", "Cast")]
    assert ops[:3] == ["QuantizeLinear", "Clip", "DequantizeLinear"]
    clip = next(n for n in m.graph.node if n.op_type == "Clip")
    assert dynamo == any(n.op_type == "Cast" and clip.input[2] in n.output for n in m.graph.node)
    xx = x.clone().requires_grad_(True)
    M()(xx).backward()
    g = build_gradient_model(m, "loss", ["x"], zero_unreachable=False)
    onnx.checker.check_model(g, full_check=True)
    dx = run_engine(g, {"x": x.numpy()})[-1]
    assert 0.3 < (dx != 0).mean() < 0.9
    np.testing.assert_array_equal(dx, xx.grad.numpy())


@pytest.mark.parametrize("between", ["Relu", "Clip(fed)"])
def test_other_integer_ops_between_are_an_error(between: str) -> None:
    """A Relu, or a Clip whose bounds are not constants, between the pair: an error naming the nodes."""
    m = _between_model("Relu" if between == "Relu" else "Clip", T.INT8, 0)
    if between != "Relu":
        m = _with_bounds(m, 0, 0, T.INT8, fed=True)
    op = "Relu" if between == "Relu" else "Clip"
    with pytest.raises(GradientError, match=rf"QuantizeLinear 'quant' -> {op} 'between' -> DequantizeLinear "
                                            rf"'dequant' \({op} node 'between' lies between them\)"):
        build_gradient_model(m, "loss", ["x"])


def test_dynamic_quantize_linear_pair_is_an_error() -> None:
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "zp"], name="dq8"),
             helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"], name="dequant"),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    m = make_model(helper.make_graph(nodes, "dyn", [helper.make_tensor_value_info("x", T.FLOAT, [4, 5])],
                                     [helper.make_tensor_value_info("loss", T.FLOAT, [])]), 19)
    with pytest.raises(GradientError, match="DynamicQuantizeLinear 'dq8' -> DequantizeLinear 'dequant'"):
        build_gradient_model(m, "loss", ["x"])


def _torch_blocked_dx(x: np.ndarray, w: np.ndarray, scale: np.ndarray, zp: np.ndarray, axis: int,
                      block: int) -> np.ndarray:
    """The blocked fake quantizer as torch's per-channel one: each block of x along ``axis`` one channel."""
    torch = pytest.importorskip("torch")
    n, nb = x.shape[axis], scale.shape[axis]
    xt = torch.tensor(np.moveaxis(x, axis, -1).copy(), requires_grad=True)
    lead = xt.shape[:-1]
    padded = torch.nn.functional.pad(xt, (0, nb * block - n)).reshape(-1, block)
    s = torch.from_numpy(np.moveaxis(scale, axis, -1).reshape(-1).copy())
    z = torch.from_numpy(np.moveaxis(zp, axis, -1).reshape(-1).astype(np.int32))
    info = np.iinfo(zp.dtype)
    y = torch.fake_quantize_per_channel_affine(padded, s, z, 0, int(info.min), int(info.max))
    y = y.reshape(*lead, nb * block)[..., :n]
    (y * torch.from_numpy(np.moveaxis(w, axis, -1).copy())).sum().backward()
    return np.moveaxis(xt.grad.numpy(), -1, axis)


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("qdt", [np.uint8, np.int8])
def test_blocked_matches_torch_per_block_fake_quantize(axis: int, qdt) -> None:
    """block_size 2 along an axis of 5 (the last block short) or of 4; a scale and zero point per block."""
    block = 2
    x_shape = (4, 5)
    nb = -(-x_shape[axis] // block)
    s_shape = [4, 5]
    s_shape[axis] = nb
    rng = np.random.default_rng(7)
    scale = (2.0 ** rng.integers(-3, 2, s_shape)).astype(np.float32)
    info = np.iinfo(qdt)
    zp = rng.integers(int(info.min) + 20, int(info.max) - 20, s_shape).astype(qdt)
    rep = lambda a: np.take(np.repeat(a, block, axis=axis), range(x_shape[axis]), axis=axis)  # noqa: E731
    codes = rng.integers(int(info.min) - 30, int(info.max) + 30, x_shape).astype(np.float32)
    codes[0, :2] = [info.min, info.max]
    codes[1, :2] = [info.min - 0.5, info.max + 0.5]  # ties at the edges round to even
    x = ((codes - rep(zp).astype(np.float32)) * rep(scale)).astype(np.float32)
    w = rng.standard_normal(x_shape).astype(np.float32)
    attrs = {"axis": axis, "block_size": block}
    g = build_gradient_model(_pair_model(T.FLOAT, scale, zp, w, 21, attrs, attrs), "loss", ["x"])
    onnx.checker.check_model(g, full_check=True)
    want = _torch_blocked_dx(x, w, scale, zp, axis, block)
    assert 0.3 < (want != 0).mean() < 0.95
    np.testing.assert_array_equal(run_engine(g, {"x": x})[-1], want)
    np.testing.assert_array_equal(_run_ort(g, {"x": x}), want)


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


@pytest.mark.parametrize("opset", [13, 19, 21])
@pytest.mark.parametrize("scale_from", ["initializer", "Constant", "Cast(Constant)"])
def test_fake_quantizer_trains_under_mixed_precision(opset: int, scale_from: str) -> None:
    """A QuantizeLinear -> DequantizeLinear pair reading one scale, under the legacy session's float16 mixed
    precision: at opset 19+ the rewrite gave the Quantize a float16 copy of the scale and left the Dequantize
    on the float32 one (or the other way round for an initializer scale), and the pair was refused as two
    scales. Both run in float32 now; the step's update is torch's straight-through one within float16
    rounding (the MatMul runs in float16), and the same for every form of the scale and opset."""
    from onnxtrain import TrainingParameters, TrainingSession

    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 3)).astype(np.float32)
    x = (rng.standard_normal((4, 6)) * 3).astype(np.float32)
    def constant(name: str, v: np.ndarray) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(v))

    scale = {"initializer": [], "Constant": [constant("s", np.float32(0.1))],
             "Cast(Constant)": [constant("s64", np.float64(0.1)),
                                helper.make_node("Cast", ["s64"], ["s"], to=T.FLOAT)]}[scale_from]
    nodes = [*scale, helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("QuantizeLinear", ["h", "s", "zp"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["hq"]),
             helper.make_node("Mul", ["hq", "hq"], ["h2"]),
             helper.make_node("ReduceSum", ["h2"], ["loss"], keepdims=0)]
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.uint8(128), "zp")]
    if scale_from == "initializer":
        inits.append(numpy_helper.from_array(np.float32(0.1), "s"))
    g = helper.make_graph(nodes, "qat", [helper.make_tensor_value_info("x", T.FLOAT, [4, 6])],
                          [helper.make_tensor_value_info("loss", T.FLOAT, [])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    p = TrainingParameters()
    p.loss_output_name, p.training_optimizer_name = "loss", "SGDOptimizer"
    p.weights_to_train, p.use_mixed_precision = {"W"}, True
    sess = TrainingSession(model.SerializeToString(), p)
    sess.run(["loss"], {"x": x, "Learning_Rate": np.array([1.0], np.float32),
                        sess.loss_scale_input_name: np.array([1.0], np.float32)})
    got = w - sess.get_state()["W"]
    tw = torch.tensor(w, requires_grad=True)
    hq = torch.fake_quantize_per_tensor_affine(torch.tensor(x) @ tw, 0.1, 128, 0, 255)
    (hq * hq).sum().backward()
    want = tw.grad.numpy()
    assert np.abs(want).max() > 10
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())
