"""Max and Min (1, 2 and 3 inputs, broadcasting, float16/32/64) at NaN, against onnxruntime 1.32 and
onnx.reference; their gradient against torch.

Forward: a NaN in any input position gives NaN, as both oracles give; other results are bit-equal. Two
things are not compared, as no spec fixes them: which NaN (payload, sign) comes out when several inputs are
NaN (onnxruntime returns the last one, numpy and onnx.reference the first), and the sign of a zero when +0
and -0 tie (onnxruntime keeps the earlier input; numpy's float32/float64 loops return the later one on
this host's SIMD, its float16 loop the earlier: host-dependent).

Gradient: two inputs as torch.maximum/minimum (a tie, ±0 included, splits dY evenly; at a NaN every input
gets all of dY); three inputs split a tie evenly as torch's amax/amin over the stacked inputs, and give every
input all of dY at a NaN, as chained torch.maximum does (amax gives NaN there: 0/0)."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import onnxtrain

TYPES = {"float16": TensorProto.FLOAT16, "float32": TensorProto.FLOAT, "float64": TensorProto.DOUBLE}
SPECIALS = [np.nan, -np.nan, 0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, 2.5]
SHAPES = [[(7,)], [(7,), (7,)], [(7,), (7,), (7,)], [(2, 1, 7), (7,), (3, 1)], [(3, 1), (1, 7)],
          [(1,), (4, 7), (7,)], [(5,), (1,), ()]]


def _model(op: str, shapes: list[tuple], elem: int) -> onnx.ModelProto:
    ins = [helper.make_tensor_value_info(f"x{i}", elem, list(s)) for i, s in enumerate(shapes)]
    g = helper.make_graph([helper.make_node(op, [f"x{i}" for i in range(len(shapes))], ["y"])], "g", ins,
                          [helper.make_tensor_value_info("y", elem, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _same_up_to_nan_and_zero_sign(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    plain = ~np.isnan(want)
    np.testing.assert_array_equal(got[plain], want[plain])  # (-0.0 == 0.0: the tie's sign is not compared)
    np.testing.assert_array_equal(np.signbit(got[plain & (want != 0)]), np.signbit(want[plain & (want != 0)]))


@pytest.mark.parametrize("dtype", list(TYPES))
@pytest.mark.parametrize("op", ["Max", "Min"])
def test_forward_nan_in_every_position(op: str, dtype: str) -> None:
    rng = np.random.default_rng(0)
    for shapes in SHAPES:
        model = _model(op, shapes, TYPES[dtype])
        ours = onnxtrain.InferenceSession(model.SerializeToString())
        theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        reference = ReferenceEvaluator(model)
        for _ in range(3):
            feeds = {f"x{i}": rng.choice(SPECIALS, size=s).astype(dtype) for i, s in enumerate(shapes)}
            got = ours.run(None, feeds)[0]
            _same_up_to_nan_and_zero_sign(got, theirs.run(None, feeds)[0])
            _same_up_to_nan_and_zero_sign(got, reference.run(None, feeds)[0])


@pytest.mark.parametrize("dtype", list(TYPES))
@pytest.mark.parametrize("n", [1, 2, 3])
def test_one_nan_in_each_position_of_each_arity(n: int, dtype: str) -> None:
    for op, nan_at in itertools.product(["Max", "Min"], range(n)):
        feeds = {f"x{i}": np.array([np.nan if i == nan_at else float(i)], dtype) for i in range(n)}
        model = _model(op, [(1,)] * n, TYPES[dtype]).SerializeToString()
        want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        assert np.isnan(want[0])
        assert np.isnan(onnxtrain.InferenceSession(model).run(None, feeds)[0][0]), (op, nan_at)


def _our_grads(op: str, values: list[np.ndarray], elem: int) -> list[np.ndarray]:
    """d(Σ w·op(x...))/dx_i from onnxtrain's gradient graph (w = 1, 2, 3, ... over the output)."""
    shapes = [v.shape for v in values]
    out = np.broadcast_shapes(*shapes)
    w = np.arange(1, 1 + int(np.prod(out)), dtype=values[0].dtype).reshape(out)
    n = len(values)
    nodes = [helper.make_node(op, [f"x{i}" for i in range(n)], ["y"]),
             helper.make_node("Mul", ["y", "w"], ["z"]),
             helper.make_node("ReduceSum", ["z"], ["loss"], keepdims=0)]
    ins = [helper.make_tensor_value_info(f"x{i}", elem, list(s)) for i, s in enumerate(shapes)]
    g = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("loss", elem, [])],
                          [onnx.numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    b = onnxtrain.GradientGraphBuilder(m.SerializeToString(), {"loss"}, {f"x{i}" for i in range(n)}, "loss")
    b.build()
    s = onnxtrain.InferenceSession(b.get_model())
    feeds = {f"x{i}": v for i, v in enumerate(values)}
    got = dict(zip([o.name for o in s.get_outputs()], s.run(None, feeds)))
    return [got[f"x{i}_grad"] for i in range(n)]


def _torch_grads(op: str, values: list[np.ndarray], combine: str) -> list[np.ndarray]:
    ts = [torch.tensor(v, requires_grad=True) for v in values]
    out = np.broadcast_shapes(*(v.shape for v in values))
    w = torch.arange(1, 1 + int(np.prod(out)), dtype=ts[0].dtype).reshape(out)
    if combine == "stack":
        stacked = torch.stack(torch.broadcast_tensors(*ts))
        y = stacked.amax(0) if op == "Max" else stacked.amin(0)
    else:
        pair = torch.maximum if op == "Max" else torch.minimum
        y = ts[0]
        for t in ts[1:]:
            y = pair(y, t)
    (y * w).sum().backward()
    return [t.grad.numpy() for t in ts]


PAIRS = [[[1.0, np.nan, np.nan, 2.0, 0.0, -0.0, 3.0], [1.0, 1.0, np.nan, np.nan, -0.0, 0.0, -3.0]],
         [[[1.0, np.nan, 2.0]], [[1.0], [np.nan], [2.0]]]]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", ["Max", "Min"])
def test_two_input_gradient_as_torch(op: str, dtype: str) -> None:
    for pair in PAIRS:
        values = [np.array(v, dtype) for v in pair]
        for got, want in zip(_our_grads(op, values, TYPES[dtype]), _torch_grads(op, values, "chain")):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("op", ["Max", "Min"])
def test_three_input_gradient_ties_and_nan(op: str) -> None:
    ties = [np.array([1.0, 0.0, 5.0, 2.0]), np.array([1.0, -0.0, 5.0, 1.0]), np.array([1.0, 0.0, 4.0, 2.0])]
    if op == "Min":
        ties = [-v for v in ties]
    for got, want in zip(_our_grads(op, ties, TensorProto.DOUBLE), _torch_grads(op, ties, "stack")):
        np.testing.assert_allclose(got, want, rtol=1e-15)
    # (a NaN among the chain's first two inputs: chained torch.maximum gives all three dY whatever their
    # order; with the NaN last only, its answer depends on the order of the chain, which Max does not have)
    nans = [np.array([np.nan, 1.0, np.nan, 1.0]), np.array([1.0, np.nan, np.nan, np.nan]),
            np.array([0.0, 0.0, np.nan, np.nan])]
    for got, want in zip(_our_grads(op, nans, TensorProto.DOUBLE), _torch_grads(op, nans, "chain")):
        np.testing.assert_array_equal(got, want)
