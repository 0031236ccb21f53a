"""SoftmaxCrossEntropyLoss rewritten for onnxruntime (onnxtrain/engine/ort_losses.py): the values of
onnxruntime's own run of the original node and of torch's cross_entropy, every reduction, with class
weights and an ignore_index."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.engine.ort_rewrites import rewrite_for_onnxruntime

ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")


def loss_model(elem: int = TensorProto.FLOAT, labels: int = TensorProto.INT64, weights: bool = False,
               outputs: int = 2, opset: int = 17, rank: int = 2, **attrs) -> onnx.ModelProto:
    """scores (N, C[, D]), labels → SoftmaxCrossEntropyLoss → loss[, log_prob], both graph outputs."""
    shape = ["N", 5] + [3] * (rank - 2)
    inputs = [helper.make_tensor_value_info("x", elem, shape),
              helper.make_tensor_value_info("t", labels, ["N"] + [3] * (rank - 2))]
    names = ["x", "t"]
    if weights:
        inputs.append(helper.make_tensor_value_info("w", elem, [5]))
        names.append("w")
    outs = ["loss", "log_prob"][:outputs]
    node = helper.make_node("SoftmaxCrossEntropyLoss", names, outs, name="sce", **attrs)
    g = helper.make_graph([node], "sce", inputs, [helper.make_tensor_value_info(o, elem, None) for o in outs])
    return onnx.shape_inference.infer_shapes(
        helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9))


def run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def feeds(n: int, elem: int, labels: int, weights: bool, ignore: int | None, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    t = rng.integers(0, 5, n)
    if ignore is not None:
        t[::3] = ignore
    out = {"x": (rng.standard_normal((n, 5)) * 3).astype(dtype),
           "t": t.astype(helper.tensor_dtype_to_np_dtype(labels))}
    if weights:
        out["w"] = rng.uniform(0.2, 2.0, 5).astype(dtype)
    return out


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("ignore", [None, -100, 2])
@pytest.mark.parametrize("elem,labels", [(TensorProto.FLOAT, TensorProto.INT64),
                                         (TensorProto.DOUBLE, TensorProto.INT32)])
def test_two_d_loss_by_gather_equals_the_node_and_torch(reduction, weights, ignore, elem, labels) -> None:
    attrs = {"reduction": reduction} | ({} if ignore is None else {"ignore_index": ignore})
    model = loss_model(elem, labels, weights, **attrs)
    new = rewrite_for_onnxruntime(model)
    onnx.checker.check_model(new, full_check=True)
    ops = [n.op_type for n in new.graph.node]
    assert "SoftmaxCrossEntropyLoss" not in ops and "LogSoftmax" in ops, ops
    read = {i for n in new.graph.node for i in n.input}
    assert [t.name for t in new.graph.initializer if t.name not in read] == []
    for n in (7, 1, 12):
        f = feeds(n, elem, labels, weights, ignore, seed=n)
        if ignore == 2 and n == 1:
            f["t"][:] = 1  # a batch of one ignored row gives 0 / 0 for the mean: not compared here
        want, got = run(model, f), run(new, f)
        tol = 1e-6 if elem == TensorProto.FLOAT else 1e-13
        for a, b in zip(want, got):
            assert a.shape == b.shape and a.dtype == b.dtype
            np.testing.assert_allclose(b, a, rtol=tol, atol=tol)
        ref = torch.nn.functional.cross_entropy(
            torch.from_numpy(f["x"].astype(np.float64)), torch.from_numpy(f["t"].astype(np.int64)),
            weight=torch.from_numpy(f["w"].astype(np.float64)) if weights else None,
            ignore_index=-100 if ignore is None else ignore, reduction=reduction)
        np.testing.assert_allclose(got[0], ref.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[1], torch.log_softmax(torch.from_numpy(f["x"]), 1).numpy(),
                                   rtol=1e-5, atol=1e-6)


def test_unweighted_mean_gives_the_nodes_bits() -> None:
    """The common case (float, mean, no weights or ignore_index): onnxruntime's own bits."""
    model = loss_model()
    new = rewrite_for_onnxruntime(model)
    rng = np.random.default_rng(1)
    f = {"x": rng.standard_normal((256, 5)).astype(np.float32), "t": rng.integers(0, 5, 256)}
    for a, b in zip(run(model, f), run(new, f)):
        np.testing.assert_array_equal(a, b)


def test_one_output_and_a_log_prob_read_by_others() -> None:
    """Without the log_prob output the rewrite names its own; the loss is the same."""
    model = loss_model(outputs=1)
    new = rewrite_for_onnxruntime(model)
    onnx.checker.check_model(new, full_check=True)
    f = feeds(6, TensorProto.FLOAT, TensorProto.INT64, False, None)
    np.testing.assert_allclose(run(new, f)[0], run(model, f)[0], rtol=1e-6)


@pytest.mark.parametrize("kwargs", [{"rank": 3}, {"opset": 12}])
def test_other_losses_are_left_alone(kwargs) -> None:
    """Scores of rank 3 and graphs below opset 13 keep the node."""
    model = loss_model(**kwargs)
    assert rewrite_for_onnxruntime(model) is model


def test_an_ignore_index_no_label_of_the_type_holds_ignores_nothing() -> None:
    """int32 labels and ignore_index 2**40: no label can equal it (the rewrite failed making the constant)."""
    model = loss_model(TensorProto.FLOAT, TensorProto.INT32, ignore_index=2**40)
    f = feeds(12, TensorProto.FLOAT, TensorProto.INT32, False, None)
    want = run(model, f)
    got = run(rewrite_for_onnxruntime(model), f)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    x, t = torch.from_numpy(f["x"]), torch.from_numpy(f["t"].astype(np.int64))
    np.testing.assert_allclose(got[0], torch.nn.functional.cross_entropy(x, t).numpy(), rtol=1e-5)
