"""Inputs fed different sizes of one symbolic dimension fail on the onnxruntime backend as on numpy.

onnxruntime 1.32 runs a cross-entropy (``SoftmaxCrossEntropyLoss``, ONNX's function body or the backend's
gather, and ``NegativeLogLikelihoodLoss``) on 5 score rows and 4 labels without a word: it trains on the
first 4 rows. The backend reshapes the labels to the scores' batch before the loss (engine/ort_rewrites.py),
so that the run fails there, and a failed run whose inputs disagree on a shared dimension is a ValueError
naming them, the dimension and the sizes (engine/feed_sizes.py), as on the numpy engine. Matching batches
train to torch's losses and the numpy engine's; the names alone refuse nothing (a model that reuses "batch"
for a flattened batch·sequence axis trains on both backends: tests/training/test_ondevice_batch_mismatch.py).
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain import InferenceSession, RunOptions
from onnxtrain.engine.ort_rewrites import for_onnxruntime
from onnxtrain.engine.plan import EngineError
from onnxtrain.ir.builder import NameGen
from onnxtrain.ir.graphs import walk_graphs
from onnxtrain.session import TrainingSession
from tests.session.helpers import backend_options, mlp_model, params

onnxruntime = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

TOL = 1e-5
LR = 0.1


def assert_names(msg: str, a: str, b: str, dim: str, sizes: tuple[int, int] = (5, 4)) -> None:
    assert f"inputs {a!r} and {b!r} share dimension {dim!r}" in msg, msg
    assert f"have sizes {sizes[0]} and {sizes[1]}" in msg, msg


# ---- the on-device Module ---------------------------------------------------------------------------

class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A torch MLP exported with its batch named "batch", and its artifacts per loss (SGD)."""
    from onnxtrain.training import artifacts

    folder = tmp_path_factory.mktemp("ort_batch")
    torch.manual_seed(0)
    net = Net()
    path = str(folder / "mlp.onnx")
    torch.onnx.export(net, torch.randn(2, 4), path, input_names=["input"], output_names=["output"],
                      dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}}, dynamo=False,
                      opset_version=17)
    model = onnx.load(path)
    folders = {}
    for name, loss in (("mse", artifacts.LossType.MSELoss), ("ce", artifacts.LossType.CrossEntropyLoss)):
        folders[name] = str(folder / name)
        os.makedirs(folders[name])
        artifacts.generate_artifacts(model, requires_grad=[t.name for t in model.graph.initializer],
                                     loss=loss, optimizer=artifacts.OptimType.SGD,
                                     artifact_directory=folders[name])
    return folders, net


def module(folder: str, backend: str):
    from onnxtrain.training.api import CheckpointState, Module, Optimizer

    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    m = Module(os.path.join(folder, "training_model.onnx"), state, os.path.join(folder, "eval_model.onnx"),
               session_options=backend_options(backend))
    opt = Optimizer(os.path.join(folder, "optimizer_model.onnx"), m)
    opt.set_learning_rate(LR)
    return m, opt


def labels(loss: str, n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((n, 3)).astype(np.float32) if loss == "mse" else rng.integers(0, 3, n)


def torch_loss(loss: str, out: torch.Tensor, y: np.ndarray) -> torch.Tensor:
    if loss == "mse":
        return torch.nn.functional.mse_loss(out, torch.tensor(y))
    return torch.nn.functional.cross_entropy(out, torch.tensor(y))


def test_module_batch_mismatch_is_a_named_value_error(exported):
    """5 inputs with 4 labels: train and eval raise the numpy engine's ValueError on onnxruntime too (the
    cross-entropy used to train on the first 4 rows, with only a warning; the MSE's Sub already failed)."""
    folders, _ = exported
    x = np.ones((5, 4), np.float32)
    for loss, name in (("ce", "labels"), ("mse", "target")):
        y = labels(loss, 4, np.random.default_rng(0))
        for backend in ("numpy", "onnxruntime"):
            m, _ = module(folders[loss], backend)
            for mode in (m.train, m.eval):
                mode()
                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # no "the run went through" warning
                    with pytest.raises(ValueError) as e:
                        m(x, y)
                assert_names(str(e.value), "input", name, "batch")
            m.train()
            rng = np.random.default_rng(1)
            assert np.isfinite(float(m(rng.standard_normal((5, 4)).astype(np.float32), labels(loss, 5, rng))))


@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_module_matching_batches_train_as_torch_and_numpy(exported, loss):
    """Five SGD steps of batch 6 and an eval: torch's losses (autograd and torch.optim.SGD as the oracle)
    and the numpy engine's, within 1e-5, on the onnxruntime backend."""
    folders, net = exported
    ref = Net()
    ref.load_state_dict(net.state_dict())
    sgd = torch.optim.SGD(ref.parameters(), lr=LR)
    runs = {b: module(folders[loss], b) for b in ("numpy", "onnxruntime")}
    rng = np.random.default_rng(2)
    for _ in range(5):
        x, y = rng.standard_normal((6, 4)).astype(np.float32), labels(loss, 6, rng)
        sgd.zero_grad()
        want = torch_loss(loss, ref(torch.tensor(x)), y)
        want.backward()
        sgd.step()
        got = {}
        for b, (m, opt) in runs.items():
            got[b] = float(m(x, y))
            opt.step()
            m.lazy_reset_grad()
        assert got["onnxruntime"] == pytest.approx(want.item(), rel=TOL, abs=TOL)
        assert got["onnxruntime"] == pytest.approx(got["numpy"], rel=TOL, abs=TOL)
    x, y = rng.standard_normal((7, 4)).astype(np.float32), labels(loss, 7, rng)
    with torch.no_grad():
        want = torch_loss(loss, ref(torch.tensor(x)), y).item()
    for m, _ in runs.values():
        m.eval()
        assert float(m(x, y)) == pytest.approx(want, rel=TOL, abs=TOL)


# ---- the legacy TrainingSession ---------------------------------------------------------------------

def legacy_feeds(loss: str, n_x: int, n_y: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, n_y) if loss == "sce" else rng.standard_normal((n_y, 4)).astype(np.float32)
    return {"x": rng.standard_normal((n_x, 8)).astype(np.float32), "y": y}


@pytest.mark.parametrize("level", [None, 0], ids=["optimised", "optimisations_off"])
@pytest.mark.parametrize("loss", ["sce", "mse"])
def test_legacy_batch_mismatch_is_a_named_value_error(loss, level):
    """A training step and a forward-only run on 5 inputs and 4 labels: a ValueError naming x, y, the
    dimension N and the sizes, which is also an EngineError (the numpy engine's kind); before, the
    cross-entropy trained on 4 rows and the MSE's failure named neither the inputs nor the dimension."""
    sess = TrainingSession(mlp_model(loss=loss), params(), backend_options("onnxruntime", level))
    feeds = legacy_feeds(loss, 5, 4)
    before = {k: v.copy() for k, v in sess.get_state().items()}
    with pytest.raises(ValueError) as e:
        sess.run(["loss"], {**feeds, "Learning_Rate": np.array([LR], np.float32)})
    assert isinstance(e.value, EngineError)
    assert_names(str(e.value), "x", "y", "N")
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    with pytest.raises(ValueError) as e:
        sess.run(["loss"], feeds, ro)
    assert_names(str(e.value), "x", "y", "N")
    for k, v in sess.get_state().items():  # nothing trained
        np.testing.assert_array_equal(v, before[k])
    with pytest.raises(ValueError) as e:  # the numpy engine fails the same step, named the same way
        TrainingSession(mlp_model(loss=loss), params()).run(
            ["loss"], {**feeds, "Learning_Rate": np.array([LR], np.float32)})
    assert isinstance(e.value, EngineError)
    assert_names(str(e.value), "x", "y", "N")


@pytest.mark.parametrize("loss", ["sce", "mse"])
def test_legacy_matching_batches_train_as_torch_and_numpy(loss):
    """Five SGD steps of batch 6 on both engines: torch's losses and the numpy engine's, within 1e-5."""
    model = mlp_model(loss=loss)
    w = {t.name: torch.tensor(onnx.numpy_helper.to_array(t).copy(), requires_grad=True)
         for t in model.graph.initializer}
    sgd = torch.optim.SGD(list(w.values()), lr=LR)
    sessions = {b: TrainingSession(model, params(), backend_options(b)) for b in ("numpy", "onnxruntime")}
    for step in range(5):
        feeds = legacy_feeds(loss, 6, 6, seed=10 + step)
        x = torch.tensor(feeds["x"])
        logits = torch.relu(x @ w["W1"].T + w["b1"]) @ w["W2"].T + w["b2"]
        y = torch.tensor(feeds["y"])
        want = (torch.nn.functional.cross_entropy(logits, y) if loss == "sce"
                else ((logits - y) ** 2).mean())
        sgd.zero_grad()
        want.backward()
        sgd.step()
        got = {b: float(s.run(["loss"], {**feeds, "Learning_Rate": np.array([LR], np.float32)})[0])
               for b, s in sessions.items()}
        assert got["onnxruntime"] == pytest.approx(want.item(), rel=TOL, abs=TOL)
        assert got["onnxruntime"] == pytest.approx(got["numpy"], rel=TOL, abs=TOL)


# ---- the losses the check covers, through an InferenceSession ----------------------------------------

def loss_model(op: str, spatial: bool, opset: int) -> onnx.ModelProto:
    """scores [N, 3(, D)] → op(LogSoftmax(scores) for NLL, labels [N(, D)]) → loss."""
    s_shape, y_shape = (["N", 3, "D"], ["N", "D"]) if spatial else (["N", 3], ["N"])
    nodes = [helper.make_node("LogSoftmax" if op == "NegativeLogLikelihoodLoss" else "Identity", ["s"], ["p"],
                              **({"axis": 1} if op == "NegativeLogLikelihoodLoss" else {}))]
    nodes.append(helper.make_node(op, ["p", "y"], ["loss"]))
    g = helper.make_graph(nodes, "loss", [helper.make_tensor_value_info("s", TensorProto.FLOAT, s_shape),
                                          helper.make_tensor_value_info("y", TensorProto.INT64, y_shape)],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


@pytest.mark.parametrize("opset", [13, 17])
@pytest.mark.parametrize("spatial", [False, True], ids=["2d", "spatial"])
@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
def test_label_losses_refuse_a_short_batch(op, spatial, opset):
    """Both label losses, 2-D and spatial scores, opsets with and without Shape's start and end: 4 labels
    for 5 score rows fail naming the inputs; matching labels give the numpy engine's loss."""
    model = loss_model(op, spatial, opset).SerializeToString()
    rng = np.random.default_rng(3)
    extra = (2,) if spatial else ()
    s = rng.standard_normal((5, 3, *extra)).astype(np.float32)
    sess = InferenceSession(model, backend_options("onnxruntime"))
    with pytest.raises(ValueError) as e:
        sess.run(["loss"], {"s": s, "y": rng.integers(0, 3, (4, *extra))})
    assert_names(str(e.value), "s", "y", "N")
    y = rng.integers(0, 3, (5, *extra))
    want = InferenceSession(model).run(["loss"], {"s": s, "y": y})[0]
    np.testing.assert_allclose(sess.run(["loss"], {"s": s, "y": y})[0], want, rtol=1e-6)


@pytest.mark.parametrize("opset", [13, 17])
@pytest.mark.parametrize("case", ["2d_column_labels", "spatial_transposed", "spatial_flat"])
def test_label_losses_refuse_labels_of_another_shape_with_as_many_values(case, opset):
    """Labels with as many values as the scores give but another shape: a column (N, 1) of labels for
    scores (N, C), a label map (N, W, H) for scores (N, C, H, W), a flat (N·H·W,) one. The numpy engine and
    plain onnxruntime refuse them; the backend's check must not reshape them into a loss that runs."""
    s_dims, y_dims, s, y = {
        "2d_column_labels": (["N", 3], ["N", 1], (4, 3), (4, 1)),
        "spatial_transposed": (["N", 3, "H", "W"], ["N", "W", "H"], (2, 3, 4, 5), (2, 5, 4)),
        "spatial_flat": (["N", 3, "H", "W"], ["M"], (2, 3, 4, 5), (40,)),
    }[case]
    g = helper.make_graph([helper.make_node("SoftmaxCrossEntropyLoss", ["s", "y"], ["loss"])], "loss",
                          [helper.make_tensor_value_info("s", TensorProto.FLOAT, s_dims),
                           helper.make_tensor_value_info("y", TensorProto.INT64, y_dims)],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    rng = np.random.default_rng(4)
    feeds = {"s": rng.standard_normal(s).astype(np.float32), "y": rng.integers(0, 3, y)}
    for backend in ("numpy", "onnxruntime"):
        with pytest.raises(Exception) as e:  # noqa: PT011 (onnxruntime may refuse it at load or at run)
            InferenceSession(model.SerializeToString(), backend_options(backend)).run(["loss"], feeds)
        assert isinstance(e.value, (EngineError, ValueError, RuntimeError)), (backend, e.value)


# ---- a plain InferenceSession --------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_inference_session_names_the_inputs_of_a_failed_run(backend):
    """``x`` and ``y`` both declared [N, 4], fed 5 and 4 rows: the Add fails, and the error names the two
    inputs and N (also an EngineError, the engine's kind); inputs that agree run."""
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 4]) for n in ("x", "y", "z")]
    g = helper.make_graph([helper.make_node("Add", ["x", "y"], ["z"])], "add", vi[:2], vi[2:])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    sess = InferenceSession(model.SerializeToString(), backend_options(backend),
                            providers=["CPUExecutionProvider"])
    x, y = np.ones((5, 4), np.float32), np.ones((4, 4), np.float32)
    with pytest.raises(ValueError) as e:
        sess.run(None, {"x": x, "y": y})
    assert isinstance(e.value, EngineError)
    assert_names(str(e.value), "x", "y", "N")
    np.testing.assert_array_equal(sess.run(None, {"x": x, "y": x})[0], x + x)


# ---- losses inside control-flow bodies ------------------------------------------------------------------

def body_loss_graph(name: str, scores: str, labels: str, out: str, op: str = "SoftmaxCrossEntropyLoss",
                    inputs: list | None = None, extra: list | None = None) -> onnx.GraphProto:
    """A body computing ``op`` of ``scores`` and ``labels`` (values of the graphs around it or its own
    inputs) into ``out``; ``extra``: more outputs, produced by nodes before the loss."""
    nodes = [helper.make_node("Identity", [scores], [f"{name}_p"]) if op == "SoftmaxCrossEntropyLoss"
             else helper.make_node("LogSoftmax", [scores], [f"{name}_p"], axis=1)]
    nodes.append(helper.make_node(op, [f"{name}_p", labels], [out]))
    outs = [helper.make_tensor_value_info(o, t, s) for o, t, s in (extra or [])]
    return helper.make_graph(nodes, name, inputs or [],
                             [*outs, helper.make_tensor_value_info(out, TensorProto.FLOAT, [])])


def loop_node(name: str, body: onnx.GraphProto, out: str) -> onnx.NodeProto:
    """A Loop of two iterations adding ``body``'s loss (its last output, computed from ``{name}_l``) to a
    carried zero: the loss twice."""
    g = onnx.GraphProto()
    g.CopyFrom(body)
    loss = g.output[-1].name
    g.node.append(helper.make_node("Add", [f"{name}_acc", loss], [f"{name}_acc_out"]))
    g.node.append(helper.make_node("Identity", [f"{name}_cond"], [f"{name}_cond_out"]))
    del g.input[:]
    g.input.extend([helper.make_tensor_value_info(f"{name}_i", TensorProto.INT64, []),
                    helper.make_tensor_value_info(f"{name}_cond", TensorProto.BOOL, []),
                    helper.make_tensor_value_info(f"{name}_acc", TensorProto.FLOAT, [])])
    del g.output[:]
    g.output.extend([helper.make_tensor_value_info(f"{name}_cond_out", TensorProto.BOOL, []),
                     helper.make_tensor_value_info(f"{name}_acc_out", TensorProto.FLOAT, [])])
    return helper.make_node("Loop", [f"{name}_trips", "", f"{name}_zero"], [out], body=g)


def control_flow_model(case: str, op: str, opset: int) -> onnx.ModelProto:
    """scores s [N, 3] and labels y [N] (Scan: [T, N, 3] and [T, N]) → a loss inside ``case``'s body (an
    If's branch on input c, a Loop's body, a Loop's body inside an If's branch, a Scan's body) → loss."""
    s_dims, y_dims = (["T", "N", 3], ["T", "N"]) if case == "scan" else (["N", 3], ["N"])
    inputs = [helper.make_tensor_value_info("s", TensorProto.FLOAT, s_dims),
              helper.make_tensor_value_info("y", TensorProto.INT64, y_dims)]
    if case.startswith("if"):
        inputs.append(helper.make_tensor_value_info("c", TensorProto.BOOL, []))
    loop_inits = [onnx.numpy_helper.from_array(np.array(2, np.int64), "outer_trips"),
                  onnx.numpy_helper.from_array(np.array(0, np.float32), "outer_zero")]
    other = helper.make_graph([helper.make_node("Constant", [], ["zero_loss"], value_float=0.0)], "other", [],
                              [helper.make_tensor_value_info("zero_loss", TensorProto.FLOAT, [])])
    inits: list = []
    if case in ("if", "if_both"):  # if_both: the else branch too, its check named apart from the then's
        if case == "if_both":
            other = body_loss_graph("else", "s", "y", "else_loss", op)
        nodes = [helper.make_node("If", ["c"], ["loss"], then_branch=body_loss_graph("then", "s", "y",
                                                                                     "then_loss", op),
                                  else_branch=other)]
    elif case == "loop":
        nodes, inits = [loop_node("outer", body_loss_graph("body", "s", "y", "body_loss", op), "loss")], \
            loop_inits
    elif case == "if_loop":  # the loss two bodies down
        inner = loop_node("inner", body_loss_graph("body", "s", "y", "body_loss", op), "then_loss")
        trips = onnx.numpy_helper.from_array(np.array(2, np.int64))
        then = helper.make_graph([helper.make_node("Constant", [], ["inner_trips"], value=trips),
                                  helper.make_node("Constant", [], ["inner_zero"], value_float=0.0), inner],
                                 "then", [], [helper.make_tensor_value_info("then_loss", TensorProto.FLOAT,
                                                                            [])])
        nodes = [helper.make_node("If", ["c"], ["loss"], then_branch=then, else_branch=other)]
    else:  # a Scan over T sets of scores and labels, summing their losses
        body = body_loss_graph("body", "s_t", "y_t", "body_loss", op, inputs=[
            helper.make_tensor_value_info("acc", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("s_t", TensorProto.FLOAT, ["N", 3]),
            helper.make_tensor_value_info("y_t", TensorProto.INT64, ["N"])])
        body.node.append(helper.make_node("Add", ["acc", "body_loss"], ["acc_out"]))
        body.output.insert(0, helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, []))
        nodes, inits = [helper.make_node("Scan", ["outer_zero", "s", "y"], ["loss", "losses"], body=body,
                                         num_scan_inputs=2)], loop_inits[1:]
    g = helper.make_graph(nodes, "control_flow", inputs,
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def control_flow_feeds(case: str, n_y: int, rng: np.random.Generator) -> dict:
    t = (2,) if case == "scan" else ()
    feeds = {"s": rng.standard_normal((*t, 5, 3)).astype(np.float32), "y": rng.integers(0, 3, (*t, n_y))}
    return {**feeds, "c": np.array(True)} if case.startswith("if") else feeds


@pytest.mark.parametrize("opset", [13, 17])
@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
@pytest.mark.parametrize("case", ["if", "if_both", "loop", "if_loop", "scan"])
def test_label_losses_in_bodies_refuse_a_short_batch(case, op, opset):
    """A loss inside an If's branch, a Loop's body, a Loop's body in an If's branch and a Scan's body, with
    and without Shape's start and end (the check's constants are then Constant nodes of the body): 4 labels
    for 5 score rows fail naming the inputs, where onnxruntime alone trains on the first 4 rows (and the
    backend did before); matching labels give onnxruntime's own loss and the numpy engine's. The graph the
    backend runs passes the full checker, its new names unique across the model."""
    model = control_flow_model(case, op, opset)
    onnx.checker.check_model(model, full_check=True)
    rewritten = for_onnxruntime(model)
    onnx.checker.check_model(rewritten, full_check=True)
    outputs = [o for g in walk_graphs(rewritten.graph) for n in g.node for o in n.output if o]
    assert len(outputs) == len(set(outputs)), outputs
    taken = NameGen.for_model(model).taken
    made = [n.name for g in walk_graphs(rewritten.graph) for n in g.node if n.name not in taken]
    assert made and len(made) == len(set(made)), made
    rng = np.random.default_rng(5)
    sess = InferenceSession(model.SerializeToString(), backend_options("onnxruntime"))
    short = control_flow_feeds(case, 4, rng)
    plain = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    plain.run(["loss"], short)  # what the check is for: onnxruntime alone takes 4 of the 5 rows
    with pytest.raises(ValueError) as e:
        sess.run(["loss"], short)
    assert isinstance(e.value, EngineError)
    assert_names(str(e.value), "s", "y", "N")
    feeds = control_flow_feeds(case, 5, rng)
    got = sess.run(["loss"], feeds)[0]
    np.testing.assert_allclose(got, plain.run(["loss"], feeds)[0], rtol=1e-6)
    np.testing.assert_allclose(got, InferenceSession(model.SerializeToString()).run(["loss"], feeds)[0],
                               rtol=1e-6)
