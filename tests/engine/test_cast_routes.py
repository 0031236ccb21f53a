"""Cast between plain numpy types by astype alone (kernels/elementwise.py ``_plain_cast``): onnx.reference's
values and types for every pair of bool, integer and float types, over values each target can hold; the
routes cast_to treats otherwise (float16, float to integer, float8) keep it."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

from onnxtrain.engine.kernels import elementwise
from onnxtrain.engine.plan import Plan

TYPES = [np.bool_, np.int8, np.uint8, np.int32, np.int64, np.uint64, np.float16, np.float32, np.float64]


def _cast_model(src, dst):
    t = helper.np_dtype_to_tensor_dtype
    g = helper.make_graph([helper.make_node("Cast", ["x"], ["y"], to=t(np.dtype(dst)))], "g",
                          [helper.make_tensor_value_info("x", t(np.dtype(src)), None)],
                          [helper.make_tensor_value_info("y", t(np.dtype(dst)), None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])


@pytest.mark.parametrize("src", TYPES)
@pytest.mark.parametrize("dst", TYPES)
def test_cast_pairs_match_the_reference(src, dst) -> None:
    values = np.array([0, 1, 2, 5, 7, 100, 127], np.float64)
    if np.dtype(src).kind == "f" and np.dtype(dst).kind != "f":
        values = values + 0.25  # (truncated toward zero)
    if np.dtype(src).kind == "f":
        values = np.concatenate([values, [-0.0, 3.5e4]]) if np.dtype(dst).kind == "f" else values
        if np.dtype(dst).kind == "f" and np.dtype(src).itemsize >= np.dtype(dst).itemsize:
            values = np.concatenate([values, [np.nan, np.inf, -np.inf, 1 / 3]])
    if np.dtype(src) == np.bool_ or np.dtype(dst) == np.bool_:
        values = np.array([0, 1, 0, 1])
    x = values.astype(src).reshape(-1, 1)
    m = _cast_model(src, dst)
    plan = Plan(m)
    for _ in range(2):  # (the route is decided at the first run)
        got = plan.run({"x": x})[0]
        want = ReferenceEvaluator(m).run(None, {"x": x})[0]
        assert got.dtype == want.dtype == np.dtype(dst) and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
    to = helper.np_dtype_to_tensor_dtype(np.dtype(dst))
    plain = elementwise._plain_cast(np.dtype(src), to, np.dtype(dst))
    kinds = np.dtype(src).kind + np.dtype(dst).kind
    assert plain == (src is not dst and np.float16 not in (src, dst) and kinds not in ("fb", "fi", "fu"))
