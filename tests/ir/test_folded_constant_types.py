"""The constants folded before shape inference without data propagation (``ir.builder._constants_folded``)
keep each value's element type: a Gather of an int32 constant is int32, as the run makes it (onnx.reference)
and as ONNX's own inference types it, and no warning calls the model's declared type wrong."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxtrain.ir import builder

BIG = builder._DATA_PROP_MAX  # a 1-D value this long turns data propagation off


def _const(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, f"{name}_value"))


def _model(dtype: type) -> onnx.ModelProto:
    """Beside a large 1-D input: a Gather of a small integer constant of ``dtype`` (an output), and a
    Concat of that and another constant of ``dtype`` (an output too)."""
    code = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [
        _const("c", np.array([2, 3, 4], dtype)), _const("i", np.array([1], np.int64)),
        _const("d", np.array([7], dtype)),
        helper.make_node("Gather", ["c", "i"], ["g"]),
        helper.make_node("Concat", ["g", "d"], ["cat"], axis=0),
        helper.make_node("Relu", ["big"], ["big_out"]),
    ]
    g = helper.make_graph(nodes, "gather_types", [helper.make_tensor_value_info("big", T.FLOAT, [BIG])],
                          [helper.make_tensor_value_info("g", code, [1]),
                           helper.make_tensor_value_info("cat", code, [2]),
                           helper.make_tensor_value_info("big_out", T.FLOAT, [BIG])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("dtype", [np.int32, np.int16, np.uint8, np.int64])
def test_gathered_constant_keeps_its_type(dtype: type) -> None:
    m = _model(dtype)
    assert not builder._propagates(m)
    ran = ReferenceEvaluator(m).run(None, {"big": np.zeros(BIG, np.float32)})
    onnx_types = {o.name: o.type.tensor_type.elem_type
                  for o in onnx.shape_inference.infer_shapes(m, strict_mode=True).graph.output}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a warning that the declared type is not the computed one)
        types = builder.value_types(m)
    for name, value in zip(("g", "cat"), ran[:2]):
        code = types[name].tensor_type.elem_type
        assert code == onnx_types[name] == helper.np_dtype_to_tensor_dtype(value.dtype), name
        assert [d.dim_value for d in types[name].tensor_type.shape.dim] == list(value.shape), name
