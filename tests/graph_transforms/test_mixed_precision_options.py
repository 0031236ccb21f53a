"""The mixed-precision pass's own options (``keep_fp32_nodes``, ``half_ops``, ``fp32_ops``): each either acts
on the values it names or is refused naming what is wrong; none is silently passed over."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.engine import compile_model
from onnxtrain.graph_transforms.mixed_precision import mixed_precision

RNG = np.random.default_rng(5)
W1 = (RNG.standard_normal((6, 8)) * 0.5).astype(np.float32)
W2 = (RNG.standard_normal((8, 4)) * 0.5).astype(np.float32)
X = RNG.standard_normal((3, 6)).astype(np.float32)


def _model() -> onnx.ModelProto:
    """x → MatMul W1 (mm1) → Tanh → Cast to float32 (to_f32) → MatMul W2 (mm2) → Softmax (sm) → probs, and
    loss = ReduceSumSquare(probs); ``h``, ``c`` and ``probs`` are outputs."""
    n = helper.make_node
    nodes = [n("MatMul", ["x", "W1"], ["h"], name="mm1"), n("Tanh", ["h"], ["t"], name="tanh"),
             n("Cast", ["t"], ["c"], name="to_f32", to=TensorProto.FLOAT),
             n("MatMul", ["c", "W2"], ["z"], name="mm2"), n("Softmax", ["z"], ["probs"], name="sm"),
             n("ReduceSumSquare", ["probs"], ["loss"], name="sum", keepdims=0)]
    out = [helper.make_tensor_value_info(k, TensorProto.FLOAT, s) for k, s in
           (("loss", []), ("h", [3, 8]), ("c", [3, 8]), ("probs", [3, 4]))]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 6])], out,
                          [numpy_helper.from_array(W1, "W1"), numpy_helper.from_array(W2, "W2")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    onnx.checker.check_model(model, full_check=True)
    names = ["h", "c", "probs"]
    return dict(zip(names, compile_model(model).run({"x": X, "loss_scale": np.ones(1, np.float32)}, names)))


def _producer_of(model: onnx.ModelProto, value: str) -> onnx.NodeProto:
    """The node computing ``value`` before the pass cast it back for the graph output (``<value>_fp16``)."""
    back = next(n for n in model.graph.node if value in n.output)
    if back.op_type == "Cast" and back.input[0] != "t":
        return next(n for n in model.graph.node if back.input[0] in n.output)
    return back


def test_a_kept_matmul_computes_in_float32() -> None:
    """keep_fp32_nodes=["mm1"]: h = x·W1 in float32, as float64 numpy rounds it (in float16 it is off by
    up to 2^-11 relative); without the option it is the half product."""
    want = X.astype(np.float64) @ W1.astype(np.float64)
    kept = _run(mixed_precision(_model(), "loss", keep_fp32_nodes=["mm1"]))["h"]
    np.testing.assert_allclose(kept, want, rtol=1e-6, atol=1e-6)
    half = _run(mixed_precision(_model(), "loss"))["h"]
    assert np.abs(half - want).max() > 1e-4  # (the default does round it: the test can tell the two apart)


def test_a_kept_cast_to_float32_stays_float32() -> None:
    """keep_fp32_nodes=["to_f32"]: the Cast still gives float32 (it was turned into a Cast to float16 like
    an unnamed one, the option passed over); its output ``c`` is then the float32 tanh of the half h."""
    mp = mixed_precision(_model(), "loss", keep_fp32_nodes=["to_f32"])
    cast = next(n for n in mp.graph.node if n.name == "to_f32")
    assert [a.i for a in cast.attribute if a.name == "to"] == [TensorProto.FLOAT]
    x16, w16 = (a.astype(np.float16).astype(np.float32) for a in (X, W1))
    h16 = (x16 @ w16).astype(np.float16)
    # the engine's float16 Tanh computes in float32 and rounds once to float16: the kept Cast gives that value
    want = np.tanh(h16.astype(np.float64)).astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(_run(mp)["c"], want, rtol=0, atol=1e-3)


def test_unknown_kept_node_names_are_refused() -> None:
    with pytest.raises(ValueError, match=r"keep_fp32_nodes.*'mm3'.*no node"):
        mixed_precision(_model(), "loss", keep_fp32_nodes=["mm1", "mm3"])


def test_an_op_given_in_half_ops_leaves_the_default_float32_list() -> None:
    """half_ops naming Softmax (in the default fp32_ops) runs it in the half type: probs are float16 values
    (each one exactly representable in float16), where Softmax stayed float32 and the option did nothing."""
    mp = mixed_precision(_model(), "loss", half_ops=["MatMul", "Softmax"])
    assert _producer_of(mp, "probs").op_type == "Softmax"
    probs = _run(mp)["probs"]
    np.testing.assert_array_equal(probs.astype(np.float16).astype(np.float32), probs)
    default = _run(mixed_precision(_model(), "loss"))["probs"]
    assert not np.array_equal(default.astype(np.float16).astype(np.float32), default)


def test_an_op_given_in_fp32_ops_leaves_the_default_half_list() -> None:
    """fp32_ops naming MatMul (in the default half_ops) keeps every MatMul float32: h is x·W1 to float32's
    rounding."""
    want = X.astype(np.float64) @ W1.astype(np.float64)
    h = _run(mixed_precision(_model(), "loss", fp32_ops=["Softmax", "ReduceSumSquare", "MatMul"]))["h"]
    np.testing.assert_allclose(h, want, rtol=1e-6, atol=1e-6)


def test_an_op_given_in_both_lists_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'Softmax'.*both half_ops and fp32_ops"):
        mixed_precision(_model(), "loss", half_ops=["MatMul", "Softmax"], fp32_ops=["Softmax"])
