"""Gather with one scalar index returns a view (no copy) with the reference's values and errors."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxtrain.engine import EngineError, compile_model
from onnxtrain.ir.builder import make_model


def _gather(axis: int):
    node = helper.make_node("Gather", ["x", "i"], ["y"], axis=axis)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None),
                                        helper.make_tensor_value_info("i", TensorProto.INT64, [])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return compile_model(make_model(g, 17))


@pytest.mark.parametrize("axis,index", [(0, 1), (1, -1), (2, 0), (-1, 2)])
def test_scalar_index_is_a_view_with_take_values(axis: int, index: int) -> None:
    x = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    y = _gather(axis).run({"x": x, "i": np.array(index)})[0]
    np.testing.assert_array_equal(y, np.take(x, index, axis=axis))
    assert np.shares_memory(y, x)


def test_scalar_index_out_of_range_names_the_node() -> None:
    with pytest.raises(EngineError, match=r"Gather.*out of range"):
        _gather(0).run({"x": np.zeros((2, 3), np.float32), "i": np.array(5)})
