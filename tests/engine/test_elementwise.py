"""Elementwise kernels: accuracy of Erf and the ONNX-specific integer, Pow, Mod, Cast and BitCast rules."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxtrain.engine.kernels.elementwise import cast_to, erf, select
from onnxtrain.engine.registry import Attrs, find_kernel


def run(op: str, *inputs, opset: int = 21, **attrs):
    fn = find_kernel(op, opset)
    assert fn is not None, op
    return fn(list(inputs), Attrs(attrs, op=op, opset=opset))[0]


def _ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    ulp = np.spacing(np.abs(want).astype(got.dtype)).astype(np.float64)
    return np.abs(got.astype(np.float64) - want) / ulp


def test_erf_float64_within_a_few_ulp() -> None:
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.uniform(-7, 7, 4000), rng.normal(0, 1e-3, 500), np.linspace(-6.5, 6.5, 1301),
                        [0.0, 1e-300, 5e-324, 0.5, 5.75, 6.0]])
    want = np.array([math.erf(v) for v in x])
    got = erf(x)
    assert got.dtype == np.float64
    ok = want != 0
    assert _ulps(got[ok], want[ok]).max() <= 4  # math.erf itself is within 1 ulp
    assert np.array_equal(got[~ok], want[~ok])


def test_erf_float32_and_half_types() -> None:
    rng = np.random.default_rng(2)
    x = rng.uniform(-5, 5, 3000).astype(np.float32)
    want = np.array([math.erf(v) for v in x.astype(np.float64)])
    got = erf(x)
    assert got.dtype == np.float32
    assert _ulps(got[want != 0], want[want != 0]).max() <= 1.5
    h = erf(x.astype(np.float16))
    assert h.dtype == np.float16
    np.testing.assert_allclose(h.astype(np.float64), want, atol=1e-3)
    bf = helper.tensor_dtype_to_np_dtype(TensorProto.BFLOAT16)
    assert erf(x.astype(bf)).dtype == bf


def test_erf_float32_dense_and_slot_edges() -> None:
    """The float32 table, both signs: a dense sweep of [-5, 5] (evenly in value and in bit pattern), both
    sides of every slot edge up to 4 (every 2**15-th pattern, so every power of two and subnormals too),
    the clip at 4, and several blocks. Max error over all 2**32 inputs is 1.25 ulp (tools/fit_erf32.py)."""
    edges = np.arange(0, int(np.float32(4).view(np.uint32)) + 1, 1 << 15, dtype=np.int64)
    bits = np.concatenate([edges, edges + 1, edges[1:] - 1,
                           np.arange(0, int(np.float32(5).view(np.uint32)), 1009, dtype=np.int64)])
    pos = bits.astype(np.uint32).view(np.float32)
    pos = np.concatenate([pos, np.linspace(0, 5, 1_000_001, dtype=np.float32)])
    x = np.concatenate([pos, -pos])
    want = erf(x.astype(np.float64))  # the float64 path: 2-3 float64 ulp (test above)
    got = erf(x)
    assert got.dtype == np.float32 and got.shape == x.shape
    ok = want != 0
    assert _ulps(got[ok], want[ok]).max() <= 1.5
    assert np.array_equal(got[~ok], want[~ok].astype(np.float32))
    assert np.array_equal(np.signbit(got), np.signbit(x))
    rng = np.random.default_rng(3)
    some = rng.choice(x, 3000)
    ref = np.array([math.erf(v) for v in some.astype(np.float64)])
    assert _ulps(erf(some)[ref != 0], ref[ref != 0]).max() <= 1.5
    assert np.array_equal(erf(x[::3]), got[::3])  # strided input
    assert np.array_equal(erf(x[:150_000].reshape(-1, 5)).reshape(-1), got[:150_000])


def test_erf_float32_special_values() -> None:
    x = np.array([np.inf, -np.inf, np.nan, -0.0, 0.0, 30.0, -30.0, 3e38, -3e38, 4.0, -4.0], np.float32)
    x = np.concatenate([x, [np.negative(np.float32(np.nan)), np.float32(1e-45), np.float32(-1e-45)]])
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        got = erf(x)
    assert got[0] == 1 and got[1] == -1 and np.isnan(got[2]) and np.isnan(got[11])
    assert np.signbit(got[3]) and not np.signbit(got[4]) and got[3] == 0 and got[4] == 0
    assert list(got[5:11]) == [1, -1, 1, -1, 1, -1]
    assert list(got[12:]) == [np.float32(1e-45), np.float32(-1e-45)]  # 2/sqrt(pi) * x, rounded
    assert erf(np.float32(-0.5)).shape == () and erf(np.zeros((2, 0, 3), np.float32)).shape == (2, 0, 3)


def test_erf_float32_from_several_threads_at_once() -> None:
    """Each thread keeps its own scratch: calls running at the same time do not mix their blocks."""
    rng = np.random.default_rng(4)
    xs = [rng.normal(0, 2, 300_000).astype(np.float32) * (k + 1) for k in range(4)]
    want = [erf(x) for x in xs]
    got: list[list[np.ndarray]] = [[] for _ in xs]

    def work(k: int) -> None:
        for _ in range(5):
            got[k].append(erf(xs[k]))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, w in enumerate(want):
        assert len(got[k]) == 5 and all(np.array_equal(g, w) for g in got[k])
    ref = np.array([math.erf(v) for v in xs[0][:2000].astype(np.float64)])
    assert _ulps(want[0][:2000][ref != 0], ref[ref != 0]).max() <= 1.5


def test_erf_special_values_and_shapes() -> None:
    x = np.array([np.inf, -np.inf, np.nan, -0.0, 0.0, 30.0, -30.0])
    got = erf(x)
    assert got[0] == 1 and got[1] == -1 and np.isnan(got[2])
    assert np.signbit(got[3]) and not np.signbit(got[4])
    assert got[5] == 1 and got[6] == -1
    assert erf(np.float32(0.5)).shape == () and erf(np.zeros((2, 0, 3))).shape == (2, 0, 3)
    y = run("Erf", np.array(0.25, np.float32))
    assert isinstance(y, np.ndarray) and y.dtype == np.float32


def test_results_are_arrays_for_0d_inputs() -> None:
    a, b = np.array(3.0, np.float32), np.array(2.0, np.float32)
    for op in ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Equal", "Less"):
        y = run(op, a, b)
        assert isinstance(y, np.ndarray), op
    for op in ("Neg", "Exp", "Log", "Sqrt", "Sign", "Round", "IsNaN"):
        assert isinstance(run(op, a), np.ndarray), op
    assert run("Mod", a, b, fmod=1).dtype == np.float32


def test_integer_div_truncates() -> None:
    a = np.array([7, -7, 7, -7, 6, -6, 0], np.int32)
    b = np.array([2, 2, -2, -2, 3, -3, 5], np.int32)
    y = run("Div", a, b)
    assert y.dtype == np.int32
    np.testing.assert_array_equal(y, [3, -3, -3, 3, 2, 2, 0])
    np.testing.assert_array_equal(run("Div", np.array([7], np.uint8), np.array([2], np.uint8)), [3])


def test_mod_sign_rules() -> None:
    a = np.array([-4, 7, 5, 4, -7, 8], np.int64)
    b = np.array([3, -3, 8, -3, 3, 5], np.int64)
    np.testing.assert_array_equal(run("Mod", a, b, fmod=0), [2, -2, 5, -2, 2, 3])  # sign of divisor
    np.testing.assert_array_equal(run("Mod", a, b, fmod=1), [-1, 1, 5, 1, -1, 3])  # sign of dividend
    x = np.array([-4.5, 7.5], np.float32)
    np.testing.assert_allclose(run("Mod", x, np.array([2.0, -2.0], np.float32), fmod=1), [-0.5, 1.5])


def test_pow_keeps_the_base_type() -> None:
    x = np.array([1.5, 2.0, -3.0], np.float32)
    assert run("Pow", x, np.array([2, 3, 2], np.int64)).dtype == np.float32
    y = run("Pow", x.astype(np.float16), np.array(0.5, np.float32))
    assert y.dtype == np.float16 and np.isnan(y[2])
    yi = run("Pow", np.array([2, 3, 4], np.int64), np.array([0.5, 2.0, -1.0], np.float32))
    assert yi.dtype == np.int64
    np.testing.assert_array_equal(yi, [1, 9, 0])
    neg = run("Pow", np.array([2, -1], np.int32), np.array([-1, -1], np.int32))
    np.testing.assert_array_equal(neg, [0, -1])
    np.testing.assert_array_equal(run("Pow", np.array([3], np.int32), np.array([4], np.int64)), [81])


def test_variadic_ops_broadcast_and_keep_inputs() -> None:
    a = np.ones((3, 1), np.float32)
    b = np.arange(4, dtype=np.float32)
    c = np.full((2, 1, 1), 2.0, np.float32)
    before = [v.copy() for v in (a, b, c)]
    np.testing.assert_allclose(run("Sum", a, b, c), a + b + c)
    np.testing.assert_allclose(run("Mean", a, b, c), (a + b + c) / 3)
    np.testing.assert_allclose(run("Max", a, b, c), np.maximum(np.maximum(a, b), c))
    for v, w in zip((a, b, c), before, strict=True):
        np.testing.assert_array_equal(v, w)


def test_bitshift_edges() -> None:
    x = np.array([-16, 16, 1], np.int8)
    np.testing.assert_array_equal(run("BitShift", x, np.array([2, 9, -1], np.int8), direction="RIGHT"),
                                  [-4, 0, 0])
    np.testing.assert_array_equal(run("BitShift", np.array([1, 1], np.uint8), np.array([7, 8], np.uint8),
                                      direction="LEFT"), [128, 0])
    with pytest.raises(ValueError, match="direction"):
        run("BitShift", x, x, direction="UP")


def test_isinf_flags() -> None:
    x = np.array([np.inf, -np.inf, 1.0, np.nan], np.float32)
    assert run("IsInf", x, detect_positive=1, detect_negative=1).tolist() == [True, True, False, False]
    assert run("IsInf", x, detect_positive=1, detect_negative=0).tolist() == [True, False, False, False]
    assert run("IsInf", x, detect_positive=0, detect_negative=1).tolist() == [False, True, False, False]
    assert not run("IsInf", x, detect_positive=0, detect_negative=0).any()


def test_cast_float8_saturation() -> None:
    x = np.array([1000.0, -1000.0, np.inf, np.nan, 0.3], np.float32)
    e4 = cast_to(x, TensorProto.FLOAT8E4M3FN, saturate=True)
    np.testing.assert_array_equal(e4.astype(np.float32)[:3], [448, -448, 448])
    assert np.isnan(e4.astype(np.float32)[3])
    e4n = cast_to(x, TensorProto.FLOAT8E4M3FN, saturate=False).astype(np.float32)
    assert np.isnan(e4n[:3]).all()  # no infinity in e4m3fn: out of range becomes NaN
    e5n = cast_to(x, TensorProto.FLOAT8E5M2, saturate=False).astype(np.float32)
    assert e5n[0] == 1024 and e5n[2] == np.inf
    y = run("Cast", x, to=TensorProto.FLOAT8E5M2, saturate=1, opset=19)
    assert y.dtype == helper.tensor_dtype_to_np_dtype(TensorProto.FLOAT8E5M2)


def test_cast_e8m0_rounding() -> None:
    x = np.array([1.0, 1.5, 3.0, 0.75, 2.0**127 * 1.5], np.float32)

    def as_float(m: str, sat: bool = True) -> list[float]:
        return cast_to(x, TensorProto.FLOAT8E8M0, sat, m).astype(np.float32).tolist()

    assert as_float("up")[:4] == [1.0, 2.0, 4.0, 1.0]
    assert as_float("down")[:4] == [1.0, 1.0, 2.0, 0.5]
    assert as_float("nearest")[:4] == [1.0, 2.0, 4.0, 1.0]
    assert as_float("up")[4] == 2.0**127 and math.isnan(as_float("up", sat=False)[4])
    with pytest.raises(ValueError, match="round_mode"):
        cast_to(x, TensorProto.FLOAT8E8M0, True, "sideways")


@pytest.mark.parametrize("mode", ["up", "down", "nearest"])
@pytest.mark.parametrize("saturate", [1, 0])
def test_cast_e8m0_matches_onnxruntime_at_the_range_ends(mode: str, saturate: int) -> None:
    # +inf gave NaN under saturate, 2^-127 itself came out 2^-126, values at or below zero and below 2^-127
    # lost their sign or rounded up without saturate (onnx.reference has the same slips)
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(5)
    e = np.arange(255, dtype=np.uint32)
    fracs = (0, 1, 0x3FFFFF, 0x400000, 0x400001, 0x600000, 0x7FFFFF)
    fields = [((e << 23) | f).view(np.float32) for f in fracs]
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, -3.0, 2.0**-149, 3e38], np.float32)
    x = np.concatenate([special, *fields, rng.integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32)
                        .view(np.float32)])
    nodes = [helper.make_node("Cast", ["x"], ["t"], to=TensorProto.FLOAT8E8M0, saturate=saturate,
                              round_mode=mode), helper.make_node("Cast", ["t"], ["y"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [len(x)])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [len(x)])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)], ir_version=12)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, {"x": x})[0]
    got = cast_to(x, TensorProto.FLOAT8E8M0, bool(saturate), mode).astype(np.float32)
    np.testing.assert_array_equal(got, want)


_FLOAT8 = (TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT8E5M2)


def _ort_cast(x: np.ndarray, to: int, opset: int = 21) -> np.ndarray:
    """onnxruntime's Cast of ``x`` (the oracle); a float8 result cast on to float32 (numpy has no float8)."""
    ort = pytest.importorskip("onnxruntime")
    src = TensorProto.STRING if x.dtype == object else helper.np_dtype_to_tensor_dtype(x.dtype)
    nodes = [helper.make_node("Cast", ["x"], ["y" if to not in _FLOAT8 else "y8"], to=to)]
    if to in _FLOAT8:
        nodes.append(helper.make_node("Cast", ["y8"], ["y"], to=TensorProto.FLOAT))
    out = TensorProto.FLOAT if to in _FLOAT8 else to
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", src, list(x.shape))],
                          [helper.make_tensor_value_info("y", out, list(x.shape))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


@pytest.mark.parametrize("x,to", [
    (np.array([100, 0, np.nan, np.inf, -np.inf, -0.0, 1.5, 1e-7, 123456789, 3.14159265], np.float32),
     TensorProto.STRING),
    (np.array([2.5, -1e20, np.nan], np.float64), TensorProto.STRING),
    (np.array([True, False]), TensorProto.STRING),
    (np.array([7, -3, 0], np.int64), TensorProto.STRING),
    (np.array(["1", "0", "00", "5", "0.0", "-0", "2e3", "0.5", "0.9", "2.5", " 7"], dtype=object),
     TensorProto.BOOL),
    (np.array(["1.5", "1e2", "-7", "+3", "42"], dtype=object), TensorProto.INT64),
    (np.array(["300", "-1"], dtype=object), TensorProto.UINT8),  # wrapped, as C's casts wrap
    (np.array(["3000000000"], dtype=object), TensorProto.INT32),
    (np.array(["1_000", "1.5abc", " -2.5e1x", "inf", "-Infinity"], dtype=object), TensorProto.FLOAT),
    (np.array(["1.0004882812501", "1_000"], dtype=object), TensorProto.FLOAT16),  # through float32
    (np.array(["0.1", "1_5", "0x1A", "-0x1p3", "0x.8"], dtype=object), TensorProto.DOUBLE),
    (np.array(["0x1A", " +.5", "5.", "-.5e-3", "1e", "0x10"], dtype=object), TensorProto.FLOAT),
    (np.array(["1000", "-1e9", "3", "INF", "nan"], dtype=object), TensorProto.FLOAT8E4M3FN),
    (np.array([300, 448, -1000], np.int32), TensorProto.FLOAT8E4M3FN),
    (np.array([255, 16], np.uint8), TensorProto.FLOAT8E4M3FNUZ),
    (np.array([100000, 2**40], np.int64), TensorProto.FLOAT8E5M2),
])
def test_cast_to_and_from_strings_and_integers_to_float8_as_onnxruntime(x, to) -> None:
    """Numbers spelled as onnxruntime spells them ("100", "NaN", "INF", "1"/"0" for booleans: they were
    "100.0", "nan", "True"), strings read by their integer prefix for bool and integers ("0" was True, as
    every non-empty string; "1.5" failed as an integer), integers and strings saturated into float8 as floats
    are (they became NaN or inf, or failed)."""
    got, want = cast_to(x, to), _ort_cast(x, to)
    if to in _FLOAT8:
        got = cast_to(got, TensorProto.FLOAT)
    assert got.dtype == want.dtype and got.shape == want.shape
    if to == TensorProto.STRING:
        assert got.tolist() == want.tolist()
    else:
        np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64))
    if x.dtype == np.bool_:  # the round trip keeps the values
        np.testing.assert_array_equal(cast_to(got, TensorProto.BOOL), x)


@pytest.mark.parametrize("text,to", [("1e400", TensorProto.DOUBLE), ("1e-400", TensorProto.FLOAT),
                                     ("18446744073709551616", TensorProto.INT64),
                                     ("99999999999999999999", TensorProto.UINT8),
                                     ("\u0661\u0662", TensorProto.INT64),
                                     ("\xa03", TensorProto.FLOAT), ("abc", TensorProto.INT32)])
def test_strings_onnxruntime_refuses_to_cast_are_refused(text: str, to: int) -> None:
    """Out of range for C's stoll / stoull / stod, or not ASCII digits and spaces: onnxruntime's Cast fails;
    onnxtrain gave inf, 0, a wrapped value or read the Unicode digits."""
    x = np.array([text], dtype=object)
    with pytest.raises(Exception):  # noqa: B017 - onnxruntime's Fail is its own class
        _ort_cast(x, to)
    with pytest.raises(ValueError, match="Cast: "):
        cast_to(x, to)


def test_cast_strings_bool_ints() -> None:
    s = cast_to(np.array([1.5, -2.0], np.float32), TensorProto.STRING)
    assert s.dtype == object and s.tolist() == ["1.5", "-2"]
    back = cast_to(np.array(["1.5", "-inf"], dtype=object), TensorProto.FLOAT)
    assert back.dtype == np.float32 and back[1] == -np.inf
    np.testing.assert_array_equal(cast_to(np.array([0.0, -0.5, 2.0]), TensorProto.BOOL), [False, True, True])
    np.testing.assert_array_equal(cast_to(np.array([-1.7, 2.9]), TensorProto.INT32), [-1, 2])
    x = np.ones(3, np.float32)
    assert cast_to(x, TensorProto.FLOAT) is x  # no copy when the type already matches


def test_castlike_uses_the_like_type() -> None:
    y = run("CastLike", np.array([1.25, 3.5], np.float64), np.zeros(0, np.float16), opset=19, saturate=1)
    assert y.dtype == np.float16
    np.testing.assert_array_equal(y, [1.25, 3.5])



def test_bitcast_keeps_bits_and_shape() -> None:
    x = np.array([[1.0, -2.5], [0.0, np.inf]], np.float32)
    y = run("BitCast", x, opset=26, to=TensorProto.INT32)
    assert y.dtype == np.int32 and y.shape == (2, 2)
    np.testing.assert_array_equal(y, [[0x3F800000, -0x3FE00000], [0, 0x7F800000]])
    back = run("BitCast", y, opset=26, to=TensorProto.FLOAT)
    np.testing.assert_array_equal(back.view(np.uint32), x.view(np.uint32))


def test_bitcast_sub_byte_types_by_their_bit_width() -> None:
    # ml_dtypes keeps one 4-bit element per byte: reinterpretation follows the 4 bits, not the byte
    uint4 = helper.tensor_dtype_to_np_dtype(TensorProto.UINT4)
    x = np.array([0, 7, 8, 15], uint4)
    y = run("BitCast", x, opset=26, to=TensorProto.INT4)
    np.testing.assert_array_equal(y.astype(np.int8), [0, 7, -8, -1])
    np.testing.assert_array_equal(run("BitCast", x, opset=26, to=TensorProto.FLOAT4E2M1).astype(np.float32),
                                  [0.0, 6.0, -0.0, -6.0])
    with pytest.raises(TypeError, match="bit width"):  # both are one byte in numpy, but 4 and 8 bits
        run("BitCast", x, opset=26, to=TensorProto.UINT8)


@pytest.mark.parametrize("src,to", [(np.float32, TensorProto.DOUBLE), (np.int16, TensorProto.INT8),
                                    (np.complex64, TensorProto.COMPLEX128)])
def test_bitcast_between_widths_is_an_error(src, to) -> None:
    # the schema keeps the input's shape, so the widths must match (no dimension is added or removed)
    with pytest.raises(TypeError, match="bit width"):
        run("BitCast", np.zeros((2, 4), src), opset=26, to=to)


def test_bitcast_of_strings_is_an_error() -> None:
    with pytest.raises(TypeError, match="strings"):
        run("BitCast", np.array(["a"], dtype=object), opset=26, to=TensorProto.INT64)
    with pytest.raises(TypeError, match="strings"):
        run("BitCast", np.zeros(2, np.int64), opset=26, to=TensorProto.STRING)


SELECT_SHAPES = [((5, 7), (5, 7), (5, 7)), ((5, 7), (5, 7), ()), ((5, 7), (), (5, 7)), ((1, 7), (5, 1), (7,)),
                 ((2, 1, 3), (4, 3), ()), ((), (3,), (3,)), ((0, 3), (0, 3), ()),
                 ((96, 100), (96, 100), (96, 100)), ((96, 100), (100,), ())]  # past SELECT_MASK_MIN


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int64, np.int32, np.uint8, bool])
@pytest.mark.parametrize("shapes", SELECT_SHAPES)
@pytest.mark.parametrize("mask_min", [0, None])  # bit masks at every size; the default (np.where below it)
def test_where_by_bit_masks_is_np_where_bit_for_bit(monkeypatch, dtype, shapes, mask_min) -> None:
    from onnxtrain.engine.kernels import elementwise

    if mask_min is not None:
        monkeypatch.setattr(elementwise, "SELECT_MASK_MIN", mask_min)
    rng = np.random.default_rng(0)
    cs, as_, bs = shapes
    c = rng.random(cs) < 0.5
    specials = np.array([np.nan, -0.0, np.inf, -np.inf, 1.5, 0.0]) if np.dtype(dtype).kind == "f" else [0, 1]
    a = rng.choice(np.asarray(specials, dtype), as_) if as_ else np.asarray(specials[1], dtype)
    b = rng.choice(np.asarray(specials, dtype), bs) if bs else np.asarray(0, dtype)
    got, want = select(c, a, b), np.where(c, a, b)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.tobytes() == want.tobytes()  # bit for bit: NaN payloads and the sign of zero too
    # the zero scalar on the other side
    got, want = select(c, np.asarray(0, dtype), a), np.where(c, np.asarray(0, dtype), a)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("flag", [True, False])
def test_where_with_one_flag_picks_a_whole_input(monkeypatch, flag) -> None:
    from onnxtrain.engine.kernels import elementwise

    monkeypatch.setattr(elementwise, "SELECT_MASK_MIN", 0)
    a, b = np.arange(6.0).reshape(2, 3), np.full((1, 3), -1.0)
    for c in (np.array(flag), np.array([[flag]])):
        got, want = select(c, a, b), np.where(c, a, b)
        assert got.shape == want.shape and np.array_equal(got, want)


def test_where_falls_back_for_other_types() -> None:
    c = np.array([True, False])
    a, b = np.array(["x", "y"]), np.array(["p", "q"])
    assert list(select(c, a, b)) == ["x", "q"]
    z = np.array([1 + 2j, 3j])
    assert (select(c, z, z[::-1]) == np.where(c, z, z[::-1])).all()


def test_erf_into_writes_in_place_and_falls_back_for_strided_outputs() -> None:
    from onnxtrain.engine.kernels.elementwise import erf_into

    x = np.linspace(-5, 5, 70007, dtype=np.float32).reshape(7, 10001)
    want = erf(x)
    y = x.copy()
    assert erf_into(y, y) is y and y.tobytes() == want.tobytes()  # out may be the input itself
    out = np.empty((10001, 7), np.float32).T  # not C-contiguous
    assert erf_into(x, out) is out and np.array_equal(out, want)
    assert erf_into(x).tobytes() == want.tobytes()
    x64 = x.astype(np.float64)
    out64 = np.empty_like(x64)
    assert erf_into(x64, out64) is out64 and np.array_equal(out64, erf(x64))


_F8 = [TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT8E5M2,
       TensorProto.FLOAT8E5M2FNUZ]


@pytest.mark.parametrize("src", [TensorProto.BFLOAT16, *_F8])
@pytest.mark.parametrize("to", _F8)
def test_cast_from_bfloat16_and_float8_saturates_as_onnx_reference(src: int, to: int) -> None:
    """Every code of a bfloat16 or float8 source cast to a float8 type under saturate=1 (the default): values
    past the range (and ±inf) go to the largest finite value. These sources skipped the clamp (NaN or inf
    where onnx.reference and onnxruntime give ±448, ±57344, ±240); float32 sources did not."""
    from onnx.reference import ReferenceEvaluator

    if src == to:
        pytest.skip("no conversion")
    dt = np.dtype(helper.tensor_dtype_to_np_dtype(src))
    x = np.arange(1 << (8 * dt.itemsize), dtype=np.uint16 if dt.itemsize == 2 else np.uint8).view(dt)
    node = helper.make_node("Cast", ["x"], ["y"], to=to, saturate=1)
    graph = helper.make_graph([node], "cast", [helper.make_tensor_value_info("x", src, [None])],
                              [helper.make_tensor_value_info("y", to, [None])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    want = ReferenceEvaluator(model).run(None, {"x": x})[0].astype(np.float32)
    got = run("Cast", x, to=to, saturate=1, opset=21)
    assert got.dtype == helper.tensor_dtype_to_np_dtype(to)
    np.testing.assert_array_equal(got.astype(np.float32), want)
    finite = np.isfinite(x.astype(np.float32))
    assert np.isfinite(got.astype(np.float32)[finite]).all()


@pytest.mark.parametrize("src", [TensorProto.BFLOAT16, TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E5M2])
@pytest.mark.parametrize("to", [TensorProto.INT8, TensorProto.UINT8, TensorProto.INT32])
def test_cast_from_bfloat16_and_float8_to_integers_as_from_float32(src: int, to: int) -> None:
    """bfloat16/float8 → integer gives what the same values give from float32 (onnxruntime widens them so),
    out-of-range ones too (bfloat16 300 → int8 is 44, as onnxruntime; it was 0)."""
    dt = np.dtype(helper.tensor_dtype_to_np_dtype(src))
    x = np.array([0.0, 2.5, -3.75, 100.0, 300.0, -300.0, 448.0, -448.0], np.float32).astype(dt)
    got = run("Cast", x, to=to)
    want = run("Cast", x.astype(np.float32), to=to)
    np.testing.assert_array_equal(got, want)
    if to == TensorProto.INT8:
        assert got[4] == 44 or src != TensorProto.BFLOAT16


@pytest.mark.parametrize(("op", "attrs"), [("Div", {}), ("Mod", {"fmod": 0}), ("Mod", {"fmod": 1})])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8])
def test_integer_division_by_zero_is_an_error_as_in_onnxruntime(op: str, attrs: dict, dtype) -> None:
    ort = pytest.importorskip("onnxruntime")
    import onnxtrain

    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    g = helper.make_graph([helper.make_node(op, ["a", "b"], ["y"], name="q", **attrs)], "g",
                          [helper.make_tensor_value_info(n, et, [3]) for n in "ab"],
                          [helper.make_tensor_value_info("y", et, [3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()
    a, b = np.array([5, 7, 3], dtype), np.array([2, 0, 1], dtype)
    sess = ort.InferenceSession(m, providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="by zero"):
        sess.run(None, {"a": a, "b": b})
    ours = onnxtrain.InferenceSession(m)
    with pytest.raises(Exception, match=rf"'q' \({op}\).*integer (division|modulo) by zero"):
        ours.run(None, {"a": a, "b": b})
    b[1] = 4  # and without a zero, onnxruntime's values
    np.testing.assert_array_equal(ours.run(None, {"a": a, "b": b})[0], sess.run(None, {"a": a, "b": b})[0])


def _bit_patterns(dt: np.dtype) -> np.ndarray:
    """Every float16; for wider floats, random bit patterns (subnormals, infinities and NaNs among them)
    and the special values."""
    if dt == np.float16:
        return np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    ui = np.uint32 if dt == np.float32 else np.uint64
    rng = np.random.default_rng(7)
    bits = rng.integers(0, np.iinfo(ui).max, 200_000, dtype=ui, endpoint=True)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, np.finfo(dt).tiny,
                         np.finfo(dt).smallest_subnormal, np.finfo(dt).max], dt)
    return np.concatenate([bits.view(dt), specials])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_reciprocal_by_divide_has_onnx_references_bits(dtype) -> None:
    """Reciprocal runs as numpy's divide of one (numpy's own reciprocal loops are scalar): the same bits
    as onnx.reference's Reciprocal, alone and as the member of a fused cluster."""
    from onnx.reference import ReferenceEvaluator

    from onnxtrain.engine.plan import Plan

    x = _bit_patterns(np.dtype(dtype))
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))

    def model(nodes):
        io = [helper.make_tensor_value_info(n, elem, None) for n in ("x", "y")]
        g = helper.make_graph(nodes, "g", io[:1], io[1:])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])

    alone = model([helper.make_node("Reciprocal", ["x"], ["y"])])
    with np.errstate(all="ignore"):
        want = ReferenceEvaluator(alone).run(None, {"x": x})[0]
        got = run("Reciprocal", x)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    # in a cluster: Neg -> Reciprocal -> Mul, each a pass over the same arrays
    chain = model([helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Reciprocal", ["n"], ["r"]),
                   helper.make_node("Mul", ["r", "x"], ["y"])])
    plan = Plan(chain)
    assert "FusedElementwise" in [st.node.op_type for st in plan.steps]
    with np.errstate(all="ignore"):
        want = ReferenceEvaluator(chain).run(None, {"x": x})[0]
    got = plan.run({"x": x})[0]
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_reciprocal_keeps_other_types_to_numpy() -> None:
    from onnxtrain.engine.kernels.elementwise import reciprocal

    bf = helper.tensor_dtype_to_np_dtype(TensorProto.BFLOAT16)
    x = np.array([0.5, -4.0, 3.0, 0.0], np.float32).astype(bf)
    with np.errstate(divide="ignore"):
        np.testing.assert_array_equal(reciprocal(x).astype(np.float32), np.reciprocal(x).astype(np.float32))
    y = np.arange(1, 5, dtype=np.float32)
    out = np.empty_like(y)
    assert reciprocal(y, out=out) is out
    np.testing.assert_array_equal(out, np.float32(1) / y)
