"""The run side's per-run shortcuts: the value slots laid out once (initializers and folded constants) and
the slots of an output list remembered. Each must give what the long way gives: the same values, the same
errors, the same peak bytes."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.engine import plan as plan_module
from onnxtrain.engine.plan import EngineError, Plan


def _add_model() -> Plan:
    """y1 = x + w (w an initializer that is also a graph input, so feedable), y2 = y1 * c (c a Constant)."""
    w = numpy_helper.from_array(np.array([1.0, 2.0, 3.0, 4.0], np.float32), "w")
    nodes = [
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.float32(3.0), "c")),
        helper.make_node("Add", ["x", "w"], ["y1"]),
        helper.make_node("Mul", ["y1", "c"], ["y2"]),
    ]
    g = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y1", TensorProto.FLOAT, [4]),
         helper.make_tensor_value_info("y2", TensorProto.FLOAT, [4])],
        [w],
    )
    return Plan(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), fuse=False)


def test_a_fed_initializer_does_not_stay_for_the_next_run() -> None:
    """Every run starts from the initializers and constants: a feed that replaced one is gone next run, and
    the peak bytes count the fed array instead of the initializer's, then the initializer's again."""
    plan = _add_model()
    x = np.array([10.0, 20.0, 30.0, 40.0], np.float32)
    w_fed = np.array([-1.0], np.float32)  # (broadcast)
    for _ in range(2):
        y1, y2 = plan.run({"x": x})
        np.testing.assert_array_equal(y1, x.astype(np.float64) + [1, 2, 3, 4])
        np.testing.assert_array_equal(y2, (x.astype(np.float64) + [1, 2, 3, 4]) * 3)
        # initializer w and constant c (16 + 4 bytes), x (16) and y1 (16); then x is freed and y2 made
        assert plan.peak_bytes == 16 + 4 + 16 + 16
        y1, y2 = plan.run({"x": x, "w": w_fed})
        np.testing.assert_array_equal(y1, x.astype(np.float64) - 1)
        np.testing.assert_array_equal(y2, (x.astype(np.float64) - 1) * 3)
        assert plan.peak_bytes == 4 + 4 + 16 + 16  # the fed w (4 bytes) in place of the initializer


def test_output_lists_asked_again_give_the_same_outputs() -> None:
    """Named outputs in the order asked, a repeated name as a copy, a generator of names, the default list;
    asked again (remembered), the same; an unknown name raises every time it is asked."""
    plan = _add_model()
    x = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    want1 = x + np.array([1, 2, 3, 4], np.float32)
    want2 = want1 * np.float32(3)
    for _ in range(3):
        y2, y1 = plan.run({"x": x}, ["y2", "y1"])
        np.testing.assert_array_equal(y1, want1)
        np.testing.assert_array_equal(y2, want2)
        a, b = plan.run({"x": x}, ["y1", "y1"])
        assert a is not b and not np.shares_memory(a, b)
        np.testing.assert_array_equal(a, want1)
        np.testing.assert_array_equal(b, want1)
        (y,) = plan.run({"x": x}, (n for n in ["y2"]))
        np.testing.assert_array_equal(y, want2)
        y1, y2 = plan.run({"x": x})
        np.testing.assert_array_equal(y1, want1)
        np.testing.assert_array_equal(y2, want2)
        with pytest.raises(EngineError, match="unknown output 'x'"):
            plan.run({"x": x}, ["y1", "x"])


def test_many_output_lists_stay_right_past_the_remembered_number() -> None:
    """More distinct lists than a plan remembers: each still gives its own outputs."""
    plan = _add_model()
    x = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    want = {"y1": x + np.array([1, 2, 3, 4], np.float32)}
    want["y2"] = want["y1"] * np.float32(3)
    lists = [["y1"] * (k % 5 + 1) + ["y2"] * (k // 5 + 1) for k in range(plan_module._OUTPUT_LISTS_KEPT + 10)]
    for names in lists + lists[::-1]:
        outs = plan.run({"x": x}, names)
        assert len(outs) == len(names)
        for n, o in zip(names, outs):
            np.testing.assert_array_equal(o, want[n])
        assert len({id(o) for o in outs}) == len(outs)
