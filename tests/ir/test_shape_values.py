"""Shape values read before a run (onnxtrain/ir/shape_values.py) and the Reshape dims they give
(onnxtrain/ir/reshapes.py): against numpy on the same integers, and an unflattened projection's q, k and v
whose gradients then pad by constants (checked by finite differences)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.ir.builder import symbolic_shape, value_types
from onnxtrain.ir.shape_values import ShapeValues
from onnxtrain.testing import gradcheck, to_float64


def ints(name: str, *v: int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(v, np.int64), name)


def graph_values(nodes: list, inputs: list, inits: list,
                 opset: int = 17) -> tuple[ShapeValues, onnx.ModelProto]:
    g = helper.make_graph(nodes, "g", inputs, [], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)
    types = value_types(model)
    return ShapeValues(model, types, opset), model


@pytest.mark.parametrize("op,attrs", [("Add", {}), ("Sub", {}), ("Mul", {}), ("Div", {}), ("Mod", {}),
                                      ("Mod", {"fmod": 1})])
def test_integer_arithmetic_as_onnx_defines_it(op, attrs) -> None:
    a, b = np.array([7, -7, 7, -7, 0], np.int64), np.array([2, 2, -2, -2, 3], np.int64)
    values, _ = graph_values([helper.make_node(op, ["a", "b"], ["y"], **attrs)], [],
                             [numpy_helper.from_array(a, "a"), numpy_helper.from_array(b, "b")])
    want = {"Add": a + b, "Sub": a - b, "Mul": a * b, "Div": np.trunc(a / b).astype(np.int64),
            "Mod": np.fmod(a, b) if attrs else np.mod(a, b)}[op]
    np.testing.assert_array_equal(values.value("y"), want)


def test_shape_entries_through_slice_gather_concat_and_squeeze() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, "batch", 384])
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Add", ["minus1", "three"], ["e0"]),
        helper.make_node("Mod", ["e0", "three"], ["end"]),  # torch's way to the end of unflatten's slice
        helper.make_node("Slice", ["s", "zero", "end"], ["lead"]),
        helper.make_node("Concat", ["lead", "tail"], ["target"], axis=0),
        helper.make_node("Gather", ["s", "one_scalar"], ["b"], axis=0),
        helper.make_node("Unsqueeze", ["b", "zero"], ["b1"]),
        helper.make_node("Squeeze", ["b1", "zero"], ["b0"]),
        helper.make_node("Shape", ["x"], ["s_end"], start=-1),
        helper.make_node("Cast", ["s_end"], ["s_end32"], to=TensorProto.INT32),
    ]
    inits = [ints("minus1", -1), ints("three", 3), ints("zero", 0), ints("tail", 3, 128),
             numpy_helper.from_array(np.array(1, np.int64), "one_scalar")]
    values, _ = graph_values(nodes, [x], inits)
    assert values.dims("target") == (False, [64, "batch", 3, 128])
    assert values.value("target") is None  # not every entry is a number
    assert values.dims("b") == (True, ["batch"]) and values.dims("b1") == (False, ["batch"])
    assert values.dims("b0") == (True, ["batch"])
    np.testing.assert_array_equal(values.value("s_end32"), [384])
    np.testing.assert_array_equal(values.value("end"), [2])


def unflattened_qkv(rows: int | str = "B") -> onnx.ModelProto:
    """y = x·W (rows × 6) unflattened to (rows, 3, 2) with a computed target shape, q, k and v gathered
    from it, loss = Σ q·k·v."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["y"]),
        helper.make_node("Shape", ["y"], ["s"]),
        helper.make_node("Add", ["minus1", "two"], ["e0"]),
        helper.make_node("Mod", ["e0", "two"], ["end"]),
        helper.make_node("Slice", ["s", "zero", "end"], ["lead"]),
        helper.make_node("Concat", ["lead", "tail"], ["target"], axis=0),
        helper.make_node("Reshape", ["y", "target"], ["y3"]),
        *[helper.make_node("Gather", ["y3", f"i{k}"], [f"g{k}"], axis=1) for k in range(3)],
        helper.make_node("Mul", ["g0", "g1"], ["m"]),
        helper.make_node("Mul", ["m", "g2"], ["m2"]),
        helper.make_node("ReduceSum", ["m2"], ["loss"], keepdims=0),
    ]
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 6)).astype(np.float32), "W"),
             ints("minus1", -1), ints("two", 2), ints("zero", 0), ints("tail", 3, 2),
             *[numpy_helper.from_array(np.array(k, np.int64), f"i{k}") for k in range(3)]]
    g = helper.make_graph(nodes, "qkv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, 4])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_reshape_to_a_computed_target_and_its_minus_one() -> None:
    types = value_types(unflattened_qkv())
    assert symbolic_shape(types, "y3") == ["B", 3, 2]
    assert symbolic_shape(types, "g1") == ["B", 2]
    # constant targets with a -1: read as the input's one name left over, else unknown
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 6])
    nodes = [helper.make_node("Reshape", ["y", f"t{k}"], [f"r{k}"]) for k in (1, 2, 3)]
    g = helper.make_graph(nodes, "r", [y], [], [ints("t1", -1, 3, 2), ints("t2", 0, -1), ints("t3", -1)])
    types = value_types(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9))
    assert symbolic_shape(types, "r1") == ["B", 3, 2]
    assert symbolic_shape(types, "r2") == ["B", 6]
    r3 = symbolic_shape(types, "r3")
    assert len(r3) == 1 and (r3[0] is None or r3[0].startswith("unk__"))  # B·6: no one name


def test_unflattened_qkv_gradient_pads_by_constants_and_is_right() -> None:
    model = unflattened_qkv()
    g = build_gradient_model(model, "loss", ["W"], outputs=["loss"])
    onnx.checker.check_model(g, full_check=True)
    types = value_types(g)
    values = ShapeValues(g, types, 17)
    pads = [n for n in g.graph.node if n.op_type == "Pad"]
    assert len(pads) == 3 and all(values.value(p.input[1]) is not None for p in pads)
    x = np.random.default_rng(1).standard_normal((5, 4))
    gradcheck(to_float64(model), "loss", ["W"], {"x": x}, rtol=1e-6, atol=1e-9)


def test_values_of_a_graph_that_does_not_fit_are_unknown() -> None:
    """A Reshape or Concat whose sizes do not fit gives no value (and no error) before a run."""
    nodes = [helper.make_node("Reshape", ["v", "bad"], ["r"]),
             helper.make_node("Concat", ["v", "m"], ["c"], axis=1)]
    values, _ = graph_values(nodes, [], [ints("v", 1, 2, 3), ints("bad", 2, 2),
                                         numpy_helper.from_array(np.ones((2, 2), np.int64), "m")])
    assert values.value("r") is None and values.value("c") is None


def test_weights_are_never_read(monkeypatch) -> None:
    """Only small integer constants are converted: a model's float weights stay protobuf."""
    from onnxtrain.ir import graphs

    seen = []
    real = graphs.numpy_helper.to_array
    monkeypatch.setattr(graphs.numpy_helper, "to_array", lambda t, *a: (seen.append(t.name), real(t, *a))[1])
    model = unflattened_qkv()
    ShapeValues(model, value_types(model), 17)
    assert "W" not in seen and "tail" in seen
