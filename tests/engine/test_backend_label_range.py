"""Class labels outside [0, C) that are not the loss's ignore_index, on the onnxruntime backend.

onnxruntime 1.32 runs ``SoftmaxCrossEntropyLoss`` and ``NegativeLogLikelihoodLoss`` through a GatherElements,
which takes a label of −1 (down to −C) as a class counted from the end: the loss of the last class, without
a word. The numpy engine refuses such labels, as torch's ``cross_entropy`` and ``nll_loss`` do; the backend
now refuses them too, with the numpy engine's error (an EngineError naming the loss node and its message).
Labels in range, and ignored ones, keep torch's values.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain import InferenceSession
from onnxtrain.engine.plan import EngineError
from onnxtrain.session import TrainingSession
from tests.session.helpers import backend_options, mlp_model, params

onnxruntime = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

C = 3
MESSAGE = f"target holds class indices outside [0, {C}) that are not ignore_index"


def loss_model(op: str, spatial: bool, opset: int, labels: int = TensorProto.INT64,
               ignore: int | None = None, reduction: str = "mean", static_classes: bool = True,
               in_if: bool = False) -> onnx.ModelProto:
    """scores [N, C(, D)] → op (NLL after a LogSoftmax) with labels [N(, D)] → loss; ``in_if``: the loss
    inside the then-branch of an If on a fed flag (the else-branch gives 0)."""
    classes = C if static_classes else "C"
    s_shape, y_shape = (["N", classes, "D"], ["N", "D"]) if spatial else (["N", classes], ["N"])
    attrs = {"reduction": reduction} | ({} if ignore is None else {"ignore_index": ignore})
    nll = op == "NegativeLogLikelihoodLoss"
    first = (helper.make_node("LogSoftmax", ["s"], ["p"], axis=1) if nll
             else helper.make_node("Identity", ["s"], ["p"]))
    nodes = [first,
             helper.make_node(op, ["p", "y"], ["loss"], name="the_loss", **attrs)]
    inputs = [helper.make_tensor_value_info("s", TensorProto.FLOAT, s_shape),
              helper.make_tensor_value_info("y", labels, y_shape)]
    if in_if:
        then = helper.make_graph(nodes, "then", [],
                                 [helper.make_tensor_value_info("loss", TensorProto.FLOAT, None)])
        zero = helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])
        other = helper.make_graph([helper.make_node("Constant", [], ["z"], value=zero)], "else", [],
                                  [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)])
        nodes = [helper.make_node("If", ["flag"], ["out"], name="branch", then_branch=then,
                                  else_branch=other)]
        inputs.append(helper.make_tensor_value_info("flag", TensorProto.BOOL, []))
        out = "out"
    else:
        out = "loss"
    g = helper.make_graph(nodes, "loss", inputs,
                          [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def torch_loss(op: str, s: np.ndarray, y: np.ndarray, ignore: int | None, reduction: str) -> np.ndarray:
    x = torch.from_numpy(s.astype(np.float64))
    t = torch.from_numpy(y.astype(np.int64))
    kw = {"ignore_index": -100 if ignore is None else ignore, "reduction": reduction}
    if op == "NegativeLogLikelihoodLoss":
        return torch.nn.functional.nll_loss(torch.log_softmax(x, 1), t, **kw).numpy()
    return torch.nn.functional.cross_entropy(x, t, **kw).numpy()


def feeds(s: np.ndarray, y: np.ndarray, in_if: bool) -> dict:
    return {"s": s, "y": y} | ({"flag": np.array(True)} if in_if else {})


def assert_refused(sess: InferenceSession, f: dict) -> None:
    with pytest.raises(EngineError) as e:
        sess.run(None, f)
    assert MESSAGE in str(e.value), str(e.value)
    assert "'the_loss'" in str(e.value), str(e.value)


@pytest.mark.parametrize("level", [None, 0], ids=["optimised", "optimisations_off"])
@pytest.mark.parametrize("opset", [13, 17])
@pytest.mark.parametrize("spatial", [False, True], ids=["2d", "spatial"])
@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
def test_labels_out_of_range_are_refused_as_on_numpy(op, spatial, opset, level):
    """Labels −1, −C, C and a large one, with and without an ignore_index of −100: refused on both engines
    with the numpy engine's message; labels in range (ignored ones among them) give torch's loss."""
    rng = np.random.default_rng(0)
    extra = (2,) if spatial else ()
    s = rng.standard_normal((4, C, *extra)).astype(np.float32)
    for ignore in (None, -100):
        model = loss_model(op, spatial, opset, ignore=ignore).SerializeToString()
        sessions = [InferenceSession(model, backend_options("onnxruntime", level)), InferenceSession(model)]
        for bad in (-1, -C, C, 1000):
            y = rng.integers(0, C, (4, *extra))
            y.reshape(-1)[1] = bad
            for sess in sessions:
                assert_refused(sess, feeds(s, y, False))
        y = rng.integers(0, C, (4, *extra))
        if ignore is not None:
            y.reshape(-1)[0] = ignore
        want = torch_loss(op, s, y, ignore, "mean")
        for sess in sessions:
            np.testing.assert_allclose(sess.run(None, feeds(s, y, False))[0], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("labels", [TensorProto.INT32, TensorProto.INT64], ids=["int32", "int64"])
@pytest.mark.parametrize("static_classes", [True, False], ids=["static_C", "symbolic_C"])
@pytest.mark.parametrize("in_if", [False, True], ids=["main_graph", "if_body"])
@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
def test_label_types_symbolic_classes_and_bodies(op, in_if, static_classes, labels):
    """int32 and int64 labels, a class count known only at run time, the loss inside an If's branch; an
    ignore_index of 2 (in range: its rows left out) and of −1 (then a label −1 is ignored, not refused)."""
    rng = np.random.default_rng(1)
    s = rng.standard_normal((5, C)).astype(np.float32)
    dtype = helper.tensor_dtype_to_np_dtype(labels)
    for ignore in (2, -1):
        model = loss_model(op, False, 17, labels, ignore, "sum", static_classes, in_if).SerializeToString()
        sess = InferenceSession(model, backend_options("onnxruntime"))
        y = np.array([0, 1, 2, -1, 1], dtype)
        if ignore == 2:
            assert_refused(sess, feeds(s, y, in_if))
            assert_refused(InferenceSession(model), feeds(s, y, in_if))
            y[3] = 2
        want = torch_loss(op, s, y, ignore, "sum")
        np.testing.assert_allclose(sess.run(None, feeds(s, y, in_if))[0], want, rtol=1e-5, atol=1e-6)
        y[4] = C
        assert_refused(sess, feeds(s, y, in_if))
        if in_if:  # the branch not taken checks nothing
            f = feeds(s, y, in_if) | {"flag": np.array(False)}
            assert sess.run(None, f)[0] == 0


@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
def test_an_empty_batch_runs_as_torch(op):
    """No labels at all: nothing to refuse; torch's loss (0 summed, NaN for the mean of nothing) on both
    engines (plain onnxruntime's own cross-entropy body fails on an empty batch)."""
    s, y = np.zeros((0, C), np.float32), np.zeros((0,), np.int64)
    for reduction in ("sum", "mean", "none"):
        model = loss_model(op, False, 17, ignore=-100, reduction=reduction).SerializeToString()
        want = torch_loss(op, s, y, None, reduction)
        for backend in ("onnxruntime", "numpy"):
            got = InferenceSession(model, backend_options(backend)).run(None, {"s": s, "y": y})[0]
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want)


@pytest.mark.parametrize("level", [None, 0], ids=["optimised", "optimisations_off"])
def test_training_step_with_a_label_of_minus_one_is_refused(level):
    """A legacy training step whose labels hold −1: refused on the backend as on the numpy engine, and no
    weight changes; the same step with the label in range trains as torch."""
    model = mlp_model(loss="sce")
    lr = np.array([0.1], np.float32)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 8)).astype(np.float32)
    y = rng.integers(0, 4, 6)
    y[2] = -1
    sessions = {b: TrainingSession(model, params(), backend_options(b, level if b == "onnxruntime" else None))
                for b in ("numpy", "onnxruntime")}
    for sess in sessions.values():
        before = {k: v.copy() for k, v in sess.get_state().items()}
        with pytest.raises(EngineError) as e:
            sess.run(["loss"], {"x": x, "y": y, "Learning_Rate": lr})
        assert "target holds class indices outside [0, 4) that are not ignore_index" in str(e.value)
        for k, v in sess.get_state().items():
            np.testing.assert_array_equal(v, before[k])
    y[2] = 3
    w = {t.name: torch.tensor(onnx.numpy_helper.to_array(t).copy(), requires_grad=True)
         for t in model.graph.initializer}
    logits = torch.relu(torch.tensor(x) @ w["W1"].T + w["b1"]) @ w["W2"].T + w["b2"]
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(y))
    loss.backward()
    for sess in sessions.values():
        assert float(sess.run(["loss"], {"x": x, "y": y, "Learning_Rate": lr})[0]) == pytest.approx(
            loss.item(), rel=1e-5)
        state = sess.get_state()
        for k, t in w.items():
            np.testing.assert_allclose(state[k], (t - 0.1 * t.grad).detach().numpy(), rtol=1e-5, atol=1e-6)
