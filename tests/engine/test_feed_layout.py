"""A feed's memory layout (Fortran-ordered, a strided view) does not change the bits of a result: feeds are
taken in C order, as onnxruntime copies them (a reduction's and softmax's summation order followed the
strides, 1 ulp apart on most elements)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnxtrain


def _model(nodes, out_shape):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [48, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


MODELS = {
    "reduce_sum": _model([helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)], []),
    "softmax_exp": _model([helper.make_node("Exp", ["x"], ["e"]), helper.make_node("Softmax", ["e"], ["y"])],
                          [48, 64]),
    "mean_of_squares": _model([helper.make_node("Mul", ["x", "x"], ["s"]),
                            helper.make_node("ReduceMean", ["s"], ["y"], axes=[1], keepdims=1)], [48, 1]),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_fortran_and_strided_feeds_give_the_c_feeds_bits(name: str) -> None:
    m = MODELS[name]
    base = np.random.default_rng(0).standard_normal((48, 128)).astype(np.float32)
    c = np.ascontiguousarray(base[:, ::2])
    layouts = {"C": c, "Fortran": np.asfortranarray(c), "strided view": base[:, ::2]}
    ours = {k: onnxtrain.InferenceSession(m).run(None, {"x": v})[0] for k, v in layouts.items()}
    theirs = {k: ort.InferenceSession(m, providers=["CPUExecutionProvider"]).run(None, {"x": v})[0]
              for k, v in layouts.items()}
    for k in layouts:
        np.testing.assert_array_equal(theirs[k], theirs["C"])  # the oracle: onnxruntime's bits do not move
        np.testing.assert_array_equal(ours[k], ours["C"])
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-5, atol=1e-6)
    assert not layouts["strided view"].flags.c_contiguous  # (the feeds themselves are left as they were)
