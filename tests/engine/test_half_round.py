"""Rounding float32 to float16 values without leaving float32 (half_cast.round_to_half) against numpy's
casts, bit for bit; the fused float16 MatMul + bias Add that uses it against numpy's float16 add of the
rounded product."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.engine.kernels import half_cast
from onnxtrain.engine.kernels.matmul import half_product_plus
from onnxtrain.inference import InferenceSession


def _via_numpy(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return x.astype(np.float16).astype(np.float32)


def _rounds_as_numpy(x: np.ndarray) -> None:
    y = np.ascontiguousarray(x, dtype=np.float32).copy()
    assert half_cast.round_to_half(y)
    np.testing.assert_array_equal(y.view(np.uint32), _via_numpy(x).view(np.uint32))


def test_every_float16_value_the_ties_between_neighbours_and_their_neighbours() -> None:
    h = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    pos = np.unique(np.abs(h[np.isfinite(h)].astype(np.float64)))
    pos = pos[pos < 2.0**15]  # the route's domain
    mids = ((pos[:-1] + pos[1:]) / 2).astype(np.float32)  # exact: 12 significant bits at most
    near = [np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(1e9))]
    edges = np.float32([2.0**-14, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001, 2.0**-26, 1e-40, 1e-45, 0,
                        32767.99, 2.0**15 - 8, 2.0**15 - 16])
    x = np.concatenate([pos.astype(np.float32), mids, *near, edges])
    _rounds_as_numpy(np.concatenate([x, -x]))


@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e-5, 1e-7, 3e3])
@pytest.mark.parametrize("n", [1, 1000, half_cast.ROUND_BLOCK + 17, 3 * half_cast.ROUND_BLOCK])
def test_random_values_over_blocks(scale: float, n: int) -> None:
    x = (np.random.default_rng(n).standard_normal(n) * scale).astype(np.float32)
    _rounds_as_numpy(x)
    _rounds_as_numpy(x.reshape(-1, 1) if n > 1 else x)


def test_random_bit_patterns_and_blocks_without_small_values() -> None:
    bits = np.random.default_rng(3).integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    _rounds_as_numpy(x[np.abs(x) < 2.0**15])
    _rounds_as_numpy(x[(np.abs(x) < 2.0**15) & (np.abs(x) >= 2.0**-14)])  # the path with no small values


def test_empty() -> None:
    assert half_cast.round_to_half(np.empty(0, np.float32))


@pytest.mark.parametrize("special", [2.0**15, 65519.0, 65520.0, 1e6, np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("at", [3, half_cast.ROUND_BLOCK + 3])  # in the first block, or after one rounded
def test_refuses_what_may_overflow_and_narrows_the_same_after(special: float, at: int) -> None:
    x = np.random.default_rng(1).standard_normal(2 * half_cast.ROUND_BLOCK).astype(np.float32)
    x[at] = special
    y = x.copy()
    assert not half_cast.round_to_half(y)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(y.astype(np.float16).view(np.uint16),
                                      x.astype(np.float16).view(np.uint16))


def _bias_model(a: list[int], b: list[int], bias: list[int], y: list[int]) -> onnx.ModelProto:
    h = TensorProto.FLOAT16
    nodes = [helper.make_node("MatMul", ["a", "b"], ["p"]), helper.make_node("Add", ["p", "bias"], ["y"])]
    ins = [helper.make_tensor_value_info(n, h, s) for n, s in (("a", a), ("b", b), ("bias", bias))]
    g = helper.make_graph(nodes, "matmul_bias", ins, [helper.make_tensor_value_info("y", h, y)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _oracle(a: np.ndarray, b: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """The MatMul's float16 product (float32 sums, rounded once), then numpy's own float16 add."""
    with np.errstate(all="ignore"):
        return np.add(np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(np.float16), bias)


@pytest.mark.parametrize("scale", [1.0, 1e-3, 100.0])  # subnormal products; sums past 2^15 and inf
def test_fused_float16_matmul_bias_against_numpys_float16_add(scale: float) -> None:
    rng = np.random.default_rng(int(scale * 1000))
    a = (rng.standard_normal((64, 32, 128)) * scale).astype(np.float16)
    b = (rng.standard_normal((128, 96)) * 0.3).astype(np.float16)
    bias = (rng.standard_normal(96) * scale).astype(np.float16)
    bias[5] = -0.0
    sess = InferenceSession(_bias_model([64, 32, 128], [128, 96], [96], [64, 32, 96]).SerializeToString())
    assert [st.node.op_type for st in sess._plan.steps] == ["FusedMatMulAdd"]
    for _ in range(2):
        (ours,) = sess.run(None, {"a": a, "b": b, "bias": bias})
        np.testing.assert_array_equal(ours.view(np.uint16), _oracle(a, b, bias).view(np.uint16))
    direct = half_product_plus(a, b, bias)
    np.testing.assert_array_equal(direct.view(np.uint16), _oracle(a, b, bias).view(np.uint16))


def test_fused_float16_matmul_bias_with_nan_and_inf_operands() -> None:
    rng = np.random.default_rng(2)
    a = rng.standard_normal((40, 16)).astype(np.float16)
    b = rng.standard_normal((16, 24)).astype(np.float16)
    bias = rng.standard_normal((1, 24)).astype(np.float16)
    a[3, 2], bias[0, 7], bias[0, 8] = np.nan, np.inf, -np.inf
    y = half_product_plus(a, b, bias)
    np.testing.assert_array_equal(y.view(np.uint16), _oracle(a, b, bias).view(np.uint16))


def test_fused_float16_matmul_bias_declines_what_it_does_not_cover() -> None:
    a = np.ones((4, 8), np.float16)
    b = np.ones((8, 3), np.float16)
    assert half_product_plus(a, b, np.ones((5, 4, 3), np.float16)) is None  # the bias grows the shape
    assert half_product_plus(a, b, np.ones(3, np.float32)) is None  # not all float16
