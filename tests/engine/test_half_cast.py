"""float16 work through float32 (engine/kernels/half_cast.py) against numpy's own float16 casts and loops, bit
for bit: every float16, every rounding tie between float16 neighbours, the subnormal range, random values;
the inputs that fall back to numpy (infinities, NaNs, overflow, small arrays); the kernels and fused clusters
that take the routes, the float16 ReLU table and comparisons, against onnx.reference."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnxtrain.engine.kernels import half_cast
from onnxtrain.inference import InferenceSession


def _bits16(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).view(np.uint16)


def _narrow_matches(x: np.ndarray) -> None:
    with np.errstate(all="ignore"):
        expected = x.astype(np.float16)
    ours = half_cast.narrow(x)
    assert ours.shape == x.shape and ours.dtype == np.float16
    np.testing.assert_array_equal(_bits16(ours), _bits16(expected))


def _all_halves() -> np.ndarray:
    return np.arange(1 << 16, dtype=np.uint16).view(np.float16)


def test_widen_every_float16() -> None:
    h = _all_halves()
    for part in (h, h[np.isfinite(h)]):  # the second takes the fast route (no inf or NaN)
        ours = half_cast.widen(part).view(np.uint32)
        np.testing.assert_array_equal(ours, part.astype(np.float32).view(np.uint32))


def test_narrow_every_float16_value_and_the_ties_between_neighbours() -> None:
    h = _all_halves()
    finite = h[np.isfinite(h)].astype(np.float64)
    pos = np.unique(np.abs(finite))
    mids = (pos[:-1] + pos[1:]) / 2  # exactly representable in float32: 12 significant bits at most
    m32 = mids.astype(np.float32)
    assert np.array_equal(m32.astype(np.float64), mids)
    edges = [65504, 65519.996, 2.0**-14, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001, 2.0**-26, 1e-40, 0]
    below, above = np.nextafter(m32, np.float32(0)), np.nextafter(m32, np.float32(1e9))
    cases = [pos.astype(np.float32), m32, below, above, np.float32(edges)]
    x = np.concatenate(cases)
    _narrow_matches(np.concatenate([x, -x]))


@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e-5, 1e-7, 3e3])
def test_narrow_random_values(scale: float) -> None:
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((300, 401)) * scale).astype(np.float32)
    _narrow_matches(x)
    _narrow_matches(x[:, ::3])  # a strided view
    _narrow_matches(x.T)


def test_narrow_random_bit_patterns() -> None:
    bits = np.random.default_rng(3).integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[np.abs(x) < 65520]  # NaN and infinities out: this array takes the fast route
    _narrow_matches(x)


@pytest.mark.parametrize("special", [np.inf, -np.inf, np.nan, 65520.0, 1e6])
def test_arrays_with_specials_take_numpys_cast(special: float) -> None:
    x = np.linspace(-3, 3, 50_000, dtype=np.float32)
    x[12_345] = special
    x[40_000] = -np.float32(special)
    _narrow_matches(x)
    nan_payload = np.array([0x7F800001, 0x7FC00123, 0xFFA00000], np.uint32).view(np.float32)
    _narrow_matches(np.concatenate([x, nan_payload]))
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)  # infinities or NaNs: widen takes numpy's cast too
    np.testing.assert_array_equal(half_cast.widen(h).view(np.uint32), h.astype(np.float32).view(np.uint32))


def test_overflow_warns_as_numpy_does() -> None:
    x = np.full(50_000, 1.0, np.float32)
    x[7] = 1e6
    with np.errstate(over="warn"), pytest.warns(RuntimeWarning, match="overflow"):
        y = half_cast.narrow(x)
    assert np.isinf(y[7]) and y[0] == 1
    with np.errstate(over="ignore"), warnings.catch_warnings():
        warnings.simplefilter("error")
        half_cast.narrow(x)


@pytest.mark.parametrize("n", [0, 1, 100, half_cast.NARROW_MIN - 1, half_cast.NARROW_MIN, half_cast.WIDEN_MIN,
                               half_cast.BLOCK + 5])
def test_every_size(n: int) -> None:
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32) * np.float32(1e-4)
    _narrow_matches(x)
    h = x.astype(np.float16)
    np.testing.assert_array_equal(half_cast.widen(h).view(np.uint32), h.astype(np.float32).view(np.uint32))


def _half_op(op: str, a: list[int], b: list[int], y: list[int]) -> onnx.ModelProto:
    """A one-node float16 model ``y = op(a, b)`` of these shapes."""
    h = TensorProto.FLOAT16
    g = helper.make_graph([helper.make_node(op, ["a", "b"], ["y"])], op.lower(),
                          [helper.make_tensor_value_info(n, h, shape) for n, shape in (("a", a), ("b", b))],
                          [helper.make_tensor_value_info("y", h, y)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])


def _run_both(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> tuple[list, list]:
    onnx.checker.check_model(model, full_check=True)
    ours = InferenceSession(model.SerializeToString()).run(None, feeds)
    return ours, ReferenceEvaluator(model).run(None, feeds)


def test_cast_kernel_both_ways_against_onnx_reference() -> None:
    x = (np.random.default_rng(0).standard_normal((256, 300)) * 1e-4).astype(np.float32)
    nodes = [helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
             helper.make_node("Cast", ["h"], ["y"], to=TensorProto.FLOAT)]
    g = helper.make_graph(nodes, "casts", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [256, 300])],
                          [helper.make_tensor_value_info("h", TensorProto.FLOAT16, [256, 300]),
                           helper.make_tensor_value_info("y", TensorProto.FLOAT, [256, 300])])
    ours, ref = _run_both(helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)]), {"x": x})
    for a, b in zip(ours, ref):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("op", ["Gemm", "MatMul"])
def test_half_products_against_onnx_reference(op: str) -> None:
    rng = np.random.default_rng(1)
    a = (rng.standard_normal((64, 300)) * 0.05).astype(np.float16)
    b = (rng.standard_normal((300, 200)) * 0.05).astype(np.float16)
    (ours,), (ref,) = _run_both(_half_op(op, [64, 300], [300, 200], [64, 200]), {"a": a, "b": b})
    assert ours.dtype == np.float16
    # the reference multiplies float16 in numpy's own loops: sums rounded at every step, not once
    np.testing.assert_allclose(ours.astype(np.float32), ref.astype(np.float32), rtol=2e-2, atol=2e-3)
    exact = np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(np.float16)
    np.testing.assert_array_equal(_bits16(ours), _bits16(exact))


def test_half_einsum_rounds_the_float32_product_once() -> None:
    rng = np.random.default_rng(8)
    a = (rng.standard_normal((64, 300)) * 0.05).astype(np.float16)  # the fast routes both ways
    b = (rng.standard_normal((300, 200)) * 0.05).astype(np.float16)
    h = TensorProto.FLOAT16
    g = helper.make_graph([helper.make_node("Einsum", ["a", "b"], ["y"], equation="ij,jk->ik")], "einsum",
                          [helper.make_tensor_value_info(n, h, shape) for n, shape in (("a", [64, 300]),
                                                                                    ("b", [300, 200]))],
                          [helper.make_tensor_value_info("y", h, [64, 200])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    (ours,), (ref,) = _run_both(model, {"a": a, "b": b})
    exact = np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(np.float16)
    np.testing.assert_array_equal(_bits16(ours), _bits16(exact))
    np.testing.assert_allclose(ours.astype(np.float32), ref.astype(np.float32), rtol=2e-2, atol=2e-3)


def test_half_reduce_sum_accumulates_in_float32() -> None:
    # 32 K values: the fast widen
    x = (np.random.default_rng(2).standard_normal((64, 512)) * 1e-3).astype(np.float16)
    g = helper.make_graph([helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)], "bias_grad",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [64, 512])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [512])],
                          [helper.make_tensor("axes", TensorProto.INT64, [1], [0])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    (ours,), (ref,) = _run_both(model, {"x": x})
    in_single = x.astype(np.float32).sum(axis=0).astype(np.float16)
    np.testing.assert_array_equal(_bits16(ours), _bits16(in_single))
    np.testing.assert_allclose(ours.astype(np.float32), ref.astype(np.float32), rtol=1e-2, atol=1e-4)


def test_half_erf_rounds_the_float32_erf_once() -> None:
    import math

    from onnxtrain.engine.kernels.elementwise import _erf32, erf

    x = np.random.default_rng(4).uniform(-4, 4, 40_000).astype(np.float16)  # the fast routes both ways
    got = erf(x)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(_bits16(got), _bits16(_erf32(x.astype(np.float32)).astype(np.float16)))
    want = np.array([math.erf(v) for v in x[:2000].astype(np.float64)])
    np.testing.assert_allclose(got[:2000].astype(np.float64), want, atol=1e-3)


def _half_chain_model(n: int, with_nan_input: bool = False) -> onnx.ModelProto:
    """A float16 chain the engine fuses into one cluster: ((x / c + y) * x - y) / sqrt(x * x + c)."""
    h = TensorProto.FLOAT16
    nodes = [helper.make_node("Div", ["x", "c"], ["a"]), helper.make_node("Add", ["a", "y"], ["b"]),
             helper.make_node("Mul", ["b", "x"], ["d"]), helper.make_node("Sub", ["d", "y"], ["e"]),
             helper.make_node("Mul", ["x", "x"], ["f"]), helper.make_node("Add", ["f", "c"], ["g"]),
             helper.make_node("Sqrt", ["g"], ["r"]), helper.make_node("Div", ["e", "r"], ["z"])]
    c = helper.make_tensor("c", h, [], np.array(1.3, np.float16).view(np.uint16).tolist(), raw=False)
    g = helper.make_graph(nodes, "half_chain", [helper.make_tensor_value_info("x", h, [n]),
                                               helper.make_tensor_value_info("y", h, [n])],
                          [helper.make_tensor_value_info("z", h, [n])], [c])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])


@pytest.mark.parametrize("n", [300, 40_000, 3_000_000])  # small: numpy's loops; large: blocked, threaded
def test_half_cluster_has_numpys_float16_bits(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = half_cast.ViaSingle.__call__

    def counted(self, *args, out=None):
        calls.append(max(a.size for a in args))
        return original(self, *args, out=out)

    monkeypatch.setattr(half_cast.ViaSingle, "__call__", counted)
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 3).astype(np.float16)
    y = (rng.standard_normal(n) * 1e-3).astype(np.float16)  # subnormal sums and products too
    model = _half_chain_model(n)
    sess = InferenceSession(model.SerializeToString())
    for _ in range(2):  # the first run traces the cluster, the second runs its program
        (ours,) = sess.run(None, {"x": x, "y": y})
    (ref,) = ReferenceEvaluator(model).run(None, {"x": x, "y": y})  # numpy's float16 loops, op by op
    np.testing.assert_array_equal(_bits16(ours), _bits16(ref))
    assert any(size >= half_cast.VIA_SINGLE_MIN for size in calls) == (n >= half_cast.VIA_SINGLE_MIN)
    x[5], y[7] = np.inf, np.nan  # numpy's loops for the ops that meet them: the same bits again
    (ours,) = sess.run(None, {"x": x, "y": y})
    (ref,) = ReferenceEvaluator(model).run(None, {"x": x, "y": y})
    np.testing.assert_array_equal(_bits16(ours), _bits16(ref))


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
def test_half_binary_kernels_have_numpys_float16_bits(op: str) -> None:
    rng = np.random.default_rng(5)
    a = (rng.standard_normal((64, 512)) * 3).astype(np.float16)
    b = (rng.standard_normal((1, 512)) * 1e-2).astype(np.float16)  # broadcast, subnormal results too
    b[0, 3] = 0  # Div: quotients ±inf, which the route back hands to numpy's cast
    model = _half_op(op, [64, 512], [1, 512], [64, 512])
    for bb in (b, np.where(b == 0, np.float16(0.5), b)):
        (ours,), (ref,) = _run_both(model, {"a": a, "b": bb})
        np.testing.assert_array_equal(_bits16(ours), _bits16(ref))


def test_half_dropout_scales_in_float32_once() -> None:
    from onnxtrain.engine.kernels.loss import dropout
    from onnxtrain.engine.registry import Attrs

    x = np.random.default_rng(6).standard_normal((64, 512)).astype(np.float16)
    attrs = Attrs({"seed": 3}, op="Dropout", opset=19, n_outputs=2, output_used=(True, True))
    y, mask = dropout([x, np.array(0.1, np.float32), np.array(True)], attrs)
    want = (x.astype(np.float32) * np.float32(1 / 0.9) * mask).astype(np.float16)
    assert 0.05 < 1 - mask.mean() < 0.15
    np.testing.assert_array_equal(_bits16(y), _bits16(want))


def test_half_relu_table_gives_clips_bits_for_every_float16() -> None:
    from onnxtrain.engine.kernels.clamp import clip_ufunc, relu_into

    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16)  # NaNs of both signs, -0.0, subnormals
    with np.errstate(all="ignore"):
        want = clip_ufunc(every, np.float16(0), np.float16(np.inf))
    np.testing.assert_array_equal(_bits16(relu_into(every)), _bits16(want))
    x = every.reshape(256, 256).copy()
    assert relu_into(x, out=x) is x  # in place, as the fused ReLU calls it
    np.testing.assert_array_equal(_bits16(x).reshape(-1), _bits16(want))


@pytest.mark.parametrize("op", ["Greater", "Less", "Equal", "GreaterOrEqual", "LessOrEqual"])
def test_half_comparisons_against_onnx_reference(op: str) -> None:
    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16).reshape(256, 256)  # inf, NaN, ±0 too
    h, b = TensorProto.FLOAT16, np.float16([[0.0], [-0.0], [np.inf], [np.nan], [1.5]] * 51 + [[3]])
    g = helper.make_graph([helper.make_node(op, ["a", "b"], ["y"])], "compare",
                          [helper.make_tensor_value_info("a", h, [256, 256]),
                           helper.make_tensor_value_info("b", h, [256, 1])],
                          [helper.make_tensor_value_info("y", TensorProto.BOOL, [256, 256])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    (ours,), (ref,) = _run_both(model, {"a": every, "b": b})
    np.testing.assert_array_equal(ours, ref)


_ONE_VALUES = [0.0, -0.0, 1.0, 0.5, 1.4142, -3.0, 65504.0, 6e-8, np.inf, -np.inf, np.nan]


@pytest.mark.parametrize("ufunc", [np.add, np.subtract, np.multiply, np.divide], ids=lambda u: u.__name__)
def test_one_value_operand_by_table_has_numpys_float16_bits(ufunc: np.ufunc) -> None:
    """A float16 op with a single-value operand (either side, of shape (), (1,) or (1, 1)) is a lookup in
    numpy's own float16 results: every float16 pattern, infinities and NaNs (their payloads) either side."""
    every = np.tile(np.arange(1 << 16, dtype=np.uint16), 2).view(np.float16)  # over SCALAR_TABLE_MIN
    assert every.size >= half_cast.SCALAR_TABLE_MIN
    op = half_cast.ViaSingle(ufunc)
    for v in _ONE_VALUES:
        for shape in [(), (1,), (1, 1)]:
            value = np.full(shape, v, np.float16)
            for args in [(every, value), (value, every)]:
                with np.errstate(all="ignore"):
                    want = ufunc(*args)
                got = op(*args)
                assert got.shape == want.shape and got.dtype == np.float16
                np.testing.assert_array_equal(_bits16(got), _bits16(want))
    out = every.copy()  # into an operand's own memory
    with np.errstate(all="ignore"):
        want = ufunc(every, np.float16(0.5))
    assert op(out, np.array(0.5, np.float16), out=out) is out
    np.testing.assert_array_equal(_bits16(out), _bits16(want))


def test_one_value_tables_are_made_only_for_large_operations(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new single value below SCALAR_TABLE_MIN values takes the float32 route (no table made), once made its
    table serves smaller operations too; the tables kept are bounded."""
    monkeypatch.setattr(half_cast, "_scalar_tables", {})
    op = half_cast.ViaSingle(np.multiply)
    x = np.random.default_rng(5).standard_normal(20_000).astype(np.float16)
    value = np.array(0.3, np.float16)
    np.testing.assert_array_equal(_bits16(op(x, value)), _bits16(x * value))
    assert not half_cast._scalar_tables
    big = np.resize(x, half_cast.SCALAR_TABLE_MIN)
    np.testing.assert_array_equal(_bits16(op(big, value)), _bits16(big * value))
    assert len(half_cast._scalar_tables) == 1
    np.testing.assert_array_equal(_bits16(op(x, value)), _bits16(x * value))
    for k in range(half_cast.SCALAR_TABLES + 1):
        v = np.array(k + 2, np.float16)
        np.testing.assert_array_equal(_bits16(op(big, v)), _bits16(big * v))
    assert len(half_cast._scalar_tables) <= half_cast.SCALAR_TABLES


def test_half_sqrt_and_erf_by_table_for_every_float16() -> None:
    """float16 Sqrt (numpy's loop) and Erf (the float32 erf rounded once), every pattern, by their tables."""
    from onnxtrain.engine.kernels.elementwise import _erf_through_single, erf

    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    with np.errstate(all="ignore"):
        want = np.sqrt(every)
    np.testing.assert_array_equal(_bits16(half_cast.ViaSingle(np.sqrt)(every)), _bits16(want))
    np.testing.assert_array_equal(_bits16(erf(every)), _bits16(_erf_through_single(every)))
