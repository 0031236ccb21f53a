"""Binary elementwise kernels on small operands call their ufunc directly (kernels/elementwise.py
``SMALL_OPERANDS``): the values of numpy's ufunc (float16 pairs of the rounded-once ops through float32), the
same as operands past that size take the spread and buffered route."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from onnxtrain.engine.kernels import elementwise
from onnxtrain.engine.plan import Plan


def _run(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dt = helper.np_dtype_to_tensor_dtype
    out_type = dt(np.dtype(bool)) if op in ("Equal", "Greater") else dt(a.dtype)
    g = helper.make_graph([helper.make_node(op, ["a", "b"], ["y"])], "g",
                          [helper.make_tensor_value_info("a", dt(a.dtype), None),
                           helper.make_tensor_value_info("b", dt(b.dtype), None)],
                          [helper.make_tensor_value_info("y", out_type, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return Plan(m).run({"a": a, "b": b})[0]


def _oracle(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    fn = {"Add": np.add, "Mul": np.multiply, "Sub": np.subtract, "Equal": np.equal, "Greater": np.greater}[op]
    if a.dtype == b.dtype == np.float16 and op in ("Add", "Mul", "Sub"):  # rounded once, from float32
        return fn(a.astype(np.float32), b.astype(np.float32)).astype(np.float16)
    return np.asarray(fn(a, b))


@pytest.mark.parametrize("op", ["Add", "Mul", "Sub", "Equal", "Greater"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int64])
@pytest.mark.parametrize("shapes", [((64,), ()), ((64, 1), (1, 10)), ((), ()), ((3, 4), (3, 4)),
                                    ((182, 1), (1, 182)), ((8, 64, 64), (64, 1)), ((0, 3), (3,))])
def test_small_and_large_binary_operands(op: str, dtype, shapes) -> None:
    """Below and past SMALL_OPERANDS (182 · 182 values: past it; 8 · 64 · 64 against 64 rows: past it, a
    broadcast numpy's buffer walks), NaN, ±inf and -0.0 among float values: the ufunc's bits, as arrays."""
    rng = np.random.default_rng(len(shapes[0]))
    a, b = ((rng.standard_normal(s) * 4).astype(dtype) for s in shapes)
    if np.dtype(dtype).kind == "f" and a.size >= 4:
        a.reshape(-1)[:4] = [np.nan, np.inf, -0.0, -np.inf]
    small = a.size * b.size < elementwise.SMALL_OPERANDS
    assert small == (shapes[0] not in ((182, 1), (8, 64, 64)))
    got, want = _run(op, a, b), _oracle(op, a, b)
    assert type(got) is np.ndarray and got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int64, np.bool_])
@pytest.mark.parametrize("shapes", [((64,), (), ()), ((64, 1), (1, 10), (64, 10)), ((), (3,), ()),
                                    ((8192,), (8192,), ()), ((64, 128), (64, 128), (1,))])
def test_where_small_and_large(dtype, shapes) -> None:
    """Where below SELECT_MASK_MIN values calls np.where itself, past it selects by bit masks: np.where's
    values and type either way (NaN and -0.0 among float values, broadcast conditions and branches)."""
    rng = np.random.default_rng(sum(map(len, shapes)))
    c = rng.random(shapes[0]) < 0.5
    a, b = ((rng.standard_normal(s) * 4).astype(dtype) for s in shapes[1:])
    if np.dtype(dtype).kind == "f" and a.size >= 2:
        a.reshape(-1)[:2] = [np.nan, -0.0]
    t = helper.np_dtype_to_tensor_dtype
    g = helper.make_graph([helper.make_node("Where", ["c", "a", "b"], ["y"])], "g",
                          [helper.make_tensor_value_info(n, t(v.dtype), None)
                           for n, v in (("c", c), ("a", a), ("b", b))],
                          [helper.make_tensor_value_info("y", t(a.dtype), None)])
    plan = Plan(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    got = plan.run({"c": c, "a": a, "b": b})[0]
    want = np.where(c, a, b)
    assert type(got) is np.ndarray and got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()
