"""Edge inputs of the reduction and normalization kernels, against onnxruntime (kernel fuzz audit):
empty batches or channels (ReduceSum/ReduceMean over every axis but 1, alone and fused with a Mul;
BatchNormalization, InstanceNormalization), an empty softmax axis, and ReduceLogSumExp of rank-0 and
integer inputs. They failed with reshape or empty-reduction errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import onnxtrain
from onnxtrain.engine import compile_model

ort = pytest.importorskip("onnxruntime")


def _model(nodes: list[onnx.NodeProto], feeds: dict[str, np.ndarray], n_out: int, opset: int,
           inits: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:
    g = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for k, v in feeds.items()],
        [helper.make_value_info(f"y{i}", onnx.TypeProto()) for i in range(n_out)],
        initializer=[numpy_helper.from_array(v, k) for k, v in (inits or {}).items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _one(op: str, feeds: dict[str, np.ndarray], opset: int, n_out: int = 1,
         inits: dict[str, np.ndarray] | None = None, **attrs: Any) -> onnx.ModelProto:
    node = helper.make_node(op, [*feeds, *(inits or {})], [f"y{i}" for i in range(n_out)], **attrs)
    return _model([node], feeds, n_out, opset, inits)


def _check(m: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Runs ``m`` fused and unfused and in onnxruntime: the same shapes, dtypes and values (NaN as NaN)."""
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, feeds)
    for fuse in (True, False):
        got = compile_model(m, fuse=fuse).run(feeds)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(g, w)
    return want


# --- ReduceSum / ReduceMean over every axis but 1, with no (image, channel) rows --------------------------

@pytest.mark.parametrize("shape, axes, keepdims", [
    ((0, 3, 4, 4), [0, 2, 3], 0),
    ((0, 3, 4, 4), [0, 2, 3], 1),
    ((2, 0, 3), [0, 2], 1),
    ((2, 0, 3), [0, 2], 0),
    ((0, 0, 5), [2, 0], 0),
])
@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("opset", [13, 18])
def test_reduce_sum_over_all_but_channels_of_empty_rows(shape: tuple[int, ...], axes: list[int],
                                                        keepdims: int, dt: type, opset: int) -> None:
    x = np.zeros(shape, dt)
    _check(_one("ReduceSum", {"x": x}, opset, inits={"axes": np.array(axes, np.int64)}, keepdims=keepdims),
           {"x": x})


@pytest.mark.parametrize("shape, axes", [((0, 3, 4, 4), [0, 2, 3]), ((2, 0, 3), [0, 2])])
def test_reduce_mean_over_all_but_channels_of_empty_rows(shape: tuple[int, ...], axes: list[int]) -> None:
    """The shape is onnxruntime's; the mean of nothing is NaN, as onnx.reference and onnxtrain's other
    ReduceMean paths give (onnxruntime gives 0; the spec leaves it undefined)."""
    x = np.zeros(shape, np.float32)
    m = _one("ReduceMean", {"x": x}, 18, inits={"axes": np.array(axes, np.int64)}, keepdims=0)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,) = sess.run(None, {"x": x})
    for fuse in (True, False):
        (y,) = compile_model(m, fuse=fuse).run({"x": x})
        assert y.dtype == want.dtype and y.shape == want.shape and np.isnan(y).all()


def test_reduce_sum_of_a_product_over_an_empty_batch() -> None:
    """ReduceSum(Mul(a, b)) over every axis but 1: the fused per-channel dot products and the unfused pair."""
    a = np.zeros((0, 3, 4, 4), np.float32)
    nodes = [helper.make_node("Mul", ["a", "b"], ["p"]),
             helper.make_node("ReduceSum", ["p", "axes"], ["y0"], keepdims=0)]
    m = _model(nodes, {"a": a, "b": a}, 1, 18, {"axes": np.array([0, 2, 3], np.int64)})
    (y,) = _check(m, {"a": a, "b": a})
    assert y.tolist() == [0.0, 0.0, 0.0]


# --- BatchNormalization / InstanceNormalization on an empty batch -----------------------------------------

def _stats(c: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(c)
    return {"s": rng.uniform(0.5, 2, c).astype(np.float32), "b": rng.standard_normal(c).astype(np.float32),
            "m": rng.standard_normal(c).astype(np.float32), "v": rng.uniform(0.5, 2, c).astype(np.float32)}


@pytest.mark.parametrize("shape", [(0, 3, 4, 4), (0, 3), (0, 3, 5), (2, 0, 4, 4)])
def test_batch_norm_inference_on_an_empty_batch(shape: tuple[int, ...]) -> None:
    x = np.zeros(shape, np.float32)
    feeds = {"x": x, **_stats(shape[1])}
    (y,) = _check(_one("BatchNormalization", feeds, 15), feeds)
    assert y.shape == shape


@pytest.mark.parametrize("shape", [(0, 3, 4, 4), (0, 3), (2, 3, 0, 4)])
@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_batch_norm_training_on_an_empty_batch(shape: tuple[int, ...], momentum: float) -> None:
    """Y is empty; the running mean and variance blend in the batch's of no values (0 / 0): NaN, as
    onnxruntime and onnx.reference give."""
    x = np.zeros(shape, np.float32)
    feeds = {"x": x, **_stats(3)}
    y, mean, var = _check(_one("BatchNormalization", feeds, 15, n_out=3, training_mode=1, momentum=momentum),
                          feeds)
    assert y.shape == shape and np.isnan(mean).all() and np.isnan(var).all()


@pytest.mark.parametrize("shape", [(0, 3, 4, 4), (0, 3, 5), (2, 0, 3)])
def test_instance_norm_on_an_empty_batch(shape: tuple[int, ...]) -> None:
    x = np.zeros(shape, np.float32)
    c = shape[1]
    feeds = {"x": x, "s": np.ones(c, np.float32), "b": np.zeros(c, np.float32)}
    (y,) = _check(_one("InstanceNormalization", feeds, 6), feeds)
    assert y.shape == shape


# --- Softmax / LogSoftmax along an empty axis ------------------------------------------------------------

@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("shape, axis", [((2, 0), 1), ((2, 0), -1), ((2, 3, 4, 0), -1), ((2, 0, 4, 4), 1),
                                         ((2, 3, 0, 4), 2), ((0, 3), 1)])
@pytest.mark.parametrize("opset", [11, 13])
def test_softmax_along_an_empty_axis(op: str, shape: tuple[int, ...], axis: int, opset: int) -> None:
    x = np.zeros(shape, np.float32)
    (y,) = _check(_one(op, {"x": x}, opset, axis=axis), {"x": x})
    assert y.shape == shape


@pytest.mark.parametrize("dt", [np.float16, np.float32])
def test_softmax_along_an_empty_axis_keeps_the_dtype(dt: type) -> None:
    x = np.zeros((3, 0), dt)
    (y,) = compile_model(_one("Softmax", {"x": x}, 13, axis=1)).run({"x": x})
    assert y.dtype == dt and y.shape == (3, 0)


# --- ReduceLogSumExp: rank 0, integers -------------------------------------------------------------------

@pytest.mark.parametrize("value", [2.5, -1e30, np.inf, -np.inf])
@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("opset, keepdims", [(13, 0), (13, 1), (18, 1)])
def test_reduce_log_sum_exp_of_a_scalar(value: float, dt: type, opset: int, keepdims: int) -> None:
    x = np.array(value, dt)
    (y,) = _check(_one("ReduceLogSumExp", {"x": x}, opset, keepdims=keepdims), {"x": x})
    assert y.shape == ()


_INTS = np.array([[0, 0, -1, -1], [-3, -3, -4, -4], [5, 5, 5, 4], [-20, -20, -20, -20], [1, 2, 3, 2],
                  [100, 100, 0, 7]])


@pytest.mark.parametrize("dt", [np.int32, np.int64])
@pytest.mark.parametrize("attrs", [{"axes": [1], "keepdims": 0}, {"axes": [0], "keepdims": 1},
                                   {"keepdims": 0}, {"keepdims": 1}, {"axes": [-1, 0], "keepdims": 0}])
def test_reduce_log_sum_exp_of_integers(dt: type, attrs: dict[str, Any]) -> None:
    """onnxruntime sums the exps in the integer type (only the entries equal to the maximum count) and
    truncates max + log(count): [0, 0, -1, -1] gives 0, not 1 (log-sum-exp 1.006)."""
    x = _INTS.astype(dt)
    (y,) = _check(_one("ReduceLogSumExp", {"x": x}, 13, **attrs), {"x": x})
    if attrs == {"axes": [1], "keepdims": 0}:
        assert y.tolist() == [0, -2, 6, -18, 3, 100]


def test_reduce_log_sum_exp_of_an_integer_scalar() -> None:
    x = np.array(7, np.int64)
    (y,) = _check(_one("ReduceLogSumExp", {"x": x}, 13, keepdims=1), {"x": x})
    assert y.tolist() == 7


@pytest.mark.parametrize("dt", [np.int32, np.int64])
@pytest.mark.parametrize("opset", [13, 18])
def test_reduce_mean_of_no_integers_is_zero(dt: type, opset: int) -> None:
    """onnxruntime's 0 (NaN cast back to an integer gave INT_MIN)."""
    x = np.zeros((0, 3), dt)
    if opset >= 18:
        m = _one("ReduceMean", {"x": x}, opset, inits={"axes": np.array([0], np.int64)}, keepdims=0)
    else:
        m = _one("ReduceMean", {"x": x}, opset, axes=[0], keepdims=0)
    np.testing.assert_array_equal(_check(m, {"x": x})[0], np.zeros(3, dt))


@pytest.mark.parametrize("axis,shape,cond", [(None, (2, 3), [1, 0, 1, 1, 0, 1, 1]), (0, (3, 2), [0, 1, 1, 1]),
                                             (1, (2, 3), [1, 0, 0, 1])])
def test_compress_ignores_condition_entries_past_the_axis(axis, shape, cond) -> None:
    """A condition longer than the axis with a True past its end: onnxruntime ignores the extra entries
    (the engine raised an IndexError)."""
    x = np.arange(1, 1 + np.prod(shape), dtype=np.float32).reshape(shape)
    feeds = {"x": x, "c": np.array(cond, bool)}
    attrs = {} if axis is None else {"axis": axis}
    _check(_one("Compress", feeds, 13, **attrs), feeds)


@pytest.mark.parametrize("op, shape, attrs, extra", [
    ("ReduceMean", (0, 2), {"keepdims": 0}, {}),
    ("GlobalAveragePool", (1, 2, 0, 3), {}, {}),
    ("SoftmaxCrossEntropyLoss", (0, 3), {}, {"labels": np.zeros(0, np.int64)}),
])
def test_means_over_no_value_are_nan_without_a_warning(op: str, shape, attrs, extra) -> None:
    # NaN as the README says, but numpy's "Mean of empty slice" RuntimeWarning was printed
    import warnings

    feeds = {"x": np.zeros(shape, np.float32), **extra}
    m = _one(op, feeds, 21, **attrs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = onnxtrain.InferenceSession(m.SerializeToString()).run(None, feeds)[0]
    assert got.size and np.isnan(got).all()
