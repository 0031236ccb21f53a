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


def _split_model(opset: int, n: int, split_input: bool, **attrs) -> onnx.ModelProto:
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    ins = [helper.make_tensor_value_info("x", f, None)]
    if split_input:
        ins.append(helper.make_tensor_value_info("s", i64, None))
    outs = [f"y{i}" for i in range(n)]
    node = helper.make_node("Split", ["x", "s"] if split_input else ["x"], outs, **attrs)
    g = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info(o, f, None) for o in outs])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("opset, split_input, attrs", [
    (13, True, {"axis": 0}), (13, False, {"axis": -1}), (11, False, {"axis": 1, "split": [1, 2]}),
    (18, False, {"axis": 0, "num_outputs": 2})])
def test_split_parts_by_input_shape_and_split(opset: int, split_input: bool, attrs: dict) -> None:
    """Split kept per input shape and split input: reference's parts (views of the input) over shapes and
    splits that change between runs; sizes that do not add up, or an uneven equal split, fail."""
    m = _split_model(opset, 2, split_input, **attrs)
    plan, ref = Plan(m), ReferenceEvaluator(m)
    rng = np.random.default_rng(2)
    cases = [((4, 3), [1, 3]), ((6, 3), [2, 4]), ((4, 3), [3, 1]), ((4, 3), [1, 3]), ((5, 4), [2, 2]),
             ((3, 3), [1, 2])]
    for shape, sizes in cases:
        feeds = {"x": rng.standard_normal(shape).astype(np.float32)}
        if split_input:
            feeds["s"] = np.array(sizes, np.int64)
        dim = shape[attrs["axis"]]
        valid = (sum(sizes) == dim if split_input else sum(attrs["split"]) == dim if "split" in attrs
                 else opset >= 18 or dim % 2 == 0)
        if not valid:  # (onnx.reference splits what it is given)
            with pytest.raises(EngineError, match="split sizes|equal parts"):
                plan.run(feeds)
            continue
        got, want = plan.run(feeds), ref.run(None, feeds)
        assert len(got) == len(want) == 2
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.tobytes() == b.tobytes() and np.shares_memory(a, feeds["x"])


@pytest.mark.parametrize("allowzero", [0, 1])
def test_reshape_by_input_shape_and_target(allowzero: int) -> None:
    """Reshape kept per input shape and target: reference's shapes over inputs and targets that change between
    runs (a 0 copying the input's dim unless allowzero, a -1 inferred), and its errors."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    g = helper.make_graph([helper.make_node("Reshape", ["x", "s"], ["y"], allowzero=allowzero)], "g",
                          [helper.make_tensor_value_info("x", f, None),
                           helper.make_tensor_value_info("s", i64, None)],
                          [helper.make_tensor_value_info("y", f, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    plan, ref = Plan(m), ReferenceEvaluator(m)
    rng = np.random.default_rng(3)
    for shape, target in [((2, 6), [3, -1]), ((2, 6), [0, 3, 2]), ((4, 6), [3, -1]), ((2, 6), [3, -1]),
                          ((2, 6), [5, -1]), ((0, 6), [0, -1]), ((2, 6), [12])]:
        feeds = {"x": rng.standard_normal(shape).astype(np.float32), "s": np.array(target, np.int64)}
        try:
            want = ref.run(None, feeds)[0]
        except Exception:
            with pytest.raises(EngineError):
                plan.run(feeds)
            continue
        got = plan.run(feeds)[0]
        assert got.shape == want.shape and got.tobytes() == want.tobytes()


@pytest.mark.parametrize("op", ["Squeeze", "Unsqueeze"])
def test_axes_input_by_input_shape_and_axes(op: str) -> None:
    """Squeeze and Unsqueeze with an axes input, kept per input shape and axes: reference's shapes and views
    over inputs and axes that change between runs (negative axes too), and the errors of bad axes."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    g = helper.make_graph([helper.make_node(op, ["x", "a"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", f, None),
                           helper.make_tensor_value_info("a", i64, None)],
                          [helper.make_tensor_value_info("y", f, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    plan, ref = Plan(m), ReferenceEvaluator(m)
    rng = np.random.default_rng(4)
    cases = [((3, 1, 4), [1]), ((1, 5, 1), [0, -1]), ((3, 1, 4), [-2]), ((3, 1, 4), [1]), ((2, 3), [0]),
             ((2, 3), [5])]
    for shape, axes in cases:
        feeds = {"x": rng.standard_normal(shape).astype(np.float32), "a": np.array(axes, np.int64)}
        rank = len(shape) + (len(axes) if op == "Unsqueeze" else 0)
        valid = all(-rank <= a < rank for a in axes) and (
            op == "Unsqueeze" or all(shape[a] == 1 for a in axes))
        if not valid:
            with pytest.raises(EngineError):
                plan.run(feeds)
            continue
        got, want = plan.run(feeds)[0], ref.run(None, feeds)[0]
        assert got.shape == want.shape and got.tobytes() == want.tobytes()
        assert np.shares_memory(got, feeds["x"])
