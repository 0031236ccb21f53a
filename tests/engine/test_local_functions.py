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
