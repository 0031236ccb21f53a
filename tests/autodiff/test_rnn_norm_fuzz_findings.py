"""Gradient rules a fuzz of activation, math and normalization ops found wrong: MeanVarianceNormalization over
a constant slice (NaN), Mod(fmod=1) in bfloat16 (an invalid Round below opset 22), InstanceNormalization of an
(N, C) input (a crash or wrong values). Oracles: the closed form, float64 central differences, float32."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

import onnxtrain
from onnxtrain.autodiff import build_gradient_model

D = TensorProto.DOUBLE


def _grads(model: onnx.ModelProto, feeds: dict, wrt: list[str], full: bool = True) -> dict[str, np.ndarray]:
    gm = build_gradient_model(model, "loss", wrt)
    onnx.checker.check_model(gm, full_check=full)
    out = onnxtrain.InferenceSession(gm.SerializeToString()).run(None, feeds)
    return dict(zip([o.name for o in gm.graph.output], out))


def _fd(model: onnx.ModelProto, feeds: dict, name: str, eps: float) -> np.ndarray:
    sess = onnxtrain.InferenceSession(model.SerializeToString())
    x = feeds[name]
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        hi, lo = x.copy(), x.copy()
        hi[i] += eps
        lo[i] -= eps
        up, down = sess.run(["loss"], {**feeds, name: hi})[0], sess.run(["loss"], {**feeds, name: lo})[0]
        grad[i] = (up - down) / (2 * eps)
    return grad


def test_mean_variance_normalization_over_a_constant_row_is_finite() -> None:
    c = np.array([[0.3, -0.7, 1.1], [0.9, -0.2, 0.4]])
    g = helper.make_graph([helper.make_node("MeanVarianceNormalization", ["x"], ["y"], axes=[1]),
                           helper.make_node("Mul", ["y", "c"], ["yc"]),
                           helper.make_node("ReduceSum", ["yc"], ["loss"], keepdims=0)], "g",
                          [helper.make_tensor_value_info("x", D, [2, 3])],
                          [helper.make_tensor_value_info("loss", D, [])],
                          [onnx.numpy_helper.from_array(c, "c")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = np.array([[2.0, 2.0, 2.0], [1.0, 2.0, 4.0]])
    # (onnx's own function body of a float64 MVN fails its full check, the forward model alone too)
    try:
        onnx.checker.check_model(m, full_check=True)
        full = True
    except onnx.shape_inference.InferenceError:
        full = False
    dx = _grads(m, {"x": x}, ["x"], full)["x_grad"]
    assert np.isfinite(dx).all()
    np.testing.assert_allclose(dx[0], (c[0] - c[0].mean()) / 1e-9, rtol=1e-9)  # s = 0: Y = xc / ε
    np.testing.assert_allclose(dx[1], _fd(m, {"x": x}, "x", 1e-6)[1], atol=1e-8)


def test_mod_fmod_gradient_in_bfloat16_matches_float32() -> None:
    def model(t: int) -> onnx.ModelProto:
        g = helper.make_graph([helper.make_node("Mod", ["a", "b"], ["y"], fmod=1),
                               helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)], "g",
                              [helper.make_tensor_value_info(n, t, [3]) for n in ("a", "b")],
                              [helper.make_tensor_value_info("loss", t, [])])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])

    from onnx.helper import tensor_dtype_to_np_dtype

    bf16 = tensor_dtype_to_np_dtype(TensorProto.BFLOAT16)
    a, b = np.array([5.5, -7.25, 3.0]), np.array([2.0, 2.5, -1.25])
    got = _grads(model(TensorProto.BFLOAT16), {"a": a.astype(bf16), "b": b.astype(bf16)}, ["a", "b"])
    f32 = {"a": a.astype(np.float32), "b": b.astype(np.float32)}
    want = _grads(model(TensorProto.FLOAT), f32, ["a", "b"])
    np.testing.assert_array_equal(got["b_grad"].astype(np.float32), want["b_grad"])  # -trunc(a/b): exact
    np.testing.assert_array_equal(want["b_grad"], -np.trunc(a / b))


def test_instance_normalization_of_an_n_c_input() -> None:
    g = helper.make_graph([helper.make_node("InstanceNormalization", ["x", "s", "b"], ["y"]),
                           helper.make_node("Mul", ["y", "c"], ["yc"]),
                           helper.make_node("ReduceSum", ["yc"], ["loss"], keepdims=0)], "g",
                          [helper.make_tensor_value_info(n, D, sh) for n, sh in
                           (("x", [2, 3]), ("s", [3]), ("b", [3]), ("c", [2, 3]))],
                          [helper.make_tensor_value_info("loss", D, [])])
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 3)), "s": rng.standard_normal(3), "b": rng.standard_normal(3),
             "c": rng.standard_normal((2, 3))}
    for opset in (17, 21):
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
        got = _grads(m, feeds, ["x", "s", "b"])
        for name in ("x", "s", "b"):
            np.testing.assert_allclose(got[f"{name}_grad"], _fd(m, feeds, name, 1e-6), atol=1e-8)
        np.testing.assert_allclose(got["b_grad"], feeds["c"].sum(0), rtol=1e-12)
