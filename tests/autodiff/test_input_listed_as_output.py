"""A graph input that is also a graph output declared without a shape: ONNX shape inference lets that
declaration hide the input's (a rank-0 input lost its rank, and the MatMul after a Where with it refused its
gradient for want of ranks). Oracle: float64 central differences; onnxruntime runs the forward."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

import onnxtrain
from onnxtrain.autodiff import build_gradient_model

D = TensorProto.DOUBLE


def _model():
    s = helper.make_tensor_value_info("s", D, [])  # rank 0
    nodes = [helper.make_node("Less", ["s", "s"], ["never"]),
             helper.make_node("Where", ["never", "x", "s"], ["v"]),  # s broadcast to x's shape
             helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["v", "xt"], ["p"]),
             helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", D, ["B", "T", 3]), s],
                          [helper.make_tensor_value_info("loss", D, []),
                           helper.make_tensor_value_info("s", D, None)],  # the input again, no shape
                          [])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_gradients_of_an_input_that_is_also_an_output() -> None:
    m = _model()
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 2, 3)), "s": np.array(1.5)}
    ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    gm = build_gradient_model(m, "loss", ["x", "s"])
    got = dict(zip([o.name for o in gm.graph.output],
                   onnxtrain.InferenceSession(gm.SerializeToString()).run(None, feeds)))
    sess = onnxtrain.InferenceSession(m.SerializeToString())
    for name in ("x", "s"):
        fd = np.zeros_like(feeds[name])
        for i in np.ndindex(fd.shape):
            hi, lo = feeds[name].copy(), feeds[name].copy()
            hi[i] += 1e-6
            lo[i] -= 1e-6
            up = sess.run(["loss"], {**feeds, name: hi})[0]
            down = sess.run(["loss"], {**feeds, name: lo})[0]
            fd[i] = (up - down) / 2e-6
        np.testing.assert_allclose(got[f"{name}_grad"], fd, rtol=1e-6, atol=1e-8)
