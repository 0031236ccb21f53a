"""Cases from onnxruntime's gradient-op checks (orttraining/test/gradient/gradient_ops_test.cc) that the op
tables (tests/op_cases) cannot express: graph inputs whose shapes the model does not declare (onnxruntime
checks several gradients "without shape inferencing": MatMul, Gemm, Transpose, ReduceSum, the broadcasting
arithmetic, Concat, Expand, TopK); operands broadcast along symbolic dims; and forms onnx.reference (the
tables' forward oracle) computes otherwise than the spec: Softmax and LogSoftmax before opset 13, which
flatten the input to 2-D at their axis, and GatherElements with an index shorter than the data on an axis
it does not gather along. Each gradient is checked against float64 central differences; the gradient
graphs also run on onnxruntime (in float32)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.testing import gradcheck, run_engine


def _i64(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int64)


def _loss_model(op: str, feeds: dict[str, np.ndarray], attrs: dict[str, Any], opset: int,
                dims: dict[str, list[Any] | None], n_outputs: int = 1) -> onnx.ModelProto:
    """loss = ΣΣ y0·w over one ``op`` node on the ``feeds`` (in order); ``dims`` gives each input's declared
    shape (None: no shape at all, so not even its rank is known)."""
    names = list(feeds)
    outs = [f"y{k}" for k in range(n_outputs)]
    nodes = [helper.make_node(op, names, outs, name=f"{op}_0", **attrs),
             helper.make_node("Mul", ["y0", "w"], ["yw"]),
             helper.make_node("ReduceSum", ["yw"], ["loss"], keepdims=0)]
    inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), dims[n])
              for n, v in feeds.items()]
    inputs.append(helper.make_tensor_value_info("w", TensorProto.DOUBLE, None))
    loss = helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])
    graph = helper.make_graph(nodes, op, inputs, [loss])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _check(op: str, feeds: dict[str, np.ndarray], wrt: list[str], attrs: dict[str, Any] | None = None,
           opset: int = 13, dims: dict[str, list[Any] | None] | None = None, n_outputs: int = 1) -> None:
    attrs = attrs or {}
    dims = dims or {}
    dims = {n: dims.get(n) for n in feeds}
    y = run_engine(_forward(op, feeds, attrs, opset, n_outputs), feeds)[0]
    w = np.random.default_rng(7).uniform(0.5, 1.5, np.shape(y))
    model = _loss_model(op, feeds, attrs, opset, dims, n_outputs)
    all_feeds = {**feeds, "w": w}
    grads = gradcheck(model, "loss", wrt, all_feeds)
    ort = pytest.importorskip("onnxruntime")
    gmodel = build_gradient_model(model, "loss", wrt, outputs=["loss"])
    f32 = _to_float32(gmodel)
    sess = ort.InferenceSession(f32.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds32 = {k: (v.astype(np.float32) if v.dtype == np.float64 else v) for k, v in all_feeds.items()}
    got = sess.run(None, feeds32)
    for name, value in zip([o.name for o in gmodel.graph.output], got):
        if name.endswith("_grad"):
            np.testing.assert_allclose(value, grads[name[:-5]], rtol=1e-4, atol=1e-4,
                                       err_msg=f"{op}: {name} on onnxruntime")


def _forward(op: str, feeds: dict[str, np.ndarray], attrs: dict[str, Any], opset: int,
             n_outputs: int) -> onnx.ModelProto:
    names = list(feeds)
    node = helper.make_node(op, names, [f"y{k}" for k in range(n_outputs)], **attrs)
    inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
              for n, v in feeds.items()]
    outputs = [helper.make_empty_tensor_value_info(f"y{k}") for k in range(n_outputs)]
    return helper.make_model(helper.make_graph([node], op, inputs, outputs),
                             opset_imports=[helper.make_opsetid("", opset)])


def _to_float32(model: onnx.ModelProto) -> onnx.ModelProto:
    """The gradient graph in float32 (onnxruntime has no float64 kernel for some of its ops)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for vi in [*m.graph.input, *m.graph.output, *m.graph.value_info]:
        if vi.type.tensor_type.elem_type == TensorProto.DOUBLE:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT
    for t in m.graph.initializer:
        if t.data_type == TensorProto.DOUBLE:
            t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t).astype(np.float32), t.name))
    for node in m.graph.node:
        for a in node.attribute:
            if a.name == "to" and a.i == TensorProto.DOUBLE:
                a.i = TensorProto.FLOAT
            if a.name == "value" and a.t.data_type == TensorProto.DOUBLE:
                a.t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(a.t).astype(np.float32),
                                                          a.t.name))
    return m


def _x(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.uniform(-2.0, 2.0, shape)


# MatMul: onnxruntime's shapes (2-D to 4-D, a 2-D operand against a batch, batch axes broadcast both
# ways), at opsets 11 and 13, neither operand's rank declared; then one rank declared, and 1-D operands
_MATMUL_SHAPES = [((2, 4), (4, 3)), ((2, 3, 4), (2, 4, 3)), ((2, 3, 4), (4, 3)), ((3, 4), (2, 4, 3)),
                  ((2, 3, 4, 5), (2, 3, 5, 4)), ((2, 3, 4, 5), (5, 4)), ((2, 3, 4, 5), (3, 5, 4)),
                  ((2, 1, 4, 5), (1, 3, 5, 4))]


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("sa,sb", _MATMUL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matmul_without_declared_ranks(sa: tuple[int, ...], sb: tuple[int, ...], opset: int) -> None:
    rng = np.random.default_rng(0)
    _check("MatMul", {"a": _x(rng, *sa), "b": _x(rng, *sb)}, ["a", "b"], opset=opset)


@pytest.mark.parametrize("sa,sb,declared", [
    ((4,), (2, 4, 3), "a"), ((2, 3, 4), (4,), "b"), ((4,), (4,), ""), ((5,), (5, 2), "a"),
    ((3, 5), (5,), ""), ((2, 1, 3, 4), (2, 4, 2), "a"), ((3, 4), (2, 1, 4, 2), "b"), ((0, 3), (3, 2), ""),
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else f"declared_{v or 'none'}")
def test_matmul_one_or_no_rank_declared(sa: tuple[int, ...], sb: tuple[int, ...], declared: str) -> None:
    rng = np.random.default_rng(1)
    feeds = {"a": _x(rng, *sa), "b": _x(rng, *sb)}
    dims = {declared: list(feeds[declared].shape)} if declared else {}
    _check("MatMul", feeds, ["a", "b"], dims=dims)


@pytest.mark.parametrize("opset", [11, 13])
def test_gemm_without_declared_shapes(opset: int) -> None:
    rng = np.random.default_rng(2)
    for (sa, sb, sc), attrs in [(((1, 4), (4, 3), ()), {}), (((2, 4), (4, 3), (1, 3)), {}),
                                (((4, 2), (3, 4), (3,)), {"transA": 1, "transB": 1}),
                                (((2, 4), (4, 3), (2, 3)), {"alpha": 0.7, "beta": 5.0})]:
        _check("Gemm", {"a": _x(rng, *sa), "b": _x(rng, *sb), "c": _x(rng, *sc)}, ["a", "b", "c"], attrs,
               opset=opset)


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
def test_broadcasting_arithmetic_without_declared_shapes(op: str) -> None:
    rng = np.random.default_rng(3)
    for sa, sb in [((2, 3, 4, 5), ()), ((), (2, 3, 4, 5)), ((4, 5), (2, 3, 4, 5)), ((1, 4, 5), (2, 3, 1, 1)),
                   ((3, 4, 5), (2, 1, 1, 1)), ((2, 1, 1, 5), (1, 3, 4, 1))]:
        b = rng.uniform(0.5, 2.0, sb) * rng.choice([-1.0, 1.0], sb)  # away from 0 for Div
        _check(op, {"a": _x(rng, *sa), "b": np.asarray(b)}, ["a", "b"], opset=11)


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
def test_broadcast_along_symbolic_dims(op: str, opset: int) -> None:
    """A (4, 2, 1, seq) against (4, 2, 1, 1); (batch, 2, seq, seq) against (batch, 1, 1, seq), both ways."""
    rng = np.random.default_rng(4)
    for (sa, da), (sb, db) in [
        (((4, 2, 1, 3), [4, 2, 1, "seq"]), ((4, 2, 1, 1), [4, 2, 1, 1])),
        (((4, 2, 3, 3), ["batch", 2, "seq", "seq"]), ((4, 1, 1, 3), ["batch", 1, 1, "seq"])),
        (((4, 1, 1, 3), ["batch", 1, 1, "seq"]), ((4, 2, 3, 3), ["batch", 2, "seq", "seq"])),
    ]:
        b = rng.uniform(0.5, 2.0, sb) * rng.choice([-1.0, 1.0], sb)
        _check(op, {"a": _x(rng, *sa), "b": b}, ["a", "b"], opset=opset, dims={"a": da, "b": db})


def test_other_gradients_without_declared_shapes() -> None:
    """Transpose, ReduceSum (axes as attribute and as input), Concat, Expand and TopK."""
    rng = np.random.default_rng(5)
    _check("Transpose", {"x": _x(rng, 2, 3, 4)}, ["x"])
    _check("Transpose", {"x": _x(rng, 2, 3, 4)}, ["x"], {"perm": [1, 2, 0]})
    _check("ReduceSum", {"x": _x(rng, 4, 3, 2)}, ["x"], {"axes": [-1, -3], "keepdims": 0}, opset=11)
    _check("ReduceSum", {"x": _x(rng, 4, 3, 2)}, ["x"], opset=11)
    _check("ReduceSum", {"x": _x(rng, 4, 3, 2), "axes": _i64(0, 2)}, ["x"], opset=13)
    _check("ReduceSum", {"x": _x(rng, 4, 3, 2), "axes": _i64(-2, -1)}, ["x"], {"keepdims": 0}, opset=13)
    _check("Concat", {"a": _x(rng, 2, 2), "b": _x(rng, 2, 4)}, ["a", "b"], {"axis": -1})
    _check("Concat", {"a": _x(rng, 2), "b": _x(rng, 2), "c": _x(rng, 2)}, ["a", "b", "c"], {"axis": 0})
    _check("Expand", {"x": _x(rng, 2, 3, 1), "shape": _i64(1, 1, 4)}, ["x"], opset=11)
    _check("Expand", {"x": _x(rng, 1, 2, 3), "shape": _i64(4, 5, 1, 1)}, ["x"])
    _check("Expand", {"x": _x(rng, 2, 3, 1), "shape": _i64(1, 1)}, ["x"])
    x = rng.permutation(8).reshape(2, 2, 2).astype(np.float64)
    _check("TopK", {"x": x, "k": _i64(1)}, ["x"], {"axis": -2}, opset=11, n_outputs=2)
    _check("TopK", {"x": rng.permutation(9).reshape(3, 3).astype(np.float64), "k": _i64(2)}, ["x"], opset=11,
           n_outputs=2)


def _declared(feeds: dict[str, np.ndarray]) -> dict[str, list[Any] | None]:
    return {n: list(v.shape) for n, v in feeds.items()}


@pytest.mark.parametrize("opset", [9, 11])
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_before_opset_13_flattens_at_its_axis(op: str, opset: int) -> None:
    """The default axis 1 normalizes over the last two axes of a (3, 4, 5) input together; axis 0 over all
    of it; axis 2 over the last."""
    rng = np.random.default_rng(6)
    for attrs in [{}, {"axis": 0}, {"axis": 2}, {"axis": -2}]:
        feeds = {"x": _x(rng, 3, 4, 5)}
        _check(op, feeds, ["x"], attrs, opset=opset, dims=_declared(feeds))


def test_gather_elements_index_shorter_on_another_axis() -> None:
    """Data (3, 3), index (2, 3) along axis 1, repeated entries: onnxruntime and the spec take it, and the
    gradient of data's third row is 0."""
    rng = np.random.default_rng(8)
    feeds = {"x": _x(rng, 3, 3), "i": _i64(1, 1, 1, 1, 1, 1).reshape(2, 3)}
    _check("GatherElements", feeds, ["x"], {"axis": 1}, opset=11, dims=_declared(feeds))
    feeds = {"x": _x(rng, 2, 2, 2), "i": _i64(1, 1, 1, 1).reshape(2, 1, 2)}
    _check("GatherElements", feeds, ["x"], {"axis": 1}, opset=11, dims=_declared(feeds))
