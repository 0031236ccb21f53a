"""Squeeze without an axes input and Flatten keep their output shape per input shape (kernels/shape.py): the
same views as onnx.reference gives over inputs whose shapes change from run to run, and the same errors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnxtrain.engine.plan import EngineError, Plan


def _one_node(op: str, opset: int, **attrs) -> onnx.ModelProto:
    f = TensorProto.FLOAT
    g = helper.make_graph([helper.make_node(op, ["x"], ["y"], **attrs)], "g",
                          [helper.make_tensor_value_info("x", f, None)],
                          [helper.make_tensor_value_info("y", f, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


SHAPES = [(1,), (3, 1, 4), (1, 1), (3, 1, 4), (2, 5), (1, 7, 1, 2), (1,)]


@pytest.mark.parametrize("opset, attrs", [(13, {}), (11, {}), (11, {"axes": [0]}), (11, {"axes": [-1]})])
def test_squeeze_by_input_shape(opset: int, attrs: dict) -> None:
    """Every 1-sized axis (no axes), or the attribute's axes before opset 13: reference's shapes and values,
    a view of the input; an axis of another size fails as the reference does."""
    m = _one_node("Squeeze", opset, **attrs)
    plan, ref = Plan(m), ReferenceEvaluator(m)
    rng = np.random.default_rng(0)
    for shape in SHAPES:
        x = rng.standard_normal(shape).astype(np.float32)
        try:
            want = ref.run(None, {"x": x})[0]
        except Exception:
            with pytest.raises(EngineError, match="cannot squeeze"):
                plan.run({"x": x})
            continue
        got = plan.run({"x": x})[0]
        assert got.shape == want.shape and np.shares_memory(got, x) and got.tobytes() == want.tobytes()


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -3])
def test_flatten_by_input_shape(axis: int) -> None:
    """Flatten at ``axis`` over inputs of several shapes and ranks: reference's 2-D shapes, views of the
    input; an axis outside the rank fails naming it."""
    m = _one_node("Flatten", 13, axis=axis)
    plan, ref = Plan(m), ReferenceEvaluator(m)
    rng = np.random.default_rng(1)
    for shape in [(4, 3, 2), (2, 3), (4, 3, 2), (1, 2, 3, 4), (0, 3, 2), (2, 3)]:
        x = rng.standard_normal(shape).astype(np.float32)
        if not -len(shape) <= axis <= len(shape):
            with pytest.raises(EngineError, match=f"Flatten axis {axis} is out of range"):
                plan.run({"x": x})
            continue
        got = plan.run({"x": x})[0]
        if x.size:
            want = ref.run(None, {"x": x})[0]
            assert np.shares_memory(got, x)
        else:  # (the reference cannot reshape an empty input into (0, -1))
            a = axis % len(shape) if axis < 0 else axis
            want = x.reshape(int(np.prod(shape[:a])), int(np.prod(shape[a:])))
        assert got.shape == want.shape and got.tobytes() == want.tobytes()
