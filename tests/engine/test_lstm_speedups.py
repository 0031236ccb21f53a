"""The LSTM training step's speedups: the gradient's joint products with [W, R] (autodiff/rules/rnn.py,
rnn_unroll.py) and the per-step ``Mul(Concat(...), coef)`` fusion (engine/fusion/concat_mul.py)."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine.plan import Plan
from tests.engine.graphs import model

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")


def _ops(plan: Plan) -> list[str]:
    return [st.node.op_type for st in plan.steps]


# ---- Mul(Concat(...), c) -----------------------------------------------------------------------------------
def _gate_product() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Concat", ["dc", "dh", "dc", "dc"], ["cat"], axis=-1),
        helper.make_node("Mul", ["cat", "coef"], ["dg"]),
        helper.make_node("MatMul", ["dg", "r"], ["rec"]),
    ]
    return model(nodes, ["dc", "dh", "coef", "r"], ["dg", "rec"])


def test_concat_product_is_one_step_with_the_same_bits() -> None:
    fused, plain = Plan(_gate_product()), Plan(_gate_product(), fuse=False)
    assert _ops(fused) == ["ConcatProduct", "MatMul"]
    rng = np.random.default_rng(0)
    for dt in (np.float32, np.float64):
        shapes = {"dc": (1, 1, 5, 3), "dh": (1, 1, 5, 3), "coef": (1, 1, 5, 12), "r": (12, 3)}
        feeds = {k: rng.standard_normal(s).astype(dt) for k, s in shapes.items()}
        for a, b in zip(fused.run(feeds), plain.run(feeds)):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
    # a coefficient that broadcasts, or of another dtype: the two original kernels
    shapes = {"dc": (2, 3), "dh": (2, 3), "coef": (1, 12), "r": (12, 3)}
    feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    for a, b in zip(fused.run(feeds), plain.run(feeds)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("concat_first", [True, False])
def test_concat_product_keeps_the_muls_operand_order_for_nans(concat_first: bool) -> None:
    # where both factors are NaN the product is the first operand's NaN (its sign and payload, on x86)
    nodes = [helper.make_node("Concat", ["p0", "p1"], ["cat"], axis=1),
             helper.make_node("Mul", ["cat", "c"] if concat_first else ["c", "cat"], ["y"])]
    m = model(nodes, ["p0", "p1", "c"], ["y"])
    fused, plain = Plan(m), Plan(m, fuse=False)
    assert _ops(fused) == ["ConcatProduct"]
    nan = np.array([0x7FC00000], np.uint32).view(np.float32)[0]
    feeds = {"p0": np.full((2, 3), nan, np.float32), "p1": np.full((2, 3), nan, np.float32),
             "c": -np.full((2, 6), nan, np.float32)}
    feeds["p1"][0, 0] = 2.0
    got, want = fused.run(feeds)[0], plain.run(feeds)[0]
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.signbit(got[1, 0]) == (not concat_first)


def test_a_concat_made_from_shapes_alone_is_not_written_into() -> None:
    """A Concat whose pieces come from shapes alone is kept from the first run, read-only; the fused product
    multiplied into it ("output array is read-only": the gradient of a GRU's output.sum()). onnxruntime the
    oracle, two runs."""
    one = onnx.numpy_helper.from_array(np.array([1.0], np.float32))
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("ConstantOfShape", ["s"], ["ones"], value=one),
             helper.make_node("Concat", ["ones", "ones", "ones"], ["cat"], axis=-1),
             helper.make_node("Mul", ["cat", "c"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                                       helper.make_tensor_value_info("c", TensorProto.FLOAT, [2, 9])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 9])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    plan = Plan(m)
    for k in range(2):
        feeds = {"x": np.zeros((2, 3), np.float32), "c": np.arange(18, dtype=np.float32).reshape(2, 9) + k}
        np.testing.assert_array_equal(plan.run(feeds)[0], ref.run(None, feeds)[0])


def test_gru_output_sum_gradient_matches_torch() -> None:
    torch.manual_seed(0)
    gru = torch.nn.GRU(5, 3, num_layers=2).double()

    class Summed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gru = gru

        def forward(self, x):
            return self.gru(x)[0].sum()

    x = torch.randn(2, 3, 5, dtype=torch.float64)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(summed := Summed(), (x,), f, dynamo=False, input_names=["x"], output_names=["loss"],
                          opset_version=17, do_constant_folding=False)
    gm = build_gradient_model(onnx.load_from_string(f.getvalue()), "loss", ["x"])
    got = Plan(gm).run({"x": x.numpy()})
    xt = x.clone().requires_grad_()
    summed(xt).backward()
    np.testing.assert_allclose(got[[o.name for o in gm.graph.output].index("x_grad")], xt.grad.numpy(),
                               rtol=1e-10, atol=1e-12)


def test_concat_read_elsewhere_or_product_in_a_cluster_is_not_fused() -> None:
    nodes = [
        helper.make_node("Concat", ["a", "b"], ["cat"], axis=-1),
        helper.make_node("Mul", ["cat", "c"], ["p"]),
        helper.make_node("Identity", ["cat"], ["cat_out"]),
    ]
    assert "ConcatProduct" not in _ops(Plan(model(nodes, ["a", "b", "c"], ["p", "cat_out"])))
    nodes = [
        helper.make_node("Concat", ["a", "b"], ["cat"], axis=-1),
        helper.make_node("Mul", ["cat", "c"], ["p"]),
        helper.make_node("Tanh", ["p"], ["q"]),
    ]
    assert "ConcatProduct" not in _ops(Plan(model(nodes, ["a", "b", "c"], ["q"])))


# ---- the LSTM gradient's joint products -------------------------------------------------------------------
class _Lstm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.LSTM(6, 5, batch_first=True)
        self.head = torch.nn.Linear(5, 3)

    def forward(self, x):
        out, _ = self.rnn(x)
        return (self.head(out) ** 2).mean()


def _export(module, x: np.ndarray, dynamic_seq: bool) -> onnx.ModelProto:
    buf = io.BytesIO()
    axes = {"x": {0: "batch", 1: "seq"} if dynamic_seq else {0: "batch"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.from_numpy(x),), buf, dynamo=False, opset_version=17,
                          input_names=["x"], output_names=["loss"], training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False, dynamic_axes=axes)
    return onnx.load_from_string(buf.getvalue())


@pytest.mark.parametrize("dynamic_seq", [False, True], ids=["static", "dynamic"])
def test_lstm_weight_gradients_are_one_gemm_and_match_torch_and_onnxruntime(dynamic_seq: bool) -> None:
    torch.manual_seed(0)
    module = _Lstm()
    x = np.random.default_rng(1).standard_normal((4, 7, 6)).astype(np.float32)
    m = _export(module, x, dynamic_seq)
    params = [n for n, _ in module.named_parameters()]
    g = build_gradient_model(m, "loss", params)
    onnx.checker.check_model(g, full_check=True)
    types = [n.op_type for n in g.graph.node]
    assert "Einsum" not in types and types.count("Gemm") >= 2  # [dW, dR] in one Gemm (the head's too)
    plan = Plan(g)
    names = [o.name for o in g.graph.output]
    ours = dict(zip(names, plan.run({"x": x})))
    sess = ort.InferenceSession(g.SerializeToString(), providers=["CPUExecutionProvider"])
    theirs = dict(zip(names, sess.run(None, {"x": x})))
    module.zero_grad()
    module(torch.from_numpy(x)).backward()
    for n, p in module.named_parameters():
        a, r = ours[f"{n}_grad"], p.grad.numpy()
        scale = float(np.abs(r).max())
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-6 * scale, err_msg=n)
        np.testing.assert_allclose(theirs[f"{n}_grad"], a, rtol=1e-4, atol=1e-6 * scale, err_msg=n)


def test_bidirectional_lstm_keeps_its_einsums() -> None:
    """Two directions: no joint product (the per-direction weights stay batched Einsums)."""
    f = TensorProto.FLOAT
    rng = np.random.default_rng(2)
    inits = [onnx.numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in (("W", (2, 20, 3)), ("R", (2, 20, 5)))]
    node = helper.make_node("LSTM", ["X", "W", "R"], ["Y"], hidden_size=5, direction="bidirectional")
    red = helper.make_node("ReduceSum", ["Y"], ["loss"], keepdims=0)
    graph = helper.make_graph([node, red], "g", [helper.make_tensor_value_info("X", f, [4, 2, 3])],
                              [helper.make_tensor_value_info("loss", f, [])], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    g = build_gradient_model(m, "loss", ["W", "R"])
    onnx.checker.check_model(g, full_check=True)
    assert [n.op_type for n in g.graph.node].count("Einsum") == 2
