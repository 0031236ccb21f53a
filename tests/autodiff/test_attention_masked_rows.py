"""Gradients through ONNX's ``Attention`` where a query row sees no key (a bool mask row all False, a float
mask row of −inf, ``nonpad_kv_seqlen`` 0, windows that leave a row empty): that row's output is 0 and so
are its gradients, and the keys' gradients stay finite. The softmax of such a row is nan, which the
Attention body zeroes with ``Where(RowAllMasked, 0, ·)``; the softmax rule multiplied the nan by the zero
gradient, which made dQ's row and all of dK nan. Oracle: central finite differences in float64, and
onnxruntime running the same gradient graph."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine import compile_model

D = TensorProto.DOUBLE
RNG = np.random.default_rng(0)


def _qkv(batch: int, queries: int, keys: int) -> tuple[np.ndarray, ...]:
    """q, k, v of two heads of size 2."""
    return tuple(RNG.standard_normal((batch, 2, n, 2)) for n in (queries, keys, keys))


def _case(name: str):
    """(model, float feeds, inputs differentiated, runs on onnxruntime)."""
    q, k, v = _qkv(1, 3, 4)
    inits, extra, attrs, opset = [], [], {}, 23
    if name == "bool_mask_row":
        inits = [numpy_helper.from_array(np.array([[False] * 4, [True, True, False, False],
                                                   [False, True, True, True]]), "mask")]
        extra = ["mask"]
    elif name == "float_mask_row":
        inits = [numpy_helper.from_array(np.array([[-np.inf] * 4, [0, 0, -np.inf, 1.0], [0.5, 0, 0, 0]]),
                                         "mask")]
        extra = ["mask"]
    elif name == "no_keys":  # the first batch entry is all padding
        q, k, v = _qkv(2, 3, 4)
        inits = [numpy_helper.from_array(np.array([0, 3], np.int64), "lengths")]
        extra, opset = ["", "", "", "lengths"], 25
    elif name == "empty_window":  # S = 4 queries, L = 2 keys, windows of 0: rows 2 and 3 see no key
        q, k, v = _qkv(1, 4, 2)
        attrs, opset = {"left_window_size": 0, "right_window_size": 0}, 25
    feeds = {"q": q, "k": k, "v": v}
    w = RNG.standard_normal((q.shape[0], 2, q.shape[2], 2))
    nodes = [helper.make_node("Attention", ["q", "k", "v", *extra], ["y"], **attrs),
             helper.make_node("Mul", ["y", "w"], ["p"]),
             helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0)]
    inputs = [helper.make_tensor_value_info(n, D, a.shape) for n, a in feeds.items()]
    g = helper.make_graph(nodes, "g", inputs,
                          [helper.make_tensor_value_info("loss", D, [])],
                          [*inits, numpy_helper.from_array(w, "w")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model, full_check=True)
    return model, feeds, opset < 25


@pytest.mark.parametrize("name", ["bool_mask_row", "float_mask_row", "no_keys", "empty_window"])
def test_fully_masked_rows_have_zero_and_finite_gradients(name: str) -> None:
    model, feeds, on_ort = _case(name)
    forward = compile_model(model)
    loss = lambda f: float(forward.run(f)[0])  # noqa: E731
    assert np.isfinite(loss(feeds))
    grad_model = build_gradient_model(model, "loss", list(feeds))
    names = [o.name for o in grad_model.graph.output]
    got = dict(zip(names, compile_model(grad_model).run(feeds)))
    theirs = (dict(zip(names, ort.InferenceSession(grad_model.SerializeToString(),
                                                  providers=["CPUExecutionProvider"]).run(None, feeds)))
              if on_ort else None)
    for n, x in feeds.items():
        want = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            up, down = x.copy(), x.copy()
            up[i] += 1e-6
            down[i] -= 1e-6
            want[i] = (loss({**feeds, n: up}) - loss({**feeds, n: down})) / 2e-6
        np.testing.assert_allclose(got[f"{n}_grad"], want, atol=1e-8, err_msg=n)
        if theirs is not None:
            np.testing.assert_allclose(theirs[f"{n}_grad"], want, atol=1e-8, err_msg=f"onnxruntime {n}")
