"""Integer, bool and string semantics of the kernels against onnxruntime 1.32's InferenceSession.

A seeded sample of one-node models over every integer type, bool and strings (wrapping arithmetic, C
division and both Mods, bitwise ops, comparisons, Where, ArgMax/ArgMin and TopK with ties, Unique, NonZero,
CumSum, the reductions, Range, OneHot, the Gathers and Scatters with negative indices, Cast from NaN, ±inf,
-0, out-of-range and .5 values, string casts and the string ops) is run in onnxtrain's InferenceSession and
onnxruntime's and compared value for value (onnxruntime's graph optimizations off, as they fold Cast pairs).

Where onnxruntime departs from the ONNX spec the spec is kept (onnx.reference or the spec's text is the
oracle there): Cast to FLOAT8E5M2 with saturate=0 of a value that rounds past 57344 is ±inf (onnxruntime:
NaN), a float8 -0 cast to bool is False (onnxruntime: True), NonZero of a scalar has shape (0, N)
(onnxruntime: (1, N)), StringSplit without a delimiter splits at every whitespace character (onnxruntime:
only at U+0020). Where the spec leaves the result open (integer overflow in the reductions, float to
integer out of range, float to 4-bit integer) the sample stays within range; integer powers are checked
against Python's exact ones (wrapping as integer products do), ReduceL2 of integers against the exact
integer square root, and the zero a string tensor is filled with (Trilu, CenterCropPad, opset-8 Scan's
padding) is the empty string.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx.reference import ReferenceEvaluator

import onnxtrain

ort = pytest.importorskip("onnxruntime")

_INTS = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]


def _info(t: type) -> int:
    return h.np_dtype_to_tensor_dtype(np.dtype(t)) if np.dtype(t).kind not in "OU" else T.STRING


def _model(nodes: list[onnx.NodeProto], feeds: dict[str, np.ndarray], outs: list[str],
           opset: int = 21) -> bytes:
    ins = [h.make_tensor_value_info(k, _info(v.dtype), None) for k, v in feeds.items()]
    g = h.make_graph(nodes, "g", ins, [h.make_empty_tensor_value_info(o) for o in outs])
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset)], ir_version=10).SerializeToString()


def _ort_run(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _ours(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return onnxtrain.InferenceSession(model).run(None, feeds)


def _assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.dtype,
                                                                 want.shape)
    if want.dtype.kind in "OU":
        assert got.tolist() == want.tolist(), what
    elif want.dtype.kind == "f":
        np.testing.assert_array_equal(got, want, err_msg=what)  # (NaN equals NaN here)
    else:
        assert np.array_equal(got, want), (what, got, want)


# ------------------------------------------------------------------------------ ReduceL2 of integers


def _floor_l2(x: np.ndarray, axis: int) -> np.ndarray:
    """⌊√Σx²⌋ along ``axis`` in exact integer arithmetic."""
    rows = np.moveaxis(x, axis, -1).reshape(-1, x.shape[axis]).tolist()
    out = [math.isqrt(sum(v * v for v in row)) for row in rows]
    return np.array(out, dtype=x.dtype).reshape(np.delete(x.shape, axis))


@pytest.mark.parametrize("dt", [np.int32, np.uint32, np.int64, np.uint64])
def test_reduce_l2_of_integers_does_not_overflow_in_its_squares(dt: type) -> None:
    """The L2 norm of integers whose norm fits the type but whose squares do not (int32 from 46,341): the
    integer square root of the exact sum of squares, as onnxruntime gives it (it sums in float64). The
    squares were summed in the input's type, wrapping: int32 [50000, 46341] gave 18775 instead of 68172."""
    rng = np.random.default_rng(11)
    # (the norms of three such values fit the type)
    top = {np.int32: 1_200_000_000, np.uint32: 2_400_000_000, np.int64: 1 << 40, np.uint64: 1 << 41}[dt]
    lo = -top if np.dtype(dt).kind == "i" else 0
    x = rng.integers(lo, top, (3, 5), dtype=np.int64).astype(dt)
    x[:, 0] = np.array([50000, 46341, 65536], dtype=dt)
    axes = np.array([0], np.int64)
    model = _model([h.make_node("ReduceL2", ["x", "axes"], ["y"], keepdims=0)], {"x": x, "axes": axes}, ["y"])
    (got,) = _ours(model, {"x": x, "axes": axes})
    want = _floor_l2(x.astype(object), 0).astype(dt)
    _assert_same(got, want, f"ReduceL2 {np.dtype(dt).name}")
    if dt in (np.int32, np.int64):  # the types onnxruntime's ReduceL2 takes
        _assert_same(got, _ort_run(model, {"x": x, "axes": axes})[0], "ReduceL2 onnxruntime")


# ------------------------------------------------------------------------------ the seeded sample

_F8 = [T.FLOAT8E4M3FN, T.FLOAT8E4M3FNUZ, T.FLOAT8E5M2, T.FLOAT8E5M2FNUZ]
_SPECIAL = np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 127.5, 128,
                     255.5, 256, -129, -128.5, 3e9, -3e9, 1e19, -1e19, 65535.5, 65536, -1, 1e-40, 2.0**31])

Case = tuple[str, list[onnx.NodeProto], dict[str, np.ndarray], list[str]]


def _one(op: str, feeds: dict[str, np.ndarray], outs: int = 1, **attrs: object) -> tuple:
    names = [f"y{i}" for i in range(outs)]
    return [h.make_node(op, list(feeds), names, name=f"the_{op}", **attrs)], feeds, names


def _ints(rng: np.random.Generator, dt: type, shape: tuple[int, ...], lo: int | None = None,
          hi: int | None = None) -> np.ndarray:
    info = np.iinfo(dt)
    lo = info.min if lo is None else max(lo, info.min)
    hi = info.max if hi is None else min(hi, info.max)
    return rng.integers(lo, hi, shape, dtype=dt, endpoint=True)


def _cases() -> Iterator[Case]:
    rng = np.random.default_rng(2026)
    i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
    # Cast from floats: NaN, ±inf, -0, halves and out-of-range values (ONNX: undefined when out of range;
    # both runtimes convert as the CPU does) to every integer type and bool
    for src in (np.float16, np.float32, np.float64):
        with np.errstate(over="ignore"):
            x = _SPECIAL.astype(src)
        for to in (T.INT8, T.UINT8, T.INT16, T.UINT16, T.INT32, T.UINT32, T.INT64, T.UINT64, T.BOOL):
            yield (f"Cast {np.dtype(src).name}->{to}", *_one("Cast", {"x": x}, to=to))
    # bfloat16 (built in the graph: onnxruntime takes no bfloat16 feed) to integers and back
    x = _SPECIAL.astype(np.float32)
    for to in (T.INT8, T.UINT16, T.INT32, T.INT64, T.BOOL):
        nodes = [h.make_node("Cast", ["x"], ["b"], to=T.BFLOAT16), h.make_node("Cast", ["b"], ["y"], to=to),
                 h.make_node("Cast", ["b"], ["w"], to=T.FLOAT)]
        yield f"Cast bfloat16->{to}", nodes, {"x": x}, ["y", "w"]
    # integers to float16, bfloat16 and the float8 types (rounding to nearest even), saturated float8
    for dt in _INTS:
        x = _ints(rng, dt, (400,))
        x[:8] = np.array([0, 1, 2049, 2051, 65519, 257, 32896, 33554435], np.int64).astype(dt)
        for to in (T.FLOAT16, T.BFLOAT16, T.FLOAT8E4M3FN, T.FLOAT8E5M2):
            nodes = [h.make_node("Cast", ["x"], ["f"], to=to), h.make_node("Cast", ["f"], ["y"], to=T.DOUBLE),
                     h.make_node("Cast", ["f"], ["w"], to=T.FLOAT)]
            yield f"Cast {np.dtype(dt).name}->{to}", nodes, {"x": x}, ["y", "w"]
    wide = np.concatenate([_SPECIAL, rng.standard_normal(200) * 10.0 ** rng.integers(-3, 6, 200)])
    wide = wide.astype(np.float32)
    for to in _F8:
        nodes = [h.make_node("Cast", ["x"], ["f"], to=to, saturate=1),
                 h.make_node("Cast", ["f"], ["y"], to=T.FLOAT),
                 h.make_node("Cast", ["f"], ["w"], to=T.DOUBLE)]
        yield f"Cast float->{to} saturate", nodes, {"x": wide}, ["y", "w"]
    # numbers to strings and strings to numbers (onnxruntime's spellings and C's strtod/strtoll readings)
    for dt in (np.float16, np.float32, np.float64, np.int8, np.uint64, np.int64, np.bool_):
        with np.errstate(over="ignore"):
            x = (wide.astype(dt) if np.dtype(dt).kind == "f" else
                 rng.integers(0, 2, 20).astype(bool) if dt is np.bool_ else _ints(rng, dt, (50,)))
        yield f"Cast {np.dtype(dt).name}->string", *_one("Cast", {"x": x}, to=T.STRING)
    whole = ["0", "-1", "+5", " 7", "1.5", "-1.5", "1e2", "1_000", "12abc", "255", "256", "-129", "65536",
             "4294967296", "9223372036854775807", "-9223372036854775808", "-0"]
    floats = ["1E-3", "inf", "-INF", "NaN", "0x1A", "1.5abc", "  .5", "3.4e38", "3.5e38", "1e-45"]
    words = np.array(whole + floats, dtype=object)
    for to in (T.INT8, T.UINT8, T.INT32, T.UINT32, T.INT64, T.BOOL, T.FLOAT16, T.FLOAT, T.DOUBLE):
        x = words if to in (T.FLOAT16, T.FLOAT, T.DOUBLE) else np.array(whole, dtype=object)
        yield f"Cast string->{to}", *_one("Cast", {"x": x}, to=to)
    # wrapping integer arithmetic, C division, both Mods (negative operands), bitwise ops and shifts
    for dt in (np.int32, np.int64):
        a, b = _ints(rng, dt, (300,)), _ints(rng, dt, (300,))
        a[:3] = np.iinfo(dt).min, np.iinfo(dt).max, -1
        for op in ("Add", "Sub", "Mul", "Max", "Min", "Equal", "Less", "Greater", "LessOrEqual", "BitwiseAnd",
                   "BitwiseXor"):
            yield f"{op} {np.dtype(dt).name}", *_one(op, {"a": a, "b": b})
        for op in ("Neg", "Abs", "Sign", "BitwiseNot"):
            yield f"{op} {np.dtype(dt).name}", *_one(op, {"a": a})
        small, div = _ints(rng, dt, (300,), -50, 50), _ints(rng, dt, (300,), -7, 7)
        div[div == 0] = 3
        yield f"Div {np.dtype(dt).name}", *_one("Div", {"a": small, "b": div})
        for fmod in (0, 1):
            yield f"Mod fmod={fmod} {np.dtype(dt).name}", *_one("Mod", {"a": small, "b": div}, fmod=fmod)
        yield f"Pow {np.dtype(dt).name}", *_one("Pow", {"a": _ints(rng, dt, (200,), -6, 6),
                                                        "b": _ints(rng, dt, (200,), 0, 11)})
        yield f"Clip {np.dtype(dt).name}", *_one("Clip", {"a": small, "lo": np.array(-20, dt),
                                                          "hi": np.array(30, dt)})
        yield f"Clip lo>hi {np.dtype(dt).name}", *_one("Clip", {"a": small, "lo": np.array(9, dt),
                                                                "hi": np.array(2, dt)})
    for dt in (np.int8, np.uint8, np.int16, np.uint16, np.uint32, np.uint64):
        a, b = _ints(rng, dt, (300,)), _ints(rng, dt, (300,))
        for op in ("Add", "Sub", "Mul", "BitwiseOr"):
            yield f"{op} {np.dtype(dt).name}", *_one(op, {"a": a, "b": b})
    for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
        a, s = _ints(rng, dt, (200,)), _ints(rng, dt, (200,), 0, 8 * np.dtype(dt).itemsize + 2)
        for direction in ("LEFT", "RIGHT"):
            yield f"BitShift {direction} {np.dtype(dt).name}", *_one("BitShift", {"a": a, "s": s},
                                                                       direction=direction)
    # Where over bit masks (8192 values and more) and small, of int, bool and string values
    c = rng.integers(0, 2, (64, 200)).astype(bool)
    texts = np.array(["a", "bé", ""], dtype=object)[rng.integers(0, 3, (64, 200))]
    for a, b in ((_ints(rng, np.int8, (64, 200)), np.zeros(1, np.int8)),
                 (_ints(rng, np.int64, (1, 200)), _ints(rng, np.int64, (64, 1))),
                 (_ints(rng, np.uint8, (64, 200)), _ints(rng, np.uint8, (64, 200))),
                 (texts, np.array(["z"], object))):
        yield f"Where {a.dtype}", *_one("Where", {"c": c, "a": a, "b": b})
    strings = np.array(["a", "b", "", "é", "ab", "A", "a "], dtype=object)
    s1, s2 = strings[rng.integers(0, 7, 40)], strings[rng.integers(0, 7, 40)]
    yield "Equal string", *_one("Equal", {"a": s1, "b": s2})
    # ArgMax/ArgMin and TopK with ties, Unique, NonZero, CumSum, reductions
    for dt in (np.int8, np.uint8, np.int32, np.int64):
        x = _ints(rng, dt, (5, 7, 4), -2, 2)
        for ax in (0, 1, -1):
            for last in (0, 1):
                for op in ("ArgMax", "ArgMin"):
                    yield (f"{op} {np.dtype(dt).name} axis={ax} last={last}",
                           *_one(op, {"x": x}, axis=ax, keepdims=last, select_last_index=last))
    for dt in (np.int32, np.int64):
        x = _ints(rng, dt, (6, 9), -3, 3)
        for ax, k, largest in ((0, 4, 1), (1, 9, 0), (-1, 3, 1), (1, 0, 1)):
            yield (f"TopK {np.dtype(dt).name} axis={ax} k={k} largest={largest}",
                   *_one("TopK", {"x": x, "k": i64(k)}, outs=2, axis=ax, largest=largest, sorted=1))
        for ex in (0, 1):
            for rev in (0, 1):
                yield (f"CumSum {np.dtype(dt).name} exclusive={ex} reverse={rev}",
                       *_one("CumSum", {"x": _ints(rng, dt, (5, 8)), "ax": np.array(-1, np.int32)},
                             exclusive=ex, reverse=rev))
        x = _ints(rng, dt, (4, 5, 3), -6, 6)  # (the products of 20 values fit int32)
        for op in ("ReduceSum", "ReduceProd", "ReduceMin", "ReduceMax", "ReduceMean", "ReduceL1", "ReduceL2",
                   "ReduceSumSquare", "ReduceLogSumExp"):
            for axes, noop in ((i64(1), 0), (i64(0, -1), 0), (i64(), 0), (i64(), 1)):
                yield (f"{op} {np.dtype(dt).name} axes={axes.tolist()} noop={noop}",
                       *_one(op, {"x": x, "axes": axes}, keepdims=1, noop_with_empty_axes=noop))
        yield f"NonZero {np.dtype(dt).name}", *_one("NonZero", {"x": _ints(rng, dt, (3, 4, 5), -1, 1)})
    for sort in (0, 1):
        x, rows = _ints(rng, np.int64, (40,), -5, 5), _ints(rng, np.int64, (9, 2), 0, 1)
        yield f"Unique int64 sorted={sort}", *_one("Unique", {"x": x}, outs=4, sorted=sort)
        yield f"Unique int64 axis=0 sorted={sort}", *_one("Unique", {"x": rows}, outs=4, sorted=sort, axis=0)
        yield f"Unique string sorted={sort}", *_one("Unique", {"x": s1}, outs=4, sorted=sort)
    # Range, OneHot (negative indices, a float depth is truncated), the Gathers and Scatters
    for dt in (np.int16, np.int32, np.int64):
        for start, limit, delta in ((0, 10, 3), (10, 0, -3), (0, 10, -1), (-7, 7, 2), (5, 5, 1)):
            feeds = {"s": np.array(start, dt), "l": np.array(limit, dt), "d": np.array(delta, dt)}
            yield f"Range {np.dtype(dt).name} {start} {limit} {delta}", *_one("Range", feeds)
    idx = np.array([0, 1, -1, -5, 4, 2, -3], np.int64)
    for depth in (np.array([5], np.int64), np.array([5.9], np.float32)):
        values = np.array([3, 9], np.float32)
        yield f"OneHot depth {depth.dtype}", *_one("OneHot", {"i": idx, "d": depth, "v": values}, axis=0)
    data = _ints(rng, np.int64, (4, 5, 3), -99, 99)
    for ax in (-3, -2, -1, 0, 1, 2):
        n = data.shape[ax]
        ind = np.array([[0, -1], [-n, n - 1]], np.int64)
        yield f"Gather axis={ax}", *_one("Gather", {"x": data, "i": ind}, axis=ax)
        shape = list(data.shape)
        shape[ax] = 2
        ind = rng.integers(-n, n, shape).astype(np.int64)
        yield f"GatherElements axis={ax}", *_one("GatherElements", {"x": data, "i": ind}, axis=ax)
        for red in ("none", "add", "mul", "max", "min"):
            upd = _ints(rng, np.int64, tuple(shape), -9, 9)
            yield (f"ScatterElements axis={ax} {red}",
                   *_one("ScatterElements", {"x": data, "i": ind, "u": upd}, axis=ax, reduction=red))
    for ind in (np.array([[0, -1], [3, -5]]), np.array([[-4]]), np.array([[1, 2, -3]])):
        yield f"GatherND {ind.tolist()}", *_one("GatherND", {"x": data, "i": ind.astype(np.int64)})
        upd = _ints(rng, np.int64, ind.shape[:-1] + data.shape[ind.shape[-1]:], -9, 9)
        for red in ("none", "add", "max"):
            yield (f"ScatterND {ind.tolist()} {red}",
                   *_one("ScatterND", {"x": data, "i": ind.astype(np.int64), "u": upd}, reduction=red))
    # string ops: empty strings, unicode, case, stop words (onnxruntime's default locale, en_US.UTF-8, may be
    # missing: C.UTF-8 is given), delimiters, RE2 patterns
    texts = np.array(["", "Straße", "ÉCOLE é", "a,b,,c", "İı ß", "  x  y ", "😀ab", "AB", "ab"], dtype=object)
    yield "StringConcat", *_one("StringConcat", {"a": texts, "b": texts[::-1].copy()})
    for action in ("NONE", "LOWER", "UPPER"):
        for sensitive in (0, 1):
            yield (f"StringNormalizer {action} case_sensitive={sensitive}",
                   *_one("StringNormalizer", {"x": texts}, case_change_action=action,
                         is_case_sensitive=sensitive, stopwords=["ab", "écOLE é", ""], locale="C.UTF-8"))
    for delimiter, maxsplit in ((",", -1), (",", 1), (" ", 0), ("ß", 2), ("ab", -1)):
        yield (f"StringSplit {delimiter!r} {maxsplit}",
               *_one("StringSplit", {"x": texts}, outs=2, delimiter=delimiter, maxsplit=maxsplit))
    for pattern in ("", ".*", "[a-z]+", "(?i)ab", "\\w+", "\\s*x\\s+y\\s*", "[[:upper:]]+", "..."):
        yield f"RegexFullMatch {pattern!r}", *_one("RegexFullMatch", {"x": texts}, pattern=pattern)
    # IsNaN / IsInf of float16 and bfloat16
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, 65504, 1e5, -1e5, 3e38], np.float32)
    for half in (T.FLOAT16, T.BFLOAT16):
        for op, attrs in (("IsNaN", {}), ("IsInf", {}), ("IsInf", {"detect_negative": 0}),
                          ("IsInf", {"detect_positive": 0})):
            nodes = [h.make_node("Cast", ["x"], ["h"], to=half), h.make_node(op, ["h"], ["y"], **attrs)]
            yield f"{op} {half} {attrs}", nodes, {"x": x}, ["y"]


_ALL = list(_cases())


@pytest.mark.parametrize("case", _ALL, ids=[c[0] for c in _ALL])
def test_matches_onnxruntime(case: Case) -> None:
    """One node (or a Cast chain) run by both runtimes: the same values, types and shapes."""
    what, nodes, feeds, outs = case
    model = _model(nodes, feeds, outs)
    want = _ort_run(model, feeds)
    for got, ref in zip(_ours(model, feeds), want, strict=True):
        _assert_same(got, ref, what)


# ------------------------------------------------------------------------------ where onnxruntime departs


def _reference(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ReferenceEvaluator(onnx.load_from_string(model)).run(None, feeds)


def test_float8_e5m2_without_saturation_overflows_to_infinity() -> None:
    """saturate=0: a value that rounds past E5M2's 57344 is ±inf by the spec's table and onnx.reference
    (onnxruntime gives NaN); E4M3FN's past 448 is NaN (onnxruntime keeps -448 for -486)."""
    x = np.array([63452.84, -64200.7, 65535.5, 57344, 61439, 1e6, np.inf, -486, 470, 464], np.float32)
    for to in (T.FLOAT8E5M2, T.FLOAT8E4M3FN):
        nodes = [h.make_node("Cast", ["x"], ["f"], to=to, saturate=0),
                 h.make_node("Cast", ["f"], ["y"], to=T.FLOAT)]
        model = _model(nodes, {"x": x}, ["y"])
        _assert_same(_ours(model, {"x": x})[0], _reference(model, {"x": x})[0], f"Cast to {to}")


def test_float8_negative_zero_is_false() -> None:
    """Cast to bool: ±0 → False (the spec; onnxruntime makes a float8 -0 True)."""
    x = np.array([-0.0, 0.0, 1.0, -3.0], np.float32)
    for to in (T.FLOAT8E4M3FN, T.FLOAT8E5M2):
        nodes = [h.make_node("Cast", ["x"], ["f"], to=to), h.make_node("Cast", ["f"], ["y"], to=T.BOOL)]
        (got,) = _ours(_model(nodes, {"x": x}, ["y"]), {"x": x})
        assert got.tolist() == [False, False, True, True]


def test_nonzero_of_a_scalar_has_no_rows() -> None:
    """NonZero of a 0-d input: shape (0, N) (the spec; onnxruntime gives (1, N))."""
    for v in (5, 0):
        x = np.array(v, np.int32)
        model = _model([h.make_node("NonZero", ["x"], ["y"])], {"x": x}, ["y"])
        _assert_same(_ours(model, {"x": x})[0], _reference(model, {"x": x})[0], f"NonZero({v})")


def test_string_split_without_delimiter_splits_at_any_whitespace() -> None:
    """No delimiter: runs of whitespace separate, tabs and U+3000 included (the spec, onnx.reference;
    onnxruntime splits at U+0020 only)."""
    x = np.array(["a\tb  c", "\u3000x\ny\u00a0z ", ""], dtype=object)
    model = _model([h.make_node("StringSplit", ["x"], ["y", "n"])], {"x": x}, ["y", "n"])
    for got, want in zip(_ours(model, {"x": x}), _reference(model, {"x": x}), strict=True):
        _assert_same(got, want, "StringSplit")


# ------------------------------------------------------------------------------ errors name the node


@pytest.mark.parametrize("op, feeds, attrs", [
    ("Gather", {"x": np.zeros((4, 3), np.int64), "i": np.array([4], np.int64)}, {"axis": 0}),
    ("Gather", {"x": np.zeros((4, 3), np.int64), "i": np.array([-5], np.int64)}, {"axis": 0}),
    ("GatherElements", {"x": np.zeros((4, 3), np.int64), "i": np.full((4, 3), 3, np.int64)}, {"axis": 1}),
    ("GatherND", {"x": np.zeros((4, 3), np.int64), "i": np.array([[0, -4]], np.int64)}, {}),
    ("ScatterND", {"x": np.zeros((4, 3), np.int64), "i": np.array([[4]], np.int64),
                   "u": np.zeros((1, 3), np.int64)}, {}),
    ("ScatterElements", {"x": np.zeros((4, 3), np.int64), "i": np.full((1, 1), -5, np.int64),
                         "u": np.zeros((1, 1), np.int64)}, {"axis": 0}),
    ("Div", {"a": np.array([1, 2], np.int32), "b": np.array([1, 0], np.int32)}, {}),
    ("Mod", {"a": np.array([1, 2], np.int64), "b": np.array([0, 1], np.int64)}, {"fmod": 1}),
    ("Range", {"s": np.array(0, np.int32), "l": np.array(5, np.int32), "d": np.array(0, np.int32)}, {}),
], ids=["Gather past the end", "Gather before the start", "GatherElements", "GatherND", "ScatterND",
        "ScatterElements", "Div by 0", "Mod by 0", "Range delta 0"])
def test_bad_index_or_divisor_is_an_error_naming_the_node(op: str, feeds: dict[str, np.ndarray],
                                                          attrs: dict[str, object]) -> None:
    """Both runtimes refuse; onnxtrain's error names the node and the op."""
    nodes = [h.make_node(op, list(feeds), ["y"], name="picky_node", **attrs)]
    model = _model(nodes, feeds, ["y"])
    with pytest.raises(Exception):  # noqa: B017 - onnxruntime's own exception classes
        _ort_run(model, feeds)
    with pytest.raises(Exception, match=f"picky_node.*{op}"):  # noqa: B017
        _ours(model, feeds)


# ------------------------------------------------------------------------------ integer powers


def _exact_powers(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a ** b in Python's integers, truncated toward zero for negative exponents, wrapped into a's type."""
    bits = 8 * a.dtype.itemsize
    out = []
    for x, e in zip(a.tolist(), b.tolist(), strict=True):
        # a negative power of |x| >= 2 is a fraction under 1 in magnitude; of 1 and -1, 1 or -1
        v = x**e if e >= 0 or x in (1, -1) else 0
        out.append(int(v) % (1 << bits))
    return np.array(out, dtype=np.uint64).astype(a.dtype)


def test_int64_power_by_uint64_exponents_is_exact() -> None:
    """An int64 base with a uint64 exponent (a pair the spec allows): the exact power, as with an int64
    exponent. numpy promotes int64 ** uint64 to float64: 3 ** 39 came out 4052555153018976256, not
    4052555153018976267, and a power past 2 ** 63 was INT_MIN instead of wrapping as the others."""
    a = np.array([3, 7, 2, -3, 10, 5, 3, -1, 0, 1], np.int64)
    b = np.array([39, 22, 62, 39, 18, 27, 40, 63, 5, 1 << 63], np.uint64)
    model = _model([h.make_node("Pow", ["a", "b"], ["y"])], {"a": a, "b": b}, ["y"])
    _assert_same(_ours(model, {"a": a, "b": b})[0], _exact_powers(a, b), "Pow int64 ** uint64")


@pytest.mark.parametrize("dt", [np.int32, np.int64])
def test_integer_powers_stay_exact_beside_negative_exponents(dt: type) -> None:
    """A negative exponent somewhere in the tensor no longer takes every element through float64: the
    other powers stay exact and wrap as they do without it (3 ** 39 in int64 was 4052555153018976256 once a
    -1 sat beside it, an int32 power past 2 ** 31 INT_MIN); the negative ones are truncated as before, as
    onnxruntime does."""
    a = np.array([3, 7, 2, 1, -1, -1, 5, 3, -2], dt)
    b = np.array([39 if dt is np.int64 else 19, 22, -1, -3, -3, -4, 2, 20, -1], dt)
    model = _model([h.make_node("Pow", ["a", "b"], ["y"])], {"a": a, "b": b}, ["y"])
    (got,) = _ours(model, {"a": a, "b": b})
    _assert_same(got, _exact_powers(a, b), f"Pow {np.dtype(dt).name}")
    neg = b < 0
    assert np.array_equal(got[neg], _ort_run(model, {"a": a, "b": b})[0][neg])


# ------------------------------------------------------------------------------ the zero of a string tensor


def test_trilu_and_center_crop_pad_of_strings_fill_with_empty_strings() -> None:
    """Trilu's "set to zero" and CenterCropPad's padding (a Pad in its function body, whose default for
    strings is the empty string) give "" in a string tensor. Both filled with the integer 0 (numpy's zero
    of an object array, as onnx.reference does; onnxruntime has neither op for strings), a tensor no string
    op downstream could read: StringConcat of the result failed."""
    x = np.array([["a", "b", "c"], ["d", "é", "f"]], dtype=object)
    concat = h.make_node("StringConcat", ["y", "y"], ["z"])
    for node, want in (
        (h.make_node("Trilu", ["x"], ["y"]), [["a", "b", "c"], ["", "é", "f"]]),
        (h.make_node("Trilu", ["x", "k"], ["y"], upper=0), [["a", "b", ""], ["d", "é", "f"]]),
        (h.make_node("CenterCropPad", ["x", "s"], ["y"]), [["a", "b", "c", ""], ["d", "é", "f", ""],
                                                           ["", "", "", ""]]),
    ):
        feeds = {"x": x, "k": np.array(1, np.int64)} if "k" in node.input else {"x": x}
        if node.op_type == "CenterCropPad":
            feeds["s"] = np.array([3, 4], np.int64)
        got, doubled = _ours(_model([node, concat], feeds, ["y", "z"]), feeds)
        assert got.tolist() == want, node.op_type
        assert doubled.tolist() == [[s + s for s in row] for row in want], node.op_type


def test_opset8_scan_pads_string_outputs_with_empty_strings() -> None:
    """Scan before opset 9 pads each batch entry's scan outputs past its sequence length: with "" for a
    string output, as onnxruntime does (the integer 0 before, as for the number types)."""
    s = h.make_tensor_value_info
    copies = [h.make_node("Identity", ["x_in"], ["s_out"]), h.make_node("Identity", ["x_in"], ["y_out"])]
    body = h.make_graph(copies, "body", [s("s_in", T.STRING, []), s("x_in", T.STRING, [])],
                        [s("s_out", T.STRING, []), s("y_out", T.STRING, [])])
    node = h.make_node("Scan", ["lens", "s", "x"], ["s_end", "ys"], body=body, num_scan_inputs=1)
    g = h.make_graph([node], "g", [s("lens", T.INT64, [2]), s("s", T.STRING, [2]), s("x", T.STRING, [2, 3])],
                     [s("s_end", T.STRING, [2]), s("ys", T.STRING, [2, 3])])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 8)], ir_version=7).SerializeToString()
    feeds = {"lens": np.array([3, 1], np.int64), "s": np.array(["p", "q"], dtype=object),
             "x": np.array([["a", "b", "c"], ["d", "e", "f"]], dtype=object)}
    got = _ours(model, feeds)
    assert got[1].tolist() == [["a", "b", "c"], ["d", "", ""]]
    for mine, theirs in zip(got, _ort_run(model, feeds), strict=True):
        _assert_same(mine, theirs, "Scan-8")
