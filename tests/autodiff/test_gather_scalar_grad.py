"""Gather with a constant scalar index: its gradient is one Pad (q, k, v split from one projection)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.ir.builder import make_model
from onnxtrain.testing import gradcheck, random_loss_model, run_engine


def _out(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return tuple(d for k, d in enumerate(shape) if k != axis % len(shape))


def _model(shape: tuple[int, ...], axis: int, index: int, elem: int, dynamic: bool | str) -> onnx.ModelProto:
    """``dynamic``: True, the gathered axis has no static size; "rank", the data comes out of a Squeeze
    whose axes are an input, so shape inference does not know its rank either."""
    index = numpy_helper.from_array(np.array(index, np.int64))
    index_node = helper.make_node("Constant", [], ["i"], value=index)
    if dynamic == "rank":
        nodes = [helper.make_node("Squeeze", ["x0", "ax"], ["d"]), index_node]
        inputs = [
            helper.make_tensor_value_info("x0", elem, (1, *shape)),
            helper.make_tensor_value_info("ax", TensorProto.INT64, [1]),
        ]
    else:
        in_shape = ["n" if dynamic and k == axis % len(shape) else d for k, d in enumerate(shape)]
        nodes = [helper.make_node("Identity", ["x0"], ["d"]), index_node]
        inputs = [helper.make_tensor_value_info("x0", elem, in_shape)]
    nodes.append(helper.make_node("Gather", ["d", "i"], ["y0"], axis=axis))
    out = [helper.make_tensor_value_info("y0", elem, _out(shape, axis))]
    g = helper.make_graph(nodes, "gather", inputs, out)
    return make_model(g, 17)


def _feeds(shape: tuple[int, ...], dynamic: bool | str, seed: int, dtype) -> dict[str, np.ndarray]:
    x = np.random.default_rng(seed).uniform(-2, 2, shape).astype(dtype)
    return {"x0": x[None], "ax": np.array([0], np.int64)} if dynamic == "rank" else {"x0": x}


CASES = [((3, 4, 5), 0, 1), ((3, 4, 5), 1, -1), ((3, 4, 5), 2, 0), ((2, 6), 1, 5), ((2, 6), 1, -6)]


@pytest.mark.parametrize("dynamic", [False, True, "rank"])
@pytest.mark.parametrize("shape,axis,index", CASES)
def test_scalar_index_gradient_is_a_pad_and_matches_finite_differences(shape, axis, index, dynamic) -> None:
    node_model = _model(shape, axis, index, TensorProto.DOUBLE, dynamic)
    lm = random_loss_model(node_model, [_out(shape, axis)], [0])
    gm = build_gradient_model(lm, "loss", ["x0"])
    ops = [n.op_type for n in gm.graph.node]
    assert "Pad" in ops and "ScatterND" not in ops
    onnx.checker.check_model(gm, full_check=True)
    gradcheck(lm, "loss", ["x0"], _feeds(shape, dynamic, 0, np.float64), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("dynamic", [False, True, "rank"])
@pytest.mark.parametrize("shape,axis,index", CASES)
def test_scalar_index_gradient_agrees_with_onnxruntime(shape, axis, index, dynamic) -> None:
    ort = pytest.importorskip("onnxruntime")
    feeds = _feeds(shape, dynamic, 1, np.float32)
    node_model = _model(shape, axis, index, TensorProto.FLOAT, dynamic)
    lm = random_loss_model(node_model, [_out(shape, axis)], [0], dtype=np.float32)
    gm = build_gradient_model(lm, "loss", ["x0"], outputs=["loss"])
    ours = run_engine(gm, feeds)
    sess = ort.InferenceSession(gm.SerializeToString(), providers=["CPUExecutionProvider"])
    for a, b in zip(ours, sess.run(None, feeds)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_negative_axis_of_unknown_rank_takes_the_general_rule() -> None:
    lm = random_loss_model(_model((3, 4), -1, 1, TensorProto.DOUBLE, "rank"), [(3,)], [0])
    gm = build_gradient_model(lm, "loss", ["x0"])
    assert "Pad" not in [n.op_type for n in gm.graph.node]
    gradcheck(lm, "loss", ["x0"], _feeds((3, 4), "rank", 2, np.float64), rtol=1e-6, atol=1e-9)
