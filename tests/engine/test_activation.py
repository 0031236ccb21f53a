"""Activation kernels: stability at large |x|, float16 handling, Clip variants, Hardmax semantics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from onnxtrain.engine.registry import Attrs, find_kernel


def run(op: str, *inputs, opset: int = 21, **attrs):
    from onnx import defs

    from onnxtrain.engine.registry import attribute_value

    values = {n: (attribute_value(a.default_value) if a.default_value.name else None)
              for n, a in defs.get_schema(op, opset).attributes.items()}
    values.update(attrs)
    return find_kernel(op, opset)(list(inputs), Attrs(values, op=op, opset=opset))[0]


def test_sigmoid_is_stable_and_relatively_accurate() -> None:
    x = np.array([-800.0, -50.0, -1.0, 0.0, 1.0, 50.0, 800.0])
    with np.errstate(over="raise", invalid="raise"):
        y = run("Sigmoid", x)
    want = np.array([1 / (1 + math.exp(-v)) if v > -700 else 0.0 for v in x])
    np.testing.assert_allclose(y, want, rtol=1e-15)
    assert y[1] > 0  # exp(-50)-sized values keep their relative precision
    with np.errstate(over="raise", invalid="raise"):
        y32 = run("Sigmoid", np.array([-100.0, -87.0, -20.0, 100.0], np.float32))
    assert y32.dtype == np.float32 and y32[3] == 1.0
    assert y32[0] == 0.0  # exp(100) overflows float32: the exact value, 3.7e-44, is subnormal
    np.testing.assert_allclose(y32[1:3], [1 / (1 + math.exp(87.0)), 1 / (1 + math.exp(20.0))], rtol=3e-7)


def test_softplus_and_mish_at_large_inputs() -> None:
    x = np.array([-1000.0, -30.0, 0.0, 30.0, 1000.0])
    with np.errstate(over="raise"):
        sp = run("Softplus", x)
        mish = run("Mish", x, opset=18)
    want = [0.0, math.log1p(math.exp(-30)), math.log(2), 30 + math.log1p(math.exp(-30)), 1000.0]
    np.testing.assert_allclose(sp, want, rtol=1e-15)
    np.testing.assert_allclose(mish[3:], [30.0, 1000.0])
    assert abs(mish[0]) < 1e-300


def test_float16_runs_in_float32() -> None:
    x = np.linspace(-4, 4, 33).astype(np.float16)
    for op, attrs in [("Sigmoid", {}), ("Gelu", {}), ("Gelu", {"approximate": "tanh"}), ("Softplus", {}),
                      ("Elu", {}), ("Selu", {}), ("Mish", {}), ("HardSwish", {}), ("Celu", {})]:
        y = run(op, x, **attrs)
        assert y.dtype == np.float16, op
        ref = run(op, x.astype(np.float32), **attrs).astype(np.float16)
        np.testing.assert_array_equal(y, ref, err_msg=op)


SCALAR_CASES = [("Sigmoid", 13), ("Softplus", 1), ("Softsign", 1), ("Elu", 6), ("Selu", 6), ("Celu", 12),
                ("Mish", 18), ("HardSigmoid", 6), ("HardSwish", 14)]


@pytest.mark.parametrize("op,opset", SCALAR_CASES)
def test_a_scalar_input_gives_a_scalar_as_the_array_does(op: str, opset: int) -> None:
    """Rank 0 (a numpy scalar from the formulas' first pass broke the next out= pass); the value is the
    one-element array's, and onnxruntime's within float32 rounding."""
    x = np.array(0.5, np.float32)
    y = run(op, x, opset=opset)
    assert y.shape == () and y.dtype == np.float32
    assert y == run(op, x.reshape(1), opset=opset)[0]
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node(op, ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,) = sess.run(None, {"x": x})
    np.testing.assert_allclose(y, want, rtol=2e-7)


def test_gelu_matches_the_erf_formula() -> None:
    x = np.linspace(-6, 6, 101)
    want = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x])
    # 1 + erf(x) cancels for x << 0, so the error there is absolute (as in the formula itself)
    np.testing.assert_allclose(run("Gelu", x), want, rtol=1e-14, atol=1e-15)
    with pytest.raises(ValueError, match="approximate"):
        run("Gelu", x, approximate="fast")


def test_clip_variants() -> None:
    x = np.array([-3.0, -0.5, 0.0, 0.5, 3.0], np.float32)
    np.testing.assert_array_equal(run("Clip", x, np.float32(-1), np.float32(1), opset=13),
                                  [-1, -0.5, 0, 0.5, 1])
    assert run("Clip", x, opset=13) is x
    np.testing.assert_array_equal(run("Clip", x, None, np.array(0.25, np.float32), opset=13),
                                  [-3, -0.5, 0, 0.25, 0.25])
    np.testing.assert_array_equal(run("Clip", x, np.array(2, np.float32), np.array(1, np.float32), opset=13),
                                  [1, 1, 1, 1, 1])  # min > max: everything becomes max
    y6 = run("Clip", x.astype(np.float16), opset=6, min=-1.0)
    assert y6.dtype == np.float16 and np.isfinite(y6).all()
    np.testing.assert_array_equal(y6, [-1, -0.5, 0, 0.5, 3])
    assert run("Clip", np.array(5.0, np.float32), None, np.array(1.0, np.float32), opset=13).shape == ()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_prelu_of_a_positive_x_is_x_whatever_the_slope(dtype) -> None:
    torch = pytest.importorskip("torch")
    x = np.array([[1.5, -2.0, 0.0, np.nan], [3.0, -1.0, 2.0, -0.5]], dtype)
    slope = np.array([[np.inf, np.nan, 0.5, np.inf]], dtype)  # torch: Where(X > 0, X, slope·X)
    want = torch.where(torch.tensor(x) > 0, torch.tensor(x), torch.tensor(slope) * torch.tensor(x)).numpy()
    with np.errstate(invalid="ignore"):  # 0·inf, as the plan runs its kernels
        np.testing.assert_array_equal(run("PRelu", x, slope), want)


def test_prelu_and_shrink() -> None:
    x = np.array([[-2.0, 1.0], [3.0, -4.0]], np.float32)
    np.testing.assert_array_equal(run("PRelu", x, np.array([0.5, 0.25], np.float32)), [[-1, 1], [3, -1]])
    with pytest.raises(ValueError, match="PRelu"):
        run("PRelu", x[:1], np.ones((2, 2), np.float32))
    xi = np.array([-5, -1, 0, 2, 6], np.int32)
    y = run("Shrink", xi, lambd=1.5, bias=1.0)
    assert y.dtype == np.int32
    np.testing.assert_array_equal(y, [-4, 0, 0, 1, 5])


def test_hardmax_axis_semantics() -> None:
    x = np.array([[[1.0, 3.0], [3.0, 0.0]], [[2.0, 2.0], [0.0, 1.0]]])
    # opset 13: along the axis only; the first maximum wins
    np.testing.assert_array_equal(run("Hardmax", x, opset=13, axis=1),
                                  [[[0, 1], [1, 0]], [[1, 1], [0, 0]]])
    # opsets 1-11: flatten to [prod(shape[:axis]), prod(shape[axis:])], one 1 per row
    np.testing.assert_array_equal(run("Hardmax", x, opset=11, axis=1),
                                  [[[0, 1], [0, 0]], [[1, 0], [0, 0]]])
    with pytest.raises(ValueError, match="axis"):
        run("Hardmax", x, opset=13, axis=3)
    assert run("Hardmax", np.zeros((0, 3)), opset=13).shape == (0, 3)


def test_kernels_do_not_mutate_inputs() -> None:
    rng = np.random.default_rng(0)
    for op in ("Relu", "Sigmoid", "Tanh", "Gelu", "LeakyRelu", "Elu", "Selu", "Celu", "HardSigmoid",
               "HardSwish", "Softplus", "Softsign", "Mish", "ThresholdedRelu", "Shrink", "Hardmax"):
        x = rng.uniform(-3, 3, (4, 5))
        keep = x.copy()
        run(op, x)
        np.testing.assert_array_equal(x, keep, err_msg=op)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int8, np.uint8, np.int32, np.int64])
def test_clamps_give_torchs_bits(dtype) -> None:
    """ReLU, clamps with one or two bounds and min(x, 0), NaN, infinities and -0.0 included, against torch."""
    torch = pytest.importorskip("torch")
    from onnxtrain.engine.kernels.clamp import clamp, negative_part, relu_into

    rng = np.random.default_rng(11)
    x = (rng.standard_normal((37, 53)) * 50).astype(dtype)
    if np.dtype(dtype).kind == "f":
        x.flat[:5] = [np.nan, -0.0, 0.0, np.inf, -np.inf]
    t = torch.from_numpy(x)
    lo, hi = dtype(3), dtype(60)
    cases = [
        (relu_into(x), torch.relu(t)),
        (clamp(x, lo, hi), torch.clamp(t, 3, 60)),
        (clamp(x, lo), torch.clamp(t, min=3)),
        (clamp(x, None, hi), torch.clamp(t, max=60)),
        (clamp(x, hi, lo), torch.clamp(t, 60, 3)),  # crossed bounds: every value is the upper one
        (negative_part(x), torch.clamp(t, max=0)),
    ]
    for k, (got, want) in enumerate(cases):
        want = want.numpy()
        assert got.dtype == want.dtype and got.shape == want.shape, k
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=str(k))
    out = np.empty_like(x)
    assert relu_into(x[::2, ::3], out=out[::2, ::3]) is not None
    strided = np.ascontiguousarray(out[::2, ::3])
    np.testing.assert_array_equal(strided.view(np.uint8), torch.relu(t[::2, ::3]).numpy().view(np.uint8))


def test_clamps_of_bfloat16_keep_maximum_and_minimum() -> None:
    """bfloat16 (ml_dtypes), which numpy's clip has no loop for: the exact float32 results, rounded back."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from onnxtrain.engine.kernels.clamp import clamp, negative_part, relu_into

    bf16 = np.dtype(ml_dtypes.bfloat16)
    x = (np.random.default_rng(3).standard_normal(200) * 8).astype(bf16)
    x32 = x.astype(np.float32)
    lo, hi = bf16.type(-2), bf16.type(5)
    for got, want in ((relu_into(x), np.maximum(x32, 0)), (clamp(x, lo, hi), np.clip(x32, -2, 5)),
                      (clamp(x, None, hi), np.minimum(x32, 5)), (negative_part(x), np.minimum(x32, 0))):
        assert got.dtype == bf16
        np.testing.assert_array_equal(got.astype(np.float32), want)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("op, attrs", [("HardSigmoid", {}), ("HardSigmoid", {"alpha": -0.3, "beta": 0.0}),
                                       ("HardSigmoid", {"alpha": 0.25, "beta": -0.0}),
                                       ("HardSigmoid", {"alpha": 0.0, "beta": 1.5}), ("HardSwish", {})])
def test_hard_sigmoid_and_swish_clamp_by_clip_with_the_two_sided_bits(dtype, op, attrs) -> None:
    """The clamp to [0, 1] runs as numpy's clip ufunc: the bits of max(., 0) then min(., 1) over random
    values, both zeros, infinities, NaN and the clamp's edges (an exact zero sum comes out +0.0 either
    way), and onnx.reference's values."""
    import warnings

    warnings.filterwarnings("ignore", "invalid value", RuntimeWarning)  # HardSwish of ±inf: 0·inf
    from onnx import helper
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(5000) * 4, [0.0, -0.0, np.inf, -np.inf, np.nan, 2.5, -2.5, 3.0,
                                                        -3.0, 1e-40, -1e-40, 6.0, -6.0]]).astype(dtype)
    y = run(op, x, **attrs)
    # the two-sided formula, in float32 for float16 as the kernel computes
    x32 = x.astype(np.float32) if dtype == np.float16 else x
    alpha = attrs.get("alpha", float(np.float32(0.2)))  # (a default is the schema's float32 value)
    if op == "HardSigmoid":
        t = x32 * alpha
        t += attrs.get("beta", 0.5)
    else:
        t = x32 * float(np.float32(1 / 6))
        t += 0.5
    with np.errstate(invalid="ignore"):
        t = np.minimum(np.maximum(t, 0), 1)
        if op == "HardSwish":
            t *= x32
    want = t.astype(dtype)
    assert y.dtype == want.dtype
    np.testing.assert_array_equal(y.view(np.uint8), want.view(np.uint8))
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    io = [helper.make_tensor_value_info(n, elem, None) for n in ("x", "y")]
    node = helper.make_node(op, ["x"], ["y"], **attrs)
    m = helper.make_model(helper.make_graph([node], "g", io[:1], io[1:]),
                          opset_imports=[helper.make_opsetid("", 17)])
    with np.errstate(all="ignore"):
        ref = ReferenceEvaluator(m).run(None, {"x": x})[0]
    np.testing.assert_allclose(y.astype(np.float64), ref.astype(np.float64), rtol=1e-3 if dtype == np.float16
                               else 1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_thresholded_relu_selects_by_bits_as_np_where(dtype) -> None:
    rng = np.random.default_rng(4)
    specials = [0.0, -0.0, 0.5, np.inf, -np.inf, np.nan]
    x = np.concatenate([rng.standard_normal(70_000) * 2, specials]).astype(dtype)
    y = run("ThresholdedRelu", x, alpha=0.5)
    with np.errstate(invalid="ignore"):
        want = np.where(x > 0.5, x, dtype(0))
    assert y.dtype == x.dtype
    np.testing.assert_array_equal(y.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32])
@pytest.mark.parametrize("lambd, bias", [(0.5, 0.0), (1.5, 0.25), (0.0, 0.0)])
def test_shrink_by_bit_selects_has_onnx_references_bits(dtype, lambd, bias) -> None:
    from onnx import helper
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(5)
    x = rng.standard_normal(50_000) * 3
    if np.dtype(dtype).kind == "f":
        x = np.concatenate([x, [0.0, -0.0, lambd, -lambd, np.inf, -np.inf, np.nan]])
    x = x.astype(dtype)
    y = run("Shrink", x, lambd=lambd, bias=bias)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    io = [helper.make_tensor_value_info(n, elem, None) for n in ("x", "y")]
    node = helper.make_node("Shrink", ["x"], ["y"], lambd=lambd, bias=bias)
    m = helper.make_model(helper.make_graph([node], "g", io[:1], io[1:]),
                          opset_imports=[helper.make_opsetid("", 17)])
    with np.errstate(all="ignore"):
        want = ReferenceEvaluator(m).run(None, {"x": x})[0]
    assert y.dtype == want.dtype == x.dtype
    np.testing.assert_array_equal(y.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("alpha", [0.0, -0.3, 0.01, 1.0, 1.5])
def test_leaky_relu_has_onnxruntimes_bits_at_inf_and_signed_zeros(dtype, alpha) -> None:
    """Y = X where X >= 0, alpha·X where X < 0 (the spec; onnxruntime's kernel): +inf stays +inf with
    alpha = 0 (max(x, 0·x) gave NaN there) and −0.0 stays −0.0 with a negative alpha."""
    ort = pytest.importorskip("onnxruntime")
    from onnx import helper

    from onnxtrain.inference import InferenceSession

    x = np.array([np.inf, -np.inf, -0.0, 0.0, 2.5, -3.0, 1e-30, -1e-30, 65504.0], dtype)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    io = [helper.make_tensor_value_info(n, elem, [9]) for n in ("x", "y")]
    node = helper.make_node("LeakyRelu", ["x"], ["y"], alpha=alpha)
    model = helper.make_model(helper.make_graph([node], "g", io[:1], io[1:]),
                              opset_imports=[helper.make_opsetid("", 16)]).SerializeToString()
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = InferenceSession(model).run(None, {"x": x})[0]
    assert got.dtype == want.dtype == x.dtype
    assert np.array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got, want)
    # the signs of zeros too, but for alpha·x at a negative x: onnxruntime's float16 and float64 kernels
    # give +0.0 for 0·(−3), its float32 one (and the spec's product) −0.0
    kept = ~(x < 0)
    np.testing.assert_array_equal(np.signbit(got[kept]), np.signbit(want[kept]))


@pytest.mark.parametrize("lambd, bias", [(0.3, 0.1), (0.30001, 0.123456), (0.5, 0.0001)])
def test_shrink_of_float16_compares_and_adds_with_float32_attributes(lambd, bias) -> None:
    """lambd and bias are float32 attributes: float16 X is compared and shifted in float32 and rounded once,
    as onnxruntime and onnx.reference do (numpy rounded both to float16 first: X = -0.30005 against lambd 0.3
    shrank to 0, not to -0.2)."""
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    from onnxtrain.inference import InferenceSession

    x = (np.arange(-2000, 2000, dtype=np.float64) * 0.0003).astype(np.float16)
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT16, [x.size]) for n in ("x", "y")]
    node = helper.make_node("Shrink", ["x"], ["y"], lambd=lambd, bias=bias)
    model = helper.make_model(helper.make_graph([node], "g", io[:1], io[1:]),
                              opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = InferenceSession(model).run(None, {"x": x})[0]
    assert got.dtype == want.dtype == np.float16
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
