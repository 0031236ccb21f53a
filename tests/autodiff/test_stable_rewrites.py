"""Log-sigmoid terms torch's exporters write are differentiated in stable form
(onnxtrain/autodiff/stable_rewrites.py), and the fused tanh-GELU gradient stays finite in float16
(onnxtrain/autodiff/patterns.py).

Both exporters write ``F.logsigmoid(z)`` as ``Log(Sigmoid(z))``; TorchScript writes ``BCEWithLogitsLoss``
as ``y·log σ(z) + (1 − y)·log(1 − σ(z))`` (``Log(Sub(Constant 1, Sigmoid))``), dynamo as
``(1 − y)·z − log σ(z)``. As written, a float32 logit above ≈17 makes the loss NaN and below ≈−88 inf;
torch computes them stably. The models here have logits up to ±1e3: loss and gradients must equal torch's,
on onnxtrain's engine and on onnxruntime, and SGD steps of the legacy TrainingSession must follow torch's.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.autodiff.stable_rewrites import stable_log_sigmoids
from onnxtrain.ir.builder import make_model
from onnxtrain.testing import run_engine

torch = pytest.importorskip("torch")
F = torch.nn.functional
WRT = ["lin.weight", "lin.bias"]
POS_WEIGHT = [2.0, 0.5, 1.0, 3.0]


def _loss(kind: str, z, y, stable: bool = False):
    """The loss ``kind`` of logits z and targets y; ``stable``: torch's reference for the kinds torch itself
    computes unstably as written (log(1 − σ(z)), whose stable form is −softplus(z))."""
    if kind == "bce":
        return F.binary_cross_entropy_with_logits(z, y)
    if kind == "bce_pos_weight":
        return F.binary_cross_entropy_with_logits(z, y, pos_weight=torch.tensor(POS_WEIGHT))
    if kind == "logsigmoid":
        return -(F.logsigmoid(z) * y).mean()
    if kind == "logsigmoid_half":  # computed in float16 by the model, in float32 by the reference
        return -(F.logsigmoid(z) * y).mean() if stable else -(F.logsigmoid(z.half()).float() * y).mean()
    if kind == "log_one_minus_sigmoid":
        return (F.softplus(z) * y).mean() if stable else -(torch.log(1 - torch.sigmoid(z)) * y).mean()
    assert kind == "log1p_neg_sigmoid"  # dynamo writes log1p(−s) as Log(Add(Neg(s), 1))
    return (F.softplus(z) * y).mean() if stable else -(torch.log1p(-torch.sigmoid(z)) * y).mean()


class _Net(torch.nn.Module):
    def __init__(self, kind: str, stable: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 4)
        with torch.no_grad():
            self.lin.weight.mul_(1500.0)  # logits up to about ±1e3
        self.kind, self.stable = kind, stable

    def forward(self, x, y):
        return _loss(self.kind, self.lin(x), y, self.stable)


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (6, 3)).astype(np.float32)
    y = (rng.random((6, 4)) > 0.5).astype(np.float32)
    return x, y


def _export(kind: str, dynamo: bool) -> onnx.ModelProto:
    x, y = _data()
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Net(kind), (torch.from_numpy(x), torch.from_numpy(y)), buf, dynamo=dynamo,
                          input_names=["x", "y"], output_names=["loss"], verbose=False)
    return onnx.load_from_string(buf.getvalue())


def _torch_values(kind: str, x: np.ndarray, y: np.ndarray) -> tuple[list[np.ndarray], float]:
    net = _Net(kind, stable=True)
    loss = net(torch.from_numpy(x), torch.from_numpy(y))
    loss.backward()
    zmax = float(net.lin(torch.from_numpy(x)).detach().abs().max())
    return [loss.detach().numpy(), net.lin.weight.grad.numpy(), net.lin.bias.grad.numpy()], zmax


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


CASES = [(k, d) for k in ("bce", "bce_pos_weight", "logsigmoid", "logsigmoid_half", "log_one_minus_sigmoid")
         for d in (False, True)] + [("log1p_neg_sigmoid", True)]


IDS = [f"{k}-{'dynamo' if d else 'torchscript'}" for k, d in CASES]


@pytest.mark.parametrize("kind,dynamo", CASES, ids=IDS)
def test_logistic_loss_and_gradients_match_torch_at_large_logits(kind: str, dynamo: bool) -> None:
    model = _export(kind, dynamo)
    ops = [n.op_type for n in model.graph.node]
    assert "Log" in ops and "Sigmoid" in ops  # the exporter's form
    g = build_gradient_model(model, "loss", WRT)
    onnx.checker.check_model(g, full_check=True)
    x, y = _data()
    want, zmax = _torch_values(kind, x, y)
    assert zmax > 800
    got = run_engine(g, {"x": x, "y": y})
    half = kind.endswith("_half")
    for name, a, b in zip(["loss", *WRT], got, want):
        assert np.all(np.isfinite(a)), name
        # float16: the logits and the loss terms are rounded to float16 (3 decimal digits)
        rtol, atol = (2e-3, 2e-3 * np.abs(b).max()) if half else (1e-5, 1e-6 * np.abs(b).max())
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=name)
    for name, a, b in zip(["loss", *WRT], _ort(g, {"x": x, "y": y}), got):
        rtol = 1e-3 if half else 1e-5
        np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-6 * np.abs(b).max(), err_msg=name)
    assert "Log" not in {n.op_type for n in g.graph.node} and "Softplus" in {n.op_type for n in g.graph.node}


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("kind", ["bce", "logsigmoid"])
def test_training_session_sgd_follows_torch_at_large_logits(kind: str, dynamo: bool) -> None:
    from onnxtrain import TrainingParameters, TrainingSession

    model = _export(kind, dynamo)
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    p.weights_to_train = set(WRT)
    sess = TrainingSession(model.SerializeToString(), p)
    net = _Net(kind, stable=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    rng = np.random.default_rng(1)
    for _ in range(6):
        x = rng.uniform(-1, 1, (6, 3)).astype(np.float32)
        y = (rng.random((6, 4)) > 0.5).astype(np.float32)
        (loss,) = sess.run(["loss"], {"x": x, "y": y, "Learning_Rate": np.array([0.5], np.float32)})
        opt.zero_grad()
        want = net(torch.from_numpy(x), torch.from_numpy(y))
        want.backward()
        opt.step()
        assert np.isfinite(loss)
        np.testing.assert_allclose(loss, want.item(), rtol=1e-5)
    state = sess.get_state()
    np.testing.assert_allclose(state["lin.weight"], net.lin.weight.detach().numpy(), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(state["lin.bias"], net.lin.bias.detach().numpy(), rtol=1e-5, atol=1e-6)


class _Both(torch.nn.Module):
    """log σ(z) and σ(z) both in the loss: the Sigmoid keeps its other reader."""

    def __init__(self, stable: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 4)
        with torch.no_grad():
            self.lin.weight.mul_(1500.0)

    def forward(self, x, y):
        z = self.lin(x)
        return (-F.logsigmoid(z) * y + torch.sigmoid(z)).sum()


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_sigmoid_read_elsewhere_stays(dynamo: bool) -> None:
    x, y = _data()
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Both(), (torch.from_numpy(x), torch.from_numpy(y)), buf, dynamo=dynamo,
                          input_names=["x", "y"], output_names=["loss"], verbose=False)
    model = onnx.load_from_string(buf.getvalue())
    g = build_gradient_model(model, "loss", WRT)
    onnx.checker.check_model(g, full_check=True)
    net = _Both()
    loss = net(torch.from_numpy(x), torch.from_numpy(y))
    loss.backward()
    want = [loss.detach().numpy(), net.lin.weight.grad.numpy(), net.lin.bias.grad.numpy()]
    for name, a, b in zip(["loss", *WRT], run_engine(g, {"x": x, "y": y}), want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max(), err_msg=name)
    forward = [n.op_type for n in g.graph.node if n.name and "Grad" not in n.name]
    assert "Log" not in forward and "Sigmoid" in forward


def _small(nodes: list, et: int = T.FLOAT, inits: list | None = None) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", et, [2, 3])],
                          [helper.make_tensor_value_info("loss", et, [])], inits or [])
    return make_model(g, 17)


def test_other_graphs_are_left_alone() -> None:
    """No rewrite (the model itself comes back) for a Log of anything else, a Sub from a constant other than
    1 or of higher rank than σ(x) (it would broadcast the result), float64 (onnxruntime has no float64
    Softplus), and a clamped Log (F.binary_cross_entropy of probabilities, which torch computes from the
    rounded σ(x): test_edge_values_vs_torch.py's saturated-sigmoid test)."""
    one_111 = helper.make_tensor("one", T.FLOAT, [1, 1, 1], [1.0])
    two = helper.make_tensor("two", T.FLOAT, [], [2.0])
    total = helper.make_node("ReduceSum", ["l"], ["loss"], keepdims=0)
    sigmoid, log_s, log_d = (helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Log", ["s"], ["l"]),
                             helper.make_node("Log", ["d"], ["l"]))
    cases = [
        _small([helper.make_node("Softmax", ["x"], ["s"]), log_s, total]),
        _small([sigmoid, helper.make_node("Sub", ["two", "s"], ["d"]), log_d, total], inits=[two]),
        _small([sigmoid, helper.make_node("Sub", ["one", "s"], ["d"]), log_d, total], inits=[one_111]),
        _small([sigmoid, log_s, total], et=T.DOUBLE),
        _small([sigmoid, log_s, helper.make_node("Max", ["l", "floor"], ["m"]),
                helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0)],
               inits=[helper.make_tensor("floor", T.FLOAT, [], [-100.0])]),
    ]
    for m in cases:
        assert stable_log_sigmoids(m) is m


# the tanh GELU as the TorchScript exporter writes it at opset 17, node for node (the pattern's form)
class _HalfGelu(torch.nn.Module):
    def forward(self, x, w):
        return (F.gelu(x, approximate="tanh") * w).float().sum()


def test_tanh_gelu_pattern_gradient_is_finite_in_float16() -> None:
    """|x| ≥ 256 overflowed x·x in float16 (NaN where the gradient is 0 or 1): the pattern clips x to ±100
    in 1 + 3·c1·x², where 1 − t² is already 0."""
    x = np.array([-1e4, -3e3, -300, -256, -100, -20, -3, -0.5, 0, 0.7, 2.5, 6, 50, 255, 256, 1e3, 6e4],
                 np.float16)
    w = np.random.default_rng(0).uniform(0.5, 1.5, x.shape).astype(np.float16)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_HalfGelu(), (torch.from_numpy(x), torch.from_numpy(w)), buf, dynamo=False,
                          opset_version=17, input_names=["x", "w"], output_names=["loss"])
    model = onnx.load_from_string(buf.getvalue())
    assert "Tanh" in {n.op_type for n in model.graph.node}  # decomposed
    g = build_gradient_model(model, "loss", ["x"])
    onnx.checker.check_model(g, full_check=True)
    (dx,) = run_engine(g, {"x": x, "w": w})[1:]
    tx = torch.from_numpy(x.astype(np.float32)).requires_grad_(True)
    (F.gelu(tx, approximate="tanh") * torch.from_numpy(w.astype(np.float32))).sum().backward()
    want = tx.grad.numpy().astype(np.float16)
    assert np.all(np.isfinite(dx))
    np.testing.assert_allclose(dx.astype(np.float32), want.astype(np.float32), rtol=1e-2, atol=2e-3)
    (ort_dx,) = _ort(g, {"x": x, "w": w})[1:]
    np.testing.assert_allclose(ort_dx.astype(np.float32), dx.astype(np.float32), rtol=1e-2, atol=2e-3)
    assert "Clip" in {n.op_type for n in g.graph.node} and "Sum" not in {n.op_type for n in g.graph.node}


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("kind", ["bce", "logsigmoid"])
def test_mixed_precision_reads_the_float16_sigmoid_through_a_cast(kind: str, dynamo: bool) -> None:
    """Mixed precision computes σ(z) (and 1 − σ(z)) in float16 and the Log in float32, a Cast between: the
    stable form takes z cast to float32."""
    from onnxtrain.graph_transforms.mixed_precision import mixed_precision, mixed_precision_info

    mp = mixed_precision(_export(kind, dynamo), "loss", "float16")
    g = build_gradient_model(mp, mixed_precision_info(mp).scaled_loss, WRT)
    onnx.checker.check_model(g, full_check=True)
    x, y = _data()
    feeds = {"x": x, "y": y, "loss_scale": np.ones(1, np.float32)}
    got = run_engine(g, feeds)
    want, _ = _torch_values(kind, x, y)
    assert [o.name for o in g.graph.output][1:] == ["loss", "lin.weight_grad", "lin.bias_grad"]
    for name, a, b in zip(["loss", *WRT], got[1:], want):
        assert np.all(np.isfinite(a)), name
        # the logits are float16 (3 decimal digits)
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3 * np.abs(b).max(), err_msg=name)
    for name, a, b in zip(["loss", *WRT], _ort(g, feeds)[1:], got[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4 * np.abs(b).max(), err_msg=name)
    assert "Log" not in {n.op_type for n in g.graph.node}


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_artifacts_eval_model_computes_the_stable_loss(dynamo: bool, tmp_path) -> None:
    """generate_artifacts with the exported loss as the model's output: the eval model computes the loss in
    the stable form too (it kept the written-out log σ terms, NaN at large logits), equal to torch's, as
    the training model does."""
    from onnxtrain.training import artifacts
    from onnxtrain.training.api import CheckpointState, Module

    model = _export("bce", dynamo)
    artifacts.generate_artifacts(model, requires_grad=[t.name for t in model.graph.initializer
                                                       if t.name in WRT], artifact_directory=tmp_path)
    onnx.checker.check_model(str(tmp_path / "eval_model.onnx"), full_check=True)
    x, y = _data()
    (want, *_), _ = _torch_values("bce", x, y)
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    module = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    module.eval()
    (got,) = np.atleast_1d(module(x, y))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    module.train()
    np.testing.assert_allclose(np.atleast_1d(module(x, y))[0], want, rtol=1e-6)
