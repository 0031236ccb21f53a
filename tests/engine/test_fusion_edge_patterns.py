"""Patterns a second fuzz of the plan-time fusions found, each fused run against the unfused run and
onnxruntime: a shape computed from a small int initializer that is also a graph input was memoized by the
feed array's identity (rewriting that array between runs gave the first run's shape), the Conv weight-
gradient fusion's pointwise path took a strided 1×1 kernel over more rows than dY has (a matmul size error),
and the Pad+Concat fusion took a -0.0 fill for a zero (the fused sum dropped the sign). A third fuzz: the
Conv weight gradient's shifted-rows path made NaN of an input's inf, the masked softmax split a 1-D row."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import InferenceSession, SessionOptions
from onnxtrain.capi.options import GraphOptimizationLevel
from onnxtrain.engine.plan import Plan

N, F = helper.make_node, TensorProto.FLOAT


def _model(nodes: list, inputs: list, outputs: list, inits: list = ()) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def _ort(m: onnx.ModelProto, feeds: dict) -> list:
    so = ort.SessionOptions()
    so.log_severity_level = 4
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def test_a_fed_shape_initializer_rewritten_between_runs() -> None:
    """y = Reshape(x, Concat(Shape(x)[0:1], k)), k an int64 initializer that is also an input, fed the same
    array rewritten between runs."""
    i64 = TensorProto.INT64
    nodes = [N("Shape", ["x"], ["s"], end=1), N("Concat", ["s", "k"], ["t"], axis=0),
             N("Reshape", ["x", "t"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", F, ["n", 12]), helper.make_tensor_value_info("k", i64, [2])]
    m = _model(nodes, inputs, [helper.make_tensor_value_info("y", F, None)],
               [numpy_helper.from_array(np.array([3, 4]), "k")])
    x = np.arange(24, dtype=np.float32).reshape(2, 12)
    k = np.array([3, 4])
    for off in (False, True):
        so = SessionOptions()
        if off:
            so.graph_optimization_level = GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = InferenceSession(m.SerializeToString(), so)
        k[:] = [3, 4]
        assert sess.run(None, {"x": x, "k": k})[0].shape == (2, 3, 4)
        k[:] = [6, 2]  # the same array, new values
        got = sess.run(None, {"x": x, "k": k})[0]
        assert got.shape == _ort(m, {"x": x, "k": k})[0].shape == (2, 6, 2), off


def test_conv_weight_gradient_of_a_strided_one_by_one_kernel() -> None:
    """dW = Transpose(Conv(Transpose(X), Transpose(dY), strides=2)): X 17×17 and dY 16×16 give a 1×1 kernel
    read every other row; the fused path assumed X has dY's size."""
    t = [1, 0, 2, 3]
    nodes = [N("Transpose", ["x"], ["xt"], perm=t), N("Transpose", ["dy"], ["dyt"], perm=t),
             N("Conv", ["xt", "dyt"], ["c"], strides=[2, 2]), N("Transpose", ["c"], ["dw"], perm=t)]
    inputs = [helper.make_tensor_value_info("x", F, [2, 3, 17, 17]),
              helper.make_tensor_value_info("dy", F, [2, 4, 16, 16])]
    m = _model(nodes, inputs, [helper.make_tensor_value_info("dw", F, None)])
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 3, 17, 17)).astype(np.float32),
             "dy": rng.standard_normal((2, 4, 16, 16)).astype(np.float32)}
    fused, plain = Plan(m, fuse=True).run(feeds)[0], Plan(m, fuse=False).run(feeds)[0]
    assert fused.shape == (4, 3, 1, 1)
    np.testing.assert_allclose(fused, plain, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fused, _ort(m, feeds)[0], rtol=1e-5, atol=1e-5)


def test_pads_summed_with_a_negative_zero_fill_keep_the_sign() -> None:
    zero = numpy_helper.from_array(np.array(-0.0, np.float32))
    nodes = [N("Constant", [], ["z"], value=zero),
             N("Constant", [], ["pa"], value=numpy_helper.from_array(np.array([0, 0, 0, 3]))),
             N("Constant", [], ["pb"], value=numpy_helper.from_array(np.array([0, 3, 0, 0]))),
             N("Pad", ["a", "pa", "z"], ["a2"]), N("Pad", ["b", "pb", "z"], ["b2"]),
             N("Sum", ["a2", "b2"], ["y"])]
    inputs = [helper.make_tensor_value_info("a", F, [2, 3]), helper.make_tensor_value_info("b", F, [2, 3])]
    m = _model(nodes, inputs, [helper.make_tensor_value_info("y", F, None)])
    feeds = {"a": np.array([[-0.0, 1, 2], [3, -0.0, 4]], np.float32),
             "b": np.array([[-0.0, -0.0, 5], [-0.0, 6, -0.0]], np.float32)}
    fused, plain = Plan(m, fuse=True).run(feeds)[0], Plan(m, fuse=False).run(feeds)[0]
    assert fused.tobytes() == plain.tobytes() == _ort(m, feeds)[0].tobytes()


def test_conv_weight_gradient_of_an_input_holding_inf() -> None:
    """The shifted-rows path of the Conv weight-gradient fusion multiplies whole input rows by an output
    gradient padded with zero columns: an inf outside a weight position's window made 0·inf = NaN there.
    Such a result is computed again without the padding: the NaN and inf entries of onnxruntime's."""
    t = [1, 0, 2, 3]
    nodes = [N("Transpose", ["x"], ["xt"], perm=t), N("Transpose", ["dy"], ["dyt"], perm=t),
             N("Conv", ["xt", "dyt"], ["c"]), N("Transpose", ["c"], ["dw"], perm=t)]
    inputs = [helper.make_tensor_value_info("x", F, [1, 3, 6, 6]),
              helper.make_tensor_value_info("dy", F, [1, 2, 4, 4])]
    m = _model(nodes, inputs, [helper.make_tensor_value_info("dw", F, None)])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 3, 6, 6)).astype(np.float32)
    x[0, 0, 0, 5] = np.inf  # first row, last column: outside the window of weight position (0, 0)
    feeds = {"x": x, "dy": rng.standard_normal((1, 2, 4, 4)).astype(np.float32)}
    fused, plain = Plan(m, fuse=True).run(feeds)[0], Plan(m, fuse=False).run(feeds)[0]
    theirs = _ort(m, feeds)[0]
    assert np.isfinite(fused[:, 0, 0, 0]).all()
    np.testing.assert_array_equal(np.isnan(fused), np.isnan(theirs))
    np.testing.assert_allclose(fused, plain, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fused, theirs, rtol=1e-5, atol=1e-5)


def test_masked_softmax_of_one_long_row() -> None:
    """Softmax(Where(mask, -inf, x)) over a 1-D x long enough to be split over threads: its one row is the
    softmax's axis (the fused step split it by rows, and failed)."""
    n = 1 << 19
    nodes = [N("Constant", [], ["ninf"], value=numpy_helper.from_array(np.array(-np.inf, np.float32))),
             N("Where", ["mask", "ninf", "x"], ["s"]), N("Softmax", ["s"], ["y"], axis=-1)]
    inputs = [helper.make_tensor_value_info("x", F, [n]),
              helper.make_tensor_value_info("mask", TensorProto.BOOL, [n])]
    m = _model(nodes, inputs, [helper.make_tensor_value_info("y", F, [n])])
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal(n).astype(np.float32), "mask": rng.random(n) < 0.25}
    fused = InferenceSession(m.SerializeToString()).run(None, feeds)[0]
    np.testing.assert_allclose(fused, Plan(m, fuse=False).run(feeds)[0], rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(fused, _ort(m, feeds)[0], rtol=1e-5, atol=1e-12)


def test_a_cluster_of_scalar_ops_keeps_the_kernels_bits() -> None:
    """An optimizer's prologue on 0-d values (bias corrections: Sub, Sqrt, Mul, Div of scalars beside a Pow
    and a Cast) fused into one step: the same bits as onnx.reference and as the unfused run, 0-d arrays out,
    and no warning for sqrt(-1) or a division by zero."""
    import warnings

    import onnx.reference

    d = TensorProto.DOUBLE
    nodes = [N("Cast", ["t"], ["td"], to=d), N("Pow", ["b", "td"], ["bt"]), N("Sub", ["one", "bt"], ["c"]),
             N("Sqrt", ["c"], ["s"]), N("Mul", ["lr", "s"], ["m"]), N("Div", ["m", "c"], ["q"]),
             N("Cast", ["q"], ["y"], to=F), N("Sub", ["y", "z"], ["w"])]
    scalar = [helper.make_tensor_value_info(n, d, []) for n in ("b", "one", "lr")]
    inputs = [helper.make_tensor_value_info("t", TensorProto.INT64, []), *scalar,
              helper.make_tensor_value_info("z", F, [])]
    outputs = [helper.make_tensor_value_info(n, t, []) for n, t in (("q", d), ("w", F))]
    m = _model(nodes, inputs, outputs)
    fused = Plan(m)
    assert any(st.node.op_type == "FusedElementwise" for st in fused.steps)
    so = SessionOptions()
    so.graph_optimization_level = GraphOptimizationLevel.ORT_DISABLE_ALL  # no fusions
    unfused = InferenceSession(m.SerializeToString(), so)
    ref = onnx.reference.ReferenceEvaluator(m)
    cases = [(3, 0.999, 1.0, 1e-3, 0.25), (1, 0.9, 1.0, 0.05, -0.0), (0, 0.9, 1.0, 0.01, 1.0),
             (2, 1.5, 1.0, 1e-3, 2.0)]  # t = 0: c = 0, a 0/0; β > 1: sqrt of a negative
    for t, b, one, lr, z in cases:
        feeds = {"t": np.array(t, np.int64), "b": np.array(b), "one": np.array(one), "lr": np.array(lr),
                 "z": np.array(z, np.float32)}
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = fused.run(dict(feeds))
            plain = unfused.run(None, dict(feeds))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (onnx.reference's divide warns of 0/0)
            want = ref.run(None, feeds)
        for g, p, w in zip(got, plain, want):
            assert type(g) is np.ndarray and g.shape == () and g.dtype == w.dtype
            np.testing.assert_array_equal(g, w)
            np.testing.assert_array_equal(g, p)
            assert np.signbit(g) == np.signbit(w)
