"""Gradients through two elements of one sequence whose shapes broadcast against each other. ONNX shape
inference gives all the elements of a sequence one element type (``3 x unk__0`` for elements [3, 4] and
[3, 1]), so both SequenceAt outputs carried the same symbolic dim and the gradient of the smaller element
was not summed over the broadcast axis: it came out [3, 4] instead of [3, 1], and the legacy session then
changed the weight's shape. The oracle is float64 central differences of the loss run by onnxruntime; both
onnxruntime and onnxtrain's engine run the emitted gradient graph."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from tests.autodiff.grad_runs import gradients_by_both

ort = pytest.importorskip("onnxruntime")
N, D = helper.make_node, TensorProto.DOUBLE
BINARY = ["Add", "Sub", "Mul", "Div", "Max", "Min", "Pow"]


def _vi(name: str, dims: list | None, et: int = D) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, et, dims)


def _seq_vi(name: str) -> onnx.ValueInfoProto:
    element = helper.make_tensor_type_proto(D, None)
    return helper.make_value_info(name, helper.make_sequence_type_proto(element))


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
           inits: list[onnx.TensorProto] = ()) -> onnx.ModelProto:
    idx = [numpy_helper.from_array(np.array(i, np.int64), f"i{i}") for i in (0, 1)]
    g = helper.make_graph(nodes, "g", inputs, [_vi("loss", [])], [*idx, *inits])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def _ort_loss(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> float:
    so = ort.SessionOptions()
    so.log_severity_level = 4
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return float(sess.run(["loss"], feeds)[0])


def _with_initializer(model: onnx.ModelProto, name: str, value: np.ndarray) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for t in m.graph.initializer:
        if t.name == name:
            t.CopyFrom(numpy_helper.from_array(value, name))
    return m


def _fd(model: onnx.ModelProto, feeds: dict[str, np.ndarray], w: str, eps: float = 1e-6) -> np.ndarray:
    """d loss / d w by float64 central differences (w a feed or an initializer)."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    base = feeds[w] if w in feeds else inits[w]
    out = np.zeros_like(base)
    for idx in np.ndindex(base.shape):
        vals = []
        for step in (eps, -eps):
            b = base.copy()
            b[idx] += step
            if w in feeds:
                vals.append(_ort_loss(model, {**feeds, w: b}))
            else:
                vals.append(_ort_loss(_with_initializer(model, w, b), feeds))
        out[idx] = (vals[0] - vals[1]) / (2 * eps)
    return out


def _check(model: onnx.ModelProto, feeds: dict[str, np.ndarray], wrt: list[str]) -> onnx.ModelProto:
    grad, runs = gradients_by_both(model, feeds, wrt)
    for w in wrt:
        want = _fd(model, feeds, w)
        for got in runs:
            g = np.asarray(got[f"{w}_grad"])
            assert g.shape == want.shape, (w, g.shape, want.shape)
            np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7, err_msg=w)
    return grad


def _pair_nodes(op: str, swap: bool) -> list[onnx.NodeProto]:
    """[sigmoid(x) [3, 4], exp(v) [3, 1]] as one sequence, its two elements combined by ``op``."""
    ab = ["c", "a"] if swap else ["a", "c"]
    return [N("Sigmoid", ["x"], ["xs"]), N("Exp", ["v"], ["ve"]),
            N("SequenceConstruct", ["xs", "ve"], ["s"]),
            N("SequenceAt", ["s", "i0"], ["a"]), N("SequenceAt", ["s", "i1"], ["c"]),
            N(op, ab, ["y"]), N("ReduceSum", ["y"], ["loss"], keepdims=0)]


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {"x": rng.standard_normal((3, 4)), "v": rng.standard_normal((3, 1))}


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("op", BINARY)
def test_constructed_elements_broadcast(op: str, swap: bool) -> None:
    m = _model(_pair_nodes(op, swap), [_vi("x", [3, 4]), _vi("v", [3, 1])])
    _check(m, _feeds(), ["x", "v"])


@pytest.mark.parametrize("swap", [False, True])
def test_where_of_constructed_elements(swap: bool) -> None:
    nodes = _pair_nodes("Mul", swap)[:-2]
    nodes += [N("Where", ["cond", "c", "a"] if swap else ["cond", "a", "c"], ["y"]),
              N("Sin", ["y"], ["z"]), N("ReduceSum", ["z"], ["loss"], keepdims=0)]
    m = _model(nodes, [_vi("x", [3, 4]), _vi("v", [3, 1]), _vi("cond", [3, 1], TensorProto.BOOL)])
    feeds = {**_feeds(), "cond": np.array([[True], [False], [True]])}
    _check(m, feeds, ["x", "v"])


def _split_model(op: str, static: bool) -> onnx.ModelProto:
    """h = x @ W split [1, 3] along axis 1 into a sequence; sin(element 0) ``op`` element 1."""
    nodes = [N("MatMul", ["x", "W"], ["h"]), N("SplitToSequence", ["h", "sp"], ["s"], axis=1),
             N("SequenceAt", ["s", "i0"], ["a"]), N("SequenceAt", ["s", "i1"], ["c"]),
             N("Sigmoid", ["a"], ["a2"]), N("Sigmoid", ["c"], ["c2"]),
             N(op, ["a2", "c2"], ["y"]), N("Sin", ["y"], ["z"]), N("ReduceSum", ["z"], ["loss"], keepdims=0)]
    inits = [numpy_helper.from_array(np.linspace(-1, 1, 16).reshape(4, 4), "W"),
             numpy_helper.from_array(np.array([1, 3], np.int64), "sp")]
    return _model(nodes, [_vi("x", [3, 4] if static else ["n", "k"])], inits)


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("op", BINARY)
def test_split_elements_broadcast(op: str, static: bool) -> None:
    x = np.arange(12, dtype=np.float64).reshape(3, 4) / 10
    _check(_split_model(op, static), {"x": x}, ["W"])


def test_if_sequence_output_elements_broadcast() -> None:
    """The elements of a sequence an If returns: their merged type shares one dim too."""
    seq = [N("Sigmoid", ["x"], ["xs"]), N("Exp", ["v"], ["ve"])]
    then = helper.make_graph([*seq, N("SequenceConstruct", ["xs", "ve"], ["t"])], "then", [], [_seq_vi("t")])
    other = helper.make_graph([*seq, N("SequenceConstruct", ["ve", "xs"], ["e"])], "else", [], [_seq_vi("e")])
    nodes = [N("If", ["cond"], ["s"], then_branch=then, else_branch=other),
             N("SequenceAt", ["s", "i0"], ["a"]), N("SequenceAt", ["s", "i1"], ["c"]),
             N("Mul", ["a", "c"], ["y"]), N("ReduceSum", ["y"], ["loss"], keepdims=0)]
    m = _model(nodes, [_vi("x", [3, 4]), _vi("v", [3, 1]), _vi("cond", [], TensorProto.BOOL)])
    for c in (True, False):
        _check(m, {**_feeds(), "cond": np.array(c)}, ["v"])


def test_legacy_session_keeps_the_weight_shape() -> None:
    """One SGD step of the legacy TrainingSession updates v [3, 1] by the gradient, keeping its shape."""
    v0 = np.array([[0.1], [-0.2], [0.3]])
    x = np.arange(12, dtype=np.float64).reshape(3, 4) / 10
    nodes = _pair_nodes("Mul", False)
    m = _model(nodes, [_vi("x", [3, 4])], [numpy_helper.from_array(v0, "v")])
    want = v0 - 0.1 * _fd(m, {"x": x}, "v")
    p = onnxtrain.TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    s = onnxtrain.TrainingSession(m.SerializeToString(), p)
    s.run(["loss"], {"x": x, "Learning_Rate": np.array([0.1], np.float32)})
    got = s.get_state()["v"]
    assert got.shape == (3, 1)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)


def test_ordinary_broadcast_keeps_its_static_reduction() -> None:
    """Without a sequence, a shared named dim still tells the builder that an operand is not broadcast along
    it: the gradient sums over the known axes, with no shape computed at run time. (Both n come from the one
    input x here: two inputs declared with n could be fed n and 1 rows, a broadcast.)"""
    nodes = [N("ReduceMean", ["x", "one"], ["b"], keepdims=1), N("Mul", ["x", "b"], ["y"]),
             N("Sin", ["y"], ["z"]), N("ReduceSum", ["z"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [_vi("x", ["n", 4])], [_vi("loss", [])],
                          [onnx.numpy_helper.from_array(np.array([1], np.int64), "one")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    rng = np.random.default_rng(5)
    grad = _check(m, {"x": rng.standard_normal((3, 4))}, ["x"])
    assert not any(n.op_type == "NonZero" for n in grad.graph.node)
