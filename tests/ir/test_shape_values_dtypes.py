"""The values ShapeValues reads before a run have the element types the run gives them: a Gather keeps its
data's type (a constant's own, Shape's int64, a Cast's target), and so does what is computed from it
(Concat, Unsqueeze, Add). Values and dtypes against onnx.reference runs of the same small graphs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxtrain.ir.builder import value_types
from onnxtrain.ir.shape_values import ShapeValues

X_SHAPE = (2, 300, 5)  # 300: wraps in an int8 Cast, as ONNX's Cast does


def _const(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, f"{name}_v"))


def _model(nodes: list[onnx.NodeProto], outputs: list[str], opset: int = 18) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", T.FLOAT, list(X_SHAPE))
    g = helper.make_graph(nodes, "g", [x], [helper.make_empty_tensor_value_info(o) for o in outputs])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _read_and_run(nodes: list[onnx.NodeProto], outputs: list[str],
                  opset: int = 18) -> tuple[ShapeValues, dict[str, np.ndarray]]:
    m = _model(nodes, outputs, opset)
    ran = ReferenceEvaluator(m).run(None, {"x": np.zeros(X_SHAPE, np.float32)})
    return ShapeValues(m, value_types(m), opset), dict(zip(outputs, ran))


def _same(values: ShapeValues, ran: dict[str, np.ndarray]) -> None:
    for name, want in ran.items():
        got = values.value(name)
        assert got is not None, name
        assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, want.dtype)
        np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
                                   np.uint64])
def test_gather_from_a_constant_has_the_constant_type(dtype: type) -> None:
    nodes = [
        _const("c", np.array([2, 3, 4, 5], dtype)), _const("d", np.array([7], dtype)),
        _const("i", np.array(1, np.int64)), _const("ij", np.array([3, 0], np.int64)),
        _const("axes", np.array([0], np.int64)),
        helper.make_node("Gather", ["c", "i"], ["scalar"]),
        helper.make_node("Gather", ["c", "ij"], ["pair"]),
        helper.make_node("Unsqueeze", ["scalar", "axes"], ["one"]),
        helper.make_node("Concat", ["one", "d", "pair"], ["cat"], axis=0),
        helper.make_node("Add", ["one", "d"], ["sum"]),
        helper.make_node("Mul", ["pair", "pair"], ["square"]),
        helper.make_node("Cast", ["pair"], ["wide"], to=T.INT64),
        helper.make_node("Gather", ["cat", "i"], ["again"]),
    ]
    values, ran = _read_and_run(nodes, ["scalar", "pair", "one", "cat", "sum", "square", "wide", "again"])
    assert ran["pair"].dtype == dtype and ran["wide"].dtype == np.int64
    _same(values, ran)


def test_gather_from_shape_and_through_casts() -> None:
    nodes = [
        _const("i", np.array(1, np.int64)), _const("ij", np.array([2, 0], np.int64)),
        _const("axes", np.array([0], np.int64)), _const("n32", np.array([4], np.int32)),
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "ij"], ["s_pair"]),
        helper.make_node("Cast", ["s"], ["s32"], to=T.INT32),
        helper.make_node("Gather", ["s32", "i"], ["g32"]),
        helper.make_node("Unsqueeze", ["g32", "axes"], ["u32"]),
        helper.make_node("Concat", ["u32", "n32"], ["cat32"], axis=0),  # Shape's through a Cast with int32s
        helper.make_node("Mul", ["u32", "n32"], ["prod32"]),
        helper.make_node("Cast", ["s"], ["s8"], to=T.INT8),  # 300 wraps to 44
        helper.make_node("Gather", ["s8", "ij"], ["g8"]),
        helper.make_node("Gather", ["s8", "i"], ["g8_1"]),
        helper.make_node("Cast", ["s"], ["s16u"], to=T.UINT16),
        helper.make_node("Gather", ["s16u", "i"], ["g16u"]),
        helper.make_node("Cast", ["g32"], ["back64"], to=T.INT64),
    ]
    outputs = ["s", "s_pair", "g32", "u32", "cat32", "prod32", "g8", "g8_1", "g16u", "back64"]
    values, ran = _read_and_run(nodes, outputs)
    assert ran["g8_1"].dtype == np.int8 and int(ran["g8_1"]) == 44
    _same(values, ran)


def test_gather_of_a_float_cast_is_no_integer_value() -> None:
    """A shape cast to float and gathered is a float at run time: no integer value is read for it, while the
    value cast back to int64 is read."""
    nodes = [
        _const("i", np.array(0, np.int64)),
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Cast", ["s"], ["sf"], to=T.FLOAT),
        helper.make_node("Gather", ["sf", "i"], ["gf"]),
        helper.make_node("Cast", ["gf"], ["gi"], to=T.INT64),
    ]
    values, ran = _read_and_run(nodes, ["gf", "gi"])
    assert ran["gf"].dtype == np.float32 and values.value("gf") is None
    _same(values, {"gi": ran["gi"]})


@pytest.mark.parametrize("op", ["Concat", "Add"])
def test_mixed_types_give_no_value(op: str) -> None:
    """Concat and Add of an int32 and an int64 value (a graph ONNX rejects) have no value: numpy would
    widen them to an int64 no run makes."""
    nodes = [
        _const("a", np.array([3], np.int32)), _const("b", np.array([4], np.int64)),
        helper.make_node(op, ["a", "b"], ["y"], **({"axis": 0} if op == "Concat" else {})),
    ]
    m = _model(nodes, ["y"])
    assert ShapeValues(m, {}, 18).value("y") is None


def test_slice_bounds_read_from_int32_gathers() -> None:
    """A Slice whose end is gathered from an int32 constant: its output dims as the run gives them (the
    bounds' values are the same in any type)."""
    nodes = [
        _const("c", np.array([1, 3], np.int32)), _const("i0", np.array([0], np.int64)),
        _const("i1", np.array([1], np.int64)), _const("ax", np.array([1], np.int32)),
        helper.make_node("Gather", ["c", "i0"], ["start"]),
        helper.make_node("Gather", ["c", "i1"], ["end"]),
        helper.make_node("Slice", ["x", "start", "end", "ax"], ["y"]),
        helper.make_node("Identity", ["y"], ["out"]),
    ]
    m = _model(nodes, ["out"])
    ran = ReferenceEvaluator(m).run(None, {"x": np.zeros(X_SHAPE, np.float32)})[0]
    dims = [d.dim_value for d in value_types(m)["y"].tensor_type.shape.dim]
    assert dims == list(ran.shape) == [2, 2, 5]


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64])
def test_integer_division_truncates_at_the_type_minimum(dtype: type) -> None:
    """ONNX's integer Div truncates toward zero; |min| does not fit in the type (numpy's abs of int8 -128 is
    -128), so a quotient computed through abs came out negated: -128 // 3 read as 43 instead of -42."""
    low = np.iinfo(dtype).min
    nodes = [_const("a", np.array([low, low + 1, -7, 7, low, -1, 0], dtype)),
             _const("b", np.array([3, 2, 2, -2, 1, 5, -3], dtype)),
             helper.make_node("Div", ["a", "b"], ["q"])]
    values, ran = _read_and_run(nodes, ["q"])
    _same(values, ran)


def test_division_of_the_minimum_by_minus_one_has_no_value() -> None:
    """int8 -128 / -1 overflows (C's undefined behaviour): no value rather than a wrapped guess."""
    nodes = [_const("a", np.array([-128, 4], np.int8)), _const("b", np.array([-1, 2], np.int8)),
             helper.make_node("Div", ["a", "b"], ["q"])]
    assert ShapeValues(_model(nodes, ["q"]), {}, 18).value("q") is None
