"""ReduceSum over leading axes rewritten for onnxruntime as products with ones (onnxtrain/engine/ort_sums.py):
the float64 sum within float32 rounding, onnxruntime's own ReduceSum no closer, and the shapes it gives."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.engine.ort_rewrites import rewrite_for_onnxruntime

ort = pytest.importorskip("onnxruntime")


def sum_model(shape: list, axes: list[int], keepdims: int = 0, elem: int = TensorProto.FLOAT,
              opset: int = 17, constant_node: bool = False) -> onnx.ModelProto:
    """x → ReduceSum(x, axes) → y, the axes an initializer or a Constant node."""
    nodes = []
    inits = []
    value = numpy_helper.from_array(np.array(axes, np.int64), "axes")
    if constant_node:
        nodes.append(helper.make_node("Constant", [], ["axes"], value=value))
    else:
        inits.append(value)
    nodes.append(helper.make_node("ReduceSum", ["x", "axes"], ["y"], name="sum", keepdims=keepdims))
    g = helper.make_graph(nodes, "sum", [helper.make_tensor_value_info("x", elem, shape)],
                          [helper.make_tensor_value_info("y", elem, None)], inits)
    return onnx.shape_inference.infer_shapes(
        helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9))


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]


@pytest.mark.parametrize("shape,axes,keepdims,batches", [
    (["N", 64, 512], [0, 1], 0, (16, 1, 3)),      # a transformer's bias gradient: MatMul + ReduceSum
    (["N", 64, 512], [1, 0], 1, (2,)),            # keepdims, axes in any order
    ([32, 256], [0], 0, (32,)),                   # all static: one product
    ([4, 8, 8, 96], [-4, -3, -2], 0, (4,)),       # all static, reshaped
    (["N", 4, 16, 128], [0, 1, 2], 0, (5,)),      # dynamic batch, two static dims into the product
    (["N", 64, 8, 16], [0, 1], 1, (3,)),          # several trailing dims
    (["N", 512], [0], 0, (256, 1)),               # a Linear layer's bias gradient: ones made at run time
    (["N", 512], [0], 1, (3,)),
    (["N", "S", 512], [0, 1], 0, (2,)),           # no static leading dim
    (["N", 2, 8, 16], [0, 1], 0, (3,)),           # too few static rows, several trailing dims
])
@pytest.mark.parametrize("elem", [TensorProto.FLOAT, TensorProto.DOUBLE])
def test_leading_sums_by_products_with_ones(shape, axes, keepdims, batches, elem) -> None:
    model = sum_model(shape, axes, keepdims, elem)
    new = rewrite_for_onnxruntime(model)
    onnx.checker.check_model(new, full_check=True)
    ops = [n.op_type for n in new.graph.node]
    assert "MatMul" in ops, ops
    assert "axes" not in {t.name for t in new.graph.initializer}  # read by nothing now
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    rng = np.random.default_rng(0)
    for n in batches:
        x = rng.standard_normal([n if isinstance(d, str) else d for d in shape]).astype(dtype)
        want = x.astype(np.float64).sum(axis=tuple(a % len(shape) for a in axes), keepdims=bool(keepdims))
        got, theirs = run(new, x), run(model, x)
        assert got.shape == theirs.shape == want.shape and got.dtype == dtype
        eps = np.finfo(dtype).eps
        bound = eps * np.sqrt(x.size / want.size) * 8 * np.abs(x).max()
        assert np.abs(got - want).max() <= max(bound, np.abs(theirs - want).max())


@pytest.mark.parametrize("shape,axes", [
    (["N", 64, 512], [1]),          # not the leading axes
    (["N", 64, 512], [0, 2]),
    (["N", 64, 10], [0, 1]),        # too few trailing values
    ([2, 512], [0]),                # too few static rows and no dynamic ones
    (["N", 64, "C"], [0, 1]),       # unknown trailing dim
    ([64, 512], [0, 1]),            # every axis
])
def test_other_sums_are_left_alone(shape, axes) -> None:
    model = sum_model(shape, axes)
    assert rewrite_for_onnxruntime(model) is model


def test_runtime_ones_need_opset_15_and_take_an_empty_batch() -> None:
    for opset in (13, 14):  # Shape has no range before opset 15
        old = sum_model(["N", 512], [0], opset=opset)
        assert rewrite_for_onnxruntime(old) is old
    new = rewrite_for_onnxruntime(sum_model(["N", 2, 512], [0, 1], keepdims=1, opset=15))
    onnx.checker.check_model(new, full_check=True)
    assert [n.op_type for n in new.graph.node] == ["Reshape", "Shape", "ConstantOfShape", "MatMul", "Reshape"]
    got = run(new, np.ones((0, 2, 512), np.float32))
    assert got.shape == (1, 1, 512) and not got.any()


def test_an_axes_constant_read_elsewhere_stays_and_old_opsets_are_left_alone() -> None:
    model = sum_model(["N", 64, 512], [0, 1], constant_node=True)
    model.graph.node.append(helper.make_node("Identity", ["axes"], ["z"], name="other"))
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.INT64, [2]))
    new = rewrite_for_onnxruntime(model)
    onnx.checker.check_model(new, full_check=True)
    assert [n.op_type for n in new.graph.node].count("Constant") == 1
    x = np.random.default_rng(1).standard_normal((3, 64, 512)).astype(np.float32)
    sess = ort.InferenceSession(new.SerializeToString(), providers=["CPUExecutionProvider"])
    y, z = sess.run(None, {"x": x})
    np.testing.assert_allclose(y, x.sum((0, 1)), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(z, [0, 1])
    old = sum_model(["N", 64, 512], [0, 1], opset=12)
    assert rewrite_for_onnxruntime(old) is old


def test_a_stale_declared_shape_does_not_plan_the_sum() -> None:
    """A model whose value_info declares an intermediate with dims no run has (here [4, 64, 128] for a
    [N, S, 128] value): plain onnxruntime runs it, and so does the backend, whose rewrites read only
    inferred types (the leading-sum rewrite had planned a [256, 128] product from the stale dims)."""
    import onnxtrain

    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["h"]),
         helper.make_node("ReduceSum", ["h", "axes"], ["s"], keepdims=0)],
        "stale", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "S", 128])],
        [helper.make_tensor_value_info("s", TensorProto.FLOAT, [128])],
        [numpy_helper.from_array(np.array([0, 1], np.int64), "axes")],
        value_info=[helper.make_tensor_value_info("h", TensorProto.FLOAT, [4, 64, 128])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = np.random.default_rng(0).standard_normal((3, 10, 128)).astype(np.float32)
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    got = onnxtrain.InferenceSession(model.SerializeToString(), so).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, run(model, x), rtol=1e-5)
    np.testing.assert_allclose(got, np.maximum(x, 0).astype(np.float64).sum((0, 1)), rtol=1e-5)


def _squares_model(shape: list, opset: int, keepdims: int = 0) -> onnx.ModelProto:
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None if keepdims else [])
    g = helper.make_graph([helper.make_node("ReduceSumSquare", ["x"], ["y"], keepdims=keepdims)], "squares",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)], [out])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


@pytest.mark.parametrize("shape, opset", [([1024, 1024], 17), ([256, 3, 3, 64], 18), ([2048, 1000], 13)])
def test_large_sums_of_squares_in_two_levels(shape: list, opset: int) -> None:
    """A gradient's sum of squares (clipping's norm) over a large tensor: onnxruntime's own ReduceSumSquare
    is 2e-5 or more off the float64 sum at 2^20 values; row sums then their sum are within 1e-6."""
    from onnxtrain.engine.ort_sums import two_level_sum_squares

    model = _squares_model(shape, opset)
    out = two_level_sum_squares(model)
    onnx.checker.check_model(out, full_check=True)
    assert [n.op_type for n in out.graph.node] == ["Reshape", "ReduceSumSquare", "ReduceSum"]
    x = (np.random.default_rng(0).standard_normal(shape) * 1e-3 + 1e-4).astype(np.float32)
    exact = np.sum(x.astype(np.float64) ** 2)
    assert abs(run(out, x) - exact) / exact < 1e-6
    if x.size >= 1 << 20:  # (what the rewrite is for)
        assert abs(run(model, x) - exact) / exact > 1e-5


@pytest.mark.parametrize("model", [
    _squares_model([100, 100], 17),        # below the size it pays from
    _squares_model([1024, 1024], 17, 1),   # keepdims
    _squares_model(["N", 1024], 17),       # a size known at run time only
    _squares_model([65537 * 2], 17),       # no split into rows of 64 or more (2 · a prime)
])
def test_other_sums_of_squares_are_left_alone(model: onnx.ModelProto) -> None:
    from onnxtrain.engine.ort_sums import two_level_sum_squares

    assert two_level_sum_squares(model) is model


def test_a_clipped_update_on_the_backend_takes_the_float64_norm() -> None:
    """A legacy session with clipping over a 1024² weight on the onnxruntime backend: its global norm is the
    numpy engine's (they parted by 1e-5, and the moments of every step by as much)."""
    from onnxtrain import SessionOptions, TrainingSession
    from tests.session.helpers import mlp_model, params

    model = mlp_model(1024, 1024, 4).SerializeToString()
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((8, 1024)).astype(np.float32),
             "y": rng.integers(0, 4, 8).astype(np.int64), "Learning_Rate": np.array([1e-3], np.float32)}
    norms = []
    for backend in ("numpy", "onnxruntime"):
        so = SessionOptions()
        so.add_session_config_entry("onnxtrain.backend", backend)
        s = TrainingSession(model, params("AdamOptimizer"), so)
        norms.append(float(s.run(["global_gradient_norm"], feeds)[0]))
    assert abs(norms[1] - norms[0]) / norms[0] < 1e-6, norms
