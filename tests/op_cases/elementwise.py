"""Op table rows for the elementwise kernels (onnxtrain/engine/kernels/elementwise.py)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from onnx import TensorProto

from tests.op_cases import OpCase

Make = Any  # (rng, dtype) -> list of inputs


def _floats(*shapes: tuple[int, ...], low: float = -2.0, high: float = 2.0) -> Make:
    return lambda rng, dt: [rng.uniform(low, high, s).astype(dt) for s in shapes]


def _nonzero_divisor(a: tuple[int, ...], b: tuple[int, ...]) -> Make:
    def make(rng: np.random.Generator, dt: Any) -> list[Any]:
        d = rng.uniform(0.5, 2.0, b) * rng.choice([-1.0, 1.0], b)
        return [rng.uniform(-2, 2, a).astype(dt), d.astype(dt)]

    return make


def _ints(*shapes: tuple[int, ...], dtype: Any = np.int32, low: int = -9, high: int = 10) -> Make:
    return lambda rng, dt: [rng.integers(low, high, s).astype(dtype) for s in shapes]


def _int_divisor(dtype: Any) -> Make:
    def make(rng: np.random.Generator, dt: Any) -> list[Any]:
        lo = -9 if np.dtype(dtype).kind == "i" else 0
        b = rng.integers(1, 5, (3, 4)) * (rng.choice([-1, 1], (3, 4)) if lo else 1)
        return [rng.integers(lo, 20, (3, 4)).astype(dtype), b.astype(dtype)]

    return make


def _rounded(*shapes: tuple[int, ...]) -> Make:
    """Floats on a coarse grid, so comparisons see ties."""
    return lambda rng, dt: [rng.integers(-2, 3, s).astype(dt) / 2 for s in shapes]


def _bools(*shapes: tuple[int, ...]) -> Make:
    return lambda rng, dt: [rng.random(s) < 0.5 for s in shapes]


def _specials(rng: np.random.Generator, dt: Any) -> list[Any]:
    x = rng.uniform(-2, 2, (3, 4)).astype(dt)
    x.flat[[0, 3, 5, 10]] = [np.inf, -np.inf, np.nan, np.inf]
    return [x]


def _where(rng: np.random.Generator, dt: Any) -> list[Any]:
    return [rng.random((2, 3, 4)) < 0.5, rng.uniform(-2, 2, (3, 4)).astype(dt),
            rng.uniform(-2, 2, (2, 1, 4)).astype(dt)]


def erf_friendly(shape: tuple[int, ...], scale: float = 1.0, ymax: float = 0.995) -> Make:
    """Inputs x = scale * erfinv(y) with y a float32 number in (-ymax, ymax).

    onnx.reference computes Erf in float32 even for float64 tensors; at these points the float32
    rounding of erf(x / scale) is exact, so the float64 comparison can stay at 1e-10.
    """

    def make(rng: np.random.Generator, dt: Any) -> list[Any]:
        y = rng.uniform(-ymax, ymax, shape).astype(np.float32).astype(np.float64)
        lo, hi = np.full(shape, -4.0), np.full(shape, 4.0)
        verf = np.vectorize(math.erf)
        for _ in range(64):  # bisection for erfinv
            mid = (lo + hi) / 2
            below = verf(mid) < y
            lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
        return [((lo + hi) / 2 * scale).astype(dt)]

    return make


def _half_points(rng: np.random.Generator, dt: Any) -> list[Any]:
    return [(rng.integers(-8, 9, (3, 5)) / 2 + rng.choice([0.0, 0.1], (3, 5))).astype(dt)]


def _bits_of(dtype: Any, shape: tuple[int, ...] = (3, 4)) -> Make:
    """Any bit patterns of ``dtype`` (the row's float dtype is ignored: BitCast fixes both widths)."""
    dtype = np.dtype(dtype)

    def make(rng: np.random.Generator, dt: Any) -> list[Any]:
        raw = rng.integers(0, 256, (*shape, dtype.itemsize), dtype=np.uint8)
        return [raw.view(dtype).reshape(shape)]

    return make


_BITCASTS = [  # variant, inputs, to
    ("float_to_int32", lambda rng, dt: [rng.uniform(-9, 9, (3, 4)).astype(np.float32)], TensorProto.INT32),
    ("int64_to_double", lambda rng, dt: [rng.uniform(-9, 9, (2, 3)).view(np.int64)], TensorProto.DOUBLE),
    ("uint16_to_float16", _bits_of(np.uint16), TensorProto.FLOAT16),
    ("float16_to_bfloat16", lambda rng, dt: [rng.uniform(-9, 9, (4,)).astype(np.float16)],
     TensorProto.BFLOAT16),
    ("int8_to_uint8", _bits_of(np.int8, (2, 3, 2)), TensorProto.UINT8),
    ("bool_to_int8", lambda rng, dt: [rng.random((5,)) < 0.5], TensorProto.INT8),
    ("uint64_to_int64_scalar", _bits_of(np.uint64, ()), TensorProto.INT64),
    ("complex64_to_uint64", lambda rng, dt: [(rng.uniform(-2, 2, 3) + 1j).astype(np.complex64)],
     TensorProto.UINT64),
]


CASES = [
    OpCase("Add", [(3, 4), (3, 4)]),
    OpCase("Add", [(2, 3, 4), (4,)], variant="bcast"),
    OpCase("Add", [(), (2, 3)], variant="scalar"),
    OpCase("Add", make_inputs=_ints((3, 4), (4,)), grad=False, variant="int32"),
    OpCase("Sub", [(3, 4), (3, 4)]),
    OpCase("Sub", [(2, 1, 4), (3, 1)], variant="bcast"),
    OpCase("Mul", [(3, 4), (3, 4)]),
    OpCase("Mul", [(2, 3, 4), (3, 1)], variant="bcast"),
    OpCase("Mul", make_inputs=_ints((3, 4), (3, 4), dtype=np.int64), grad=False, variant="int64"),
    OpCase("Div", make_inputs=_nonzero_divisor((3, 4), (3, 4))),
    OpCase("Div", make_inputs=_nonzero_divisor((2, 3, 4), (4,)), variant="bcast"),
    OpCase("Div", make_inputs=_int_divisor(np.int32), grad=False, variant="int32_trunc"),
    OpCase("Div", make_inputs=_int_divisor(np.uint8), grad=False, variant="uint8"),
    OpCase("Pow", make_inputs=lambda rng, dt: [rng.uniform(0.5, 2, (3, 4)).astype(dt),
                                               rng.uniform(-2, 2, (3, 4)).astype(dt)]),
    OpCase("Pow", make_inputs=lambda rng, dt: [rng.uniform(0.5, 2, (2, 3)).astype(dt),
                                               np.array(2.0, dt)], variant="square"),
    OpCase("Pow", make_inputs=lambda rng, dt: [rng.uniform(-2, 2, (2, 3)).astype(dt),
                                               np.array([1, 2, 3], np.int64)], wrt=(0,), variant="int_exp"),
    OpCase("Pow", make_inputs=lambda rng, dt: [rng.integers(-3, 4, (2, 3)).astype(np.int32),
                                               rng.integers(0, 4, (2, 3)).astype(np.int32)],
           grad=False, variant="int_int"),
    OpCase("Mod", make_inputs=_int_divisor(np.int64), grad=False),
    OpCase("Mod", make_inputs=_int_divisor(np.int32), attrs={"fmod": 1}, grad=False, variant="int_fmod"),
    OpCase("Mod", make_inputs=_nonzero_divisor((3, 4), (4,)), attrs={"fmod": 1}, grad=False, variant="fmod"),
    OpCase("Neg", [(3, 4)]),
    OpCase("Neg", make_inputs=_ints((5,), dtype=np.int8), grad=False, variant="int8"),
    OpCase("Abs", [(3, 4)]),
    OpCase("Abs", make_inputs=_ints((5,), dtype=np.int64), grad=False, variant="int64"),
    OpCase("Exp", [(3, 4)]),
    OpCase("Log", [(3, 4)], low=0.2, high=3.0),
    OpCase("Sqrt", [(3, 4)], low=0.2, high=3.0),
    OpCase("Reciprocal", [(3, 4)], low=0.5, high=3.0),
    OpCase("Sign", make_inputs=_rounded((3, 4)), grad=False),
    OpCase("Erf", make_inputs=erf_friendly((3, 4))),
    OpCase("Erf", make_inputs=erf_friendly((2, 3, 5), ymax=0.99999), variant="wide"),
    OpCase("Floor", [(3, 4)], grad=False),
    OpCase("Ceil", [(3, 4)], grad=False),
    OpCase("Round", make_inputs=_half_points, grad=False),
    OpCase("Sin", [(3, 4)], low=-4.0, high=4.0),
    OpCase("Cos", [(3, 4)], low=-4.0, high=4.0),
    OpCase("Tan", [(3, 4)], low=-1.2, high=1.2),
    OpCase("Asin", [(3, 4)], low=-0.9, high=0.9),
    OpCase("Acos", [(3, 4)], low=-0.9, high=0.9),
    OpCase("Atan", [(3, 4)], low=-3.0, high=3.0),
    OpCase("Sinh", [(3, 4)]),
    OpCase("Cosh", [(3, 4)]),
    OpCase("Asinh", [(3, 4)], low=-3.0, high=3.0),
    OpCase("Acosh", [(3, 4)], low=1.1, high=3.0),
    OpCase("Atanh", [(3, 4)], low=-0.9, high=0.9),
    OpCase("Equal", make_inputs=_rounded((3, 4), (3, 4)), grad=False),
    OpCase("Equal", make_inputs=_ints((2, 3, 4), (4,)), grad=False, variant="int_bcast"),
    OpCase("Greater", make_inputs=_rounded((3, 4), (3, 4)), grad=False),
    OpCase("Greater", make_inputs=_rounded((2, 3, 4), (3, 1)), grad=False, variant="bcast"),
    OpCase("Less", make_inputs=_rounded((3, 4), (4,)), grad=False),
    OpCase("GreaterOrEqual", make_inputs=_rounded((3, 4), (3, 4)), grad=False),
    OpCase("LessOrEqual", make_inputs=_rounded((3, 4), (1, 4)), grad=False),
    OpCase("Not", make_inputs=_bools((3, 4)), grad=False),
    OpCase("And", make_inputs=_bools((3, 4), (3, 4)), grad=False),
    OpCase("Or", make_inputs=_bools((2, 3, 4), (4,)), grad=False),
    OpCase("Xor", make_inputs=_bools((3, 4), (3, 1)), grad=False),
    OpCase("IsNaN", make_inputs=_specials, grad=False),
    OpCase("IsInf", make_inputs=_specials, grad=False),
    OpCase("IsInf", make_inputs=_specials, attrs={"detect_negative": 0}, grad=False, variant="pos"),
    OpCase("IsInf", make_inputs=_specials, attrs={"detect_positive": 0}, grad=False, variant="neg"),
    OpCase("Max", [(3, 4), (3, 4)]),
    OpCase("Max", [(2, 3, 4), (4,), (3, 1)], variant="three_bcast"),
    OpCase("Max", [(3, 4)], variant="one"),
    OpCase("Min", [(3, 4), (3, 4)]),
    OpCase("Min", [(3, 1), (2, 3, 4), (4,)], variant="three_bcast"),
    OpCase("Min", make_inputs=_ints((3, 4), (4,)), grad=False, variant="int32"),
    OpCase("Sum", [(3, 4), (3, 4), (3, 4)]),
    OpCase("Sum", [(4,), (2, 3, 4)], variant="bcast"),
    OpCase("Sum", [(3, 4)], variant="one"),
    OpCase("Mean", [(3, 4), (3, 4), (3, 4)]),
    OpCase("Mean", [(2, 3, 4), (3, 1)], variant="bcast"),  # onnx.reference needs the big one first
    OpCase("Where", make_inputs=_where),
    OpCase("Identity", [(3, 4)]),
    # grad=False: a float64 → float32/16 cast cannot be checked against float64 finite differences;
    # the Cast rule is checked by the to_double rows and by the session's float32 models
    OpCase("Cast", [(3, 4)], attrs={"to": TensorProto.FLOAT}, variant="to_float", grad=False),
    OpCase("Cast", [(3, 4)], attrs={"to": TensorProto.DOUBLE}, variant="to_double"),
    OpCase("Cast", [(3, 4)], attrs={"to": TensorProto.FLOAT16}, rtol=1e-3, variant="to_float16", grad=False),
    OpCase("Cast", [(3, 4)], attrs={"to": TensorProto.INT32}, low=-5, high=5, grad=False, variant="to_int32"),
    OpCase("Cast", [(3, 4)], attrs={"to": TensorProto.BOOL}, grad=False, variant="to_bool"),
    OpCase("Cast", make_inputs=_ints((3, 4)), attrs={"to": TensorProto.FLOAT}, grad=False,
           variant="from_int"),
    OpCase("Cast", make_inputs=_bools((3, 4)), attrs={"to": TensorProto.INT64}, grad=False,
           variant="bool_int"),
    OpCase("CastLike", make_inputs=lambda rng, dt: [rng.uniform(-2, 2, (3, 4)).astype(dt),
                                                    np.zeros(1, np.float64)], wrt=(0,)),
    OpCase("CastLike", make_inputs=lambda rng, dt: [rng.uniform(-5, 5, (3, 4)).astype(dt),
                                                    np.zeros(1, np.int64)], grad=False, variant="to_int"),
    *(OpCase("BitCast", make_inputs=make, attrs={"to": to}, grad=False, opset=26, variant=name)
      for name, make, to in _BITCASTS),
    OpCase("BitShift", make_inputs=lambda rng, dt: [rng.integers(0, 200, (3, 4)).astype(np.uint8),
                                                    rng.integers(0, 8, (3, 4)).astype(np.uint8)],
           attrs={"direction": "RIGHT"}, grad=False, variant="right"),
    OpCase("BitShift", make_inputs=lambda rng, dt: [rng.integers(0, 1000, (3, 4)).astype(np.uint32),
                                                    rng.integers(0, 8, (4,)).astype(np.uint32)],
           attrs={"direction": "LEFT"}, grad=False, variant="left_bcast"),
    OpCase("BitwiseAnd", make_inputs=_ints((3, 4), (3, 4), low=-100, high=100), opset=18, grad=False),
    OpCase("BitwiseOr", make_inputs=_ints((3, 4), (4,), dtype=np.uint16, low=0, high=1000), opset=18,
           grad=False),
    OpCase("BitwiseXor", make_inputs=_ints((3, 4), (3, 1), dtype=np.int64, low=-1000, high=1000),
           opset=18, grad=False),
    OpCase("BitwiseNot", make_inputs=_ints((3, 4), dtype=np.uint8, low=0, high=256), opset=18, grad=False),
]


# ---- gradient rows of autodiff/rules/elementwise.py (variants the rows above do not cover) --------

def _g_away0(rng: np.random.Generator, dt: Any, shape: tuple[int, ...], low: float = 0.5,
             high: float = 2.0) -> Any:
    """|v| in [low, high) with a random sign: away from the kink or pole at 0."""
    return np.asarray(rng.choice([-1.0, 1.0], shape) * rng.uniform(low, high, shape), dtype=dt)


def _g_unary_away0(shape: tuple[int, ...], low: float = 0.5) -> Make:
    return lambda rng, dt: [_g_away0(rng, dt, shape, low)]


def _g_binary(a: tuple[int, ...], b: tuple[int, ...], b_low: float = 0.5, a_range: float = 2.0) -> Make:
    return lambda rng, dt: [rng.uniform(-a_range, a_range, a).astype(dt), _g_away0(rng, dt, b, b_low)]


def _g_pow_neg_base(rng: np.random.Generator, dt: Any) -> list[Any]:
    # negative bases need integer-valued exponents; only dA is checked (dB is guarded to 0 there)
    return [rng.uniform(-2.0, -0.5, (3, 4)).astype(dt), rng.integers(-2, 4, (4,)).astype(dt)]


def _g_pow_zero_exp(rng: np.random.Generator, dt: Any) -> list[Any]:
    a = rng.uniform(-1.0, 1.0, (3, 4)).astype(dt)
    a[0, :2] = 0.0  # 0^0: dA must be 0, not 0·0^-1 = nan
    return [a, np.zeros((4,), dt)]


def _g_ties(a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> Make:
    # B equals A's leading slice on every other element (exact ties) and differs by 0.5 elsewhere
    def make(rng: np.random.Generator, dt: Any) -> list[Any]:
        a = rng.uniform(-2.0, 2.0, a_shape).astype(dt)
        b = a[(0,) * (len(a_shape) - len(b_shape))].copy()
        b.reshape(-1)[1::2] += 0.5
        return [a, b]

    return make


def _g_where(c: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...]) -> Make:
    return lambda rng, dt: [rng.random(c) < 0.5, rng.uniform(-2, 2, a).astype(dt),
                            rng.uniform(-2, 2, b).astype(dt)]


CASES += [
    OpCase("Sub", [(4,), (2, 3, 4)], variant="grad_bcast_left"),
    OpCase("Div", make_inputs=_g_binary((3, 1), (2, 3, 4)), variant="grad_bcast_left"),
    OpCase("Pow", [(2, 3, 4), (4,)], low=0.5, high=2.0, variant="grad_bcast"),
    OpCase("Pow", [(3, 1), (2, 3, 4)], low=0.5, high=2.0, variant="grad_bcast_left"),
    OpCase("Pow", make_inputs=_g_pow_neg_base, wrt=(0,), variant="grad_neg_base"),
    OpCase("Pow", make_inputs=_g_pow_zero_exp, wrt=(0,), variant="grad_zero_exp"),
    # float Mod needs fmod=1: dA = dY, dB = -dY·trunc(A/B)
    OpCase("Mod", make_inputs=_g_binary((3, 4), (3, 4), 0.7, 5.0), attrs={"fmod": 1}, variant="grad"),
    OpCase("Mod", make_inputs=_g_binary((2, 3, 4), (4,), 0.7, 5.0), attrs={"fmod": 1}, variant="grad_bcast"),
    OpCase("Neg", [(2, 1, 5)], variant="grad_3d"),
    OpCase("Abs", make_inputs=_g_unary_away0((2, 1, 5), 0.2), variant="grad_3d"),
    OpCase("Reciprocal", make_inputs=_g_unary_away0((3, 4)), variant="grad_signed"),
    OpCase("Reciprocal", make_inputs=_g_unary_away0(()), variant="grad_scalar"),
    OpCase("Sum", [(2, 3, 4), (3, 1), (4,)], variant="grad_bcast3"),
    OpCase("Mean", [(3, 4)], variant="grad_one"),
    OpCase("Mean", [(2, 3, 4), (3, 1), (4,)], variant="grad_bcast3"),
    # ties split evenly (torch.maximum): nudging one of two tied inputs moves Y at half speed on average,
    # so central differences see ½ exactly when only that input is perturbed
    OpCase("Max", make_inputs=_g_ties((3, 4), (3, 4)), wrt=(0,), variant="grad_ties"),
    OpCase("Max", make_inputs=_g_ties((2, 4), (4,)), wrt=(1,), variant="grad_ties_bcast"),
    OpCase("Min", make_inputs=_g_ties((3, 4), (3, 4)), wrt=(1,), variant="grad_ties"),
    OpCase("Where", make_inputs=_g_where((3, 4), (3, 4), (3, 4)), variant="grad"),
    OpCase("Where", make_inputs=_g_where((4,), (), (2, 3, 1)), variant="grad_bcast_scalar"),
    OpCase("Exp", [()], variant="grad_scalar"),
    OpCase("Log", [(2, 1, 5)], low=0.2, high=3.0, variant="grad_3d"),
    OpCase("Sqrt", [(2, 1, 5)], low=0.2, high=3.0, variant="grad_3d"),
    OpCase("Erf", make_inputs=erf_friendly((2, 1, 5)), variant="grad_3d"),
    OpCase("Sin", [(2, 1, 5)], variant="grad_3d"),
    OpCase("Cos", [(2, 1, 5)], variant="grad_3d"),
    OpCase("Tan", [(2, 1, 5)], low=-1.2, high=1.2, variant="grad_3d"),
    OpCase("Asin", [(2, 1, 5)], low=-0.9, high=0.9, variant="grad_3d"),
    OpCase("Acos", [(2, 1, 5)], low=-0.9, high=0.9, variant="grad_3d"),
    OpCase("Atan", [(2, 1, 5)], variant="grad_3d"),
    OpCase("Sinh", [(2, 1, 5)], variant="grad_3d"),
    OpCase("Cosh", [(2, 1, 5)], variant="grad_3d"),
    OpCase("Asinh", [(2, 1, 5)], variant="grad_3d"),
    OpCase("Acosh", [(2, 1, 5)], low=1.2, high=3.0, variant="grad_3d"),
    OpCase("Atanh", [(2, 1, 5)], low=-0.9, high=0.9, variant="grad_3d"),
]


# onnxruntime's gradient checks (orttraining/test/gradient/gradient_ops_test.cc): the shapes and attributes
# of theirs that the rows above did not have
CASES += [
    OpCase("Add", [(2, 1, 1, 5), (1, 3, 4, 1)], opset=11, variant="grad_ort_bcast_both_v11"),
    OpCase("Sub", [(2, 3, 4, 5), ()], variant="grad_ort_rhs_scalar"),
    OpCase("Mul", [(1, 4, 5), (2, 3, 1, 1)], opset=11, variant="grad_ort_bcast_cross_v11"),
    OpCase("Mul", [(4, 5), (2, 3, 4, 5)], variant="grad_ort_lhs_low_rank"),
    OpCase("Div", make_inputs=_g_binary((3, 4, 5), (2, 1, 1, 1)), variant="grad_ort_bcast_lead_ones"),
    OpCase("Div", make_inputs=_g_binary((), (2, 3, 4, 5)), variant="grad_ort_scalar_numerator"),
    # a constant exponent of shape [1] (square and cube) over bases of either sign
    OpCase("Pow", make_inputs=lambda rng, dt: [rng.uniform(-2, 2, (2, 3, 4)).astype(dt), np.array([3.0], dt)],
           wrt=(0,), variant="grad_ort_cube_any_sign"),
]
