"""Gradients of bfloat16 models through rules whose natural ops ONNX defines without bfloat16 (Einsum;
EyeLike and Conv before opset 22): Resize (its interpolation matrix comes from an EyeLike, axes before the
last two go through an Einsum), Col2Im (a Conv with one-hot kernels), GRU and RNN (their weight gradients
are Einsums). The gradient graphs were invalid (onnx.checker refused them; sessions refused the node), so
such models could not train, also under bfloat16 mixed precision; those pieces now compute in float32.

Oracle: the same model in float64, its gradient checked against central finite differences
(``gradcheck``); the bfloat16 gradient agrees to bfloat16's precision."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import onnxtrain
from onnxtrain.testing import gradcheck

ml_dtypes = pytest.importorskip("ml_dtypes")


def _model(op: str, opset: int, elem: int) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """x → op → Σ y·c, at ``opset``, every float of type ``elem``; feeds in float64."""
    dt = helper.tensor_dtype_to_np_dtype(elem)
    rng = np.random.default_rng(0)
    inits, attrs, ins = [], {}, ["x"]
    if op == "Resize4":
        x_shape, y_shape, op_type = [1, 2, 3, 3], [1, 2, 6, 6], "Resize"
        inits.append(numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "sc"))
        ins += ["", "sc"]
        attrs["mode"] = "linear"
    elif op == "Resize5":  # the depth axis: an axis before the last two
        x_shape, y_shape, op_type = [1, 1, 2, 3, 3], [1, 1, 4, 3, 3], "Resize"
        inits.append(numpy_helper.from_array(np.array([1, 1, 2, 1, 1], np.float32), "sc"))
        ins += ["", "sc"]
        attrs["mode"] = "linear"
    elif op == "Col2Im":
        x_shape, y_shape, op_type = [1, 4, 4], [1, 1, 3, 3], "Col2Im"
        inits += [numpy_helper.from_array(np.array([3, 3], np.int64), "isz"),
                  numpy_helper.from_array(np.array([2, 2], np.int64), "bsz")]
        ins += ["isz", "bsz"]
    else:  # GRU, RNN: x [T, B, I] with W, R
        gates = 3 if op == "GRU" else 1
        x_shape, y_shape, op_type = [3, 2, 4], [3, 1, 2, 3], op
        inits += [numpy_helper.from_array((rng.standard_normal((1, gates * 3, 4)) * 0.5).astype(dt), "W"),
                  numpy_helper.from_array((rng.standard_normal((1, gates * 3, 3)) * 0.5).astype(dt), "R")]
        ins += ["W", "R"]
        attrs["hidden_size"] = 3
    c = rng.integers(-3, 4, y_shape).astype(dt)  # small integers: exact in bfloat16
    inits.append(numpy_helper.from_array(c, "c"))
    nodes = [helper.make_node(op_type, ins, ["y"], **attrs), helper.make_node("Mul", ["y", "c"], ["yc"]),
             helper.make_node("ReduceSum", ["yc"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem, x_shape)],
                          [helper.make_tensor_value_info("loss", elem, [])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    x = (rng.integers(-8, 9, x_shape) / 8).astype(np.float64)  # exact in bfloat16
    return model, {"x": x}


CASES = [("Resize4", 13), ("Resize4", 21), ("Resize5", 22), ("Col2Im", 18), ("GRU", 22), ("RNN", 22)]


@pytest.mark.parametrize("op, opset", CASES, ids=[f"{o}-{v}" for o, v in CASES])
def test_bfloat16_gradients_agree_with_float64_finite_differences(op: str, opset: int) -> None:
    wrt = ["x", "W", "R"] if op in ("GRU", "RNN") else ["x"]
    model64, feeds = _model(op, opset, T.DOUBLE)
    want = gradcheck(model64, "loss", wrt, feeds)
    model, _ = _model(op, opset, T.BFLOAT16)
    b = onnxtrain.GradientGraphBuilder(model.SerializeToString(), {"loss"}, set(wrt), "loss")
    b.build()
    grad_model = onnx.load_from_string(b.get_model())
    onnx.checker.check_model(grad_model, full_check=True)
    bf16 = ml_dtypes.bfloat16
    s = onnxtrain.InferenceSession(grad_model.SerializeToString())
    got = dict(zip([o.name for o in s.get_outputs()], s.run(None, {"x": feeds["x"].astype(bf16)})))
    for w in wrt:
        assert got[f"{w}_grad"].dtype == bf16
        np.testing.assert_allclose(got[f"{w}_grad"].astype(np.float64), want[w], rtol=3e-2, atol=3e-2,
                                   err_msg=w)
