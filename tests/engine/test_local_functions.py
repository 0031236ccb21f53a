"""Models with local functions (``ModelProto.functions``: torch's ``export_modules_as_functions``, or
written by hand, attribute references included) run, train and build gradient graphs: their calls are
inlined at load, as onnxruntime inlines them (they were refused: "no kernel for node(s) (local.foo)").
Oracles: onnxruntime's outputs, and the same model written without functions for the gradients."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort

import onnxtrain
from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine import compile_model

CALLS = """
<ir_version: 8, opset_import: ["" : 17, "local" : 1]>
agraph (float[N, 4] X, float[4, 3] W, float[3] B) => (float[N, 3] C)
{ T = local.dense <alpha = 0.3> (X, W, B)
  C = local.square (T) }
<opset_import: ["" : 17], domain: "local">
dense <alpha> (x, w, b) => (c) { t = MatMul(x, w)
  s = Add(t, b)
  c = LeakyRelu <alpha: float = @alpha> (s) }
<opset_import: ["" : 17], domain: "local">
square (x) => (y) { y = Mul (x, x) }
"""
PLAIN = """
<ir_version: 8, opset_import: ["" : 17]>
agraph (float[N, 4] X, float[4, 3] W, float[3] B) => (float[N, 3] C)
{ t = MatMul(X, W)
  s = Add(t, B)
  T = LeakyRelu <alpha = 0.3> (s)
  C = Mul(T, T) }
"""


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"X": rng.standard_normal((5, 4)).astype(np.float32),
            "W": rng.standard_normal((4, 3)).astype(np.float32),
            "B": rng.standard_normal(3).astype(np.float32)}


def test_a_model_with_local_functions_runs_as_onnxruntime_runs_it() -> None:
    model = onnx.parser.parse_model(CALLS)
    onnx.checker.check_model(model, full_check=True)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, _feeds())[0]
    got = onnxtrain.InferenceSession(model.SerializeToString()).run(None, _feeds())[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_its_gradient_graph_is_that_of_the_model_without_functions() -> None:
    loss_of = "\n  L = ReduceSum <keepdims = 0> (C) }"
    with_calls = onnx.parser.parse_model(CALLS.replace("=> (float[N, 3] C)", "=> (float L)")
                                         .replace("C = local.square (T) }", "C = local.square (T)" + loss_of))
    plain = onnx.parser.parse_model(PLAIN.replace("=> (float[N, 3] C)", "=> (float L)")
                                    .replace("C = Mul(T, T) }", "C = Mul(T, T)" + loss_of))
    feeds = _feeds()
    built = build_gradient_model(with_calls, "L", ["W", "B"])
    # the functions' domain left with them (its opset import stayed, though no node used it)
    assert [o.domain for o in built.opset_import] == [""] and not built.functions
    onnx.checker.check_model(built, full_check=True)
    grads = [compile_model(m).run(feeds) for m in (built, build_gradient_model(plain, "L", ["W", "B"]))]
    for a, b in zip(*grads):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def _defaulted() -> onnx.ModelProto:
    """``local.dense`` with ``alpha`` defaulting to 0.5 (``attribute_proto``), called without it, nested in a
    second function's body."""
    model = onnx.parser.parse_model(CALLS.replace("local.dense <alpha = 0.3> (X, W, B)",
                                                  "local.outer (X, W, B)"))
    dense = next(f for f in model.functions if f.name == "dense")
    dense.attribute_proto.extend([onnx.helper.make_attribute("alpha", 0.5)])
    del dense.attribute[:]
    call = onnx.helper.make_node("dense", ["x", "w", "b"], ["t"], domain="local")
    imports = [onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("local", 1)]
    outer = onnx.helper.make_function("local", "outer", ["x", "w", "b"], ["t"], [call], imports)
    model.functions.append(outer)
    model.ir_version = 10
    return model


def test_a_function_attribute_default_reaches_its_body() -> None:
    """onnx's inliner drops a reference to an attribute the call leaves out: LeakyRelu took its own 0.01 for
    the function's default 0.5, on both backends and in the gradients."""
    model = _defaulted()
    onnx.checker.check_model(model, full_check=True)
    feeds = _feeds()
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds)[0]
    plain = onnx.parser.parse_model(PLAIN.replace("alpha = 0.3", "alpha = 0.5"))
    np.testing.assert_allclose(compile_model(plain).run(feeds)[0], want, rtol=1e-6)
    options = onnxtrain.SessionOptions()
    options.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    for opts in (None, options):
        got = onnxtrain.InferenceSession(model.SerializeToString(), opts).run(None, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_a_function_of_another_opset_version_is_inlined() -> None:
    """A function importing opset 14 in a model of opset 17 (onnx.checker takes it, onnxruntime runs it)
    was left a call by onnx's inliner and refused: "no kernel for node(s) (local.R)"."""
    model = onnx.parser.parse_model("""
<ir_version: 8, opset_import: ["" : 17, "local" : 1]>
agraph (float[2, 3] X) => (float L)
{ Y = local.R (X)
  L = ReduceSum <keepdims = 0> (Y) }
<opset_import: ["" : 14], domain: "local">
R (x) => (y) { axes = Constant <value = int64[1] {0}> ()
  s = Unsqueeze (x, axes)
  y = Relu (s) }
""")
    onnx.checker.check_model(model, full_check=True)
    x = np.array([[1.0, -2.0, 3.0], [0.5, 0.0, -1.0]], np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"X": x})
    np.testing.assert_allclose(onnxtrain.InferenceSession(model.SerializeToString()).run(None, {"X": x})[0],
                               want[0], rtol=1e-6)
    built = build_gradient_model(model, "L", ["X"])
    onnx.checker.check_model(built, full_check=True)
    np.testing.assert_array_equal(compile_model(built).run({"X": x})[-1], (x > 0).astype(np.float32))
