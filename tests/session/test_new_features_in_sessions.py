"""This session's new gradients through the training paths their unit tests did not take.

(a) LSTM gradients with a dynamic sequence length (``Scan`` in the gradient graph), (b) Conv/pool
gradients with dynamic spatial sizes (auto_pad SAME, ceil_mode pooling) and (c) the stable rewrite of
TorchScript's written-out ``BCEWithLogitsLoss`` are trained here by the legacy TrainingSession (float32,
float16 mixed precision, gradient accumulation, the onnxruntime backend) and by the on-device API
(generate_artifacts + Module + Optimizer), each against torch 2.13 training the same module from the same
weights on the same batches, or the numpy engine against the onnxruntime backend.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import RunOptions, SessionOptions, TrainingParameters, TrainingSession
from tests.session.helpers import backend_options
from tests.tiers import covering

torch = pytest.importorskip("torch")
F = torch.nn.functional

N_IN, HID, N_CLS = 3, 8, 4
LENGTHS = (5, 8, 2, 6)


def _export(module: Any, args: tuple, names: list[str], dynamic_axes: dict, opset: int = 17) -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, buf, dynamo=False, opset_version=opset, input_names=names,
                          output_names=["loss"], training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False, dynamic_axes=dynamic_axes)
    return buf.getvalue()


def _params(opt: str = "SGDOptimizer", **kw: Any) -> TrainingParameters:
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = opt
    p.enable_grad_norm_clip = False
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / max(np.abs(b).max(), 1e-12))


# ---- (a) an LSTM classifier with a dynamic sequence axis ----------------------------------------------

class _LstmClassifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = torch.nn.LSTM(N_IN, HID, batch_first=True)
        self.fc = torch.nn.Linear(HID, N_CLS)

    def logits(self, x: Any) -> Any:
        out, _ = self.rnn(x)
        return self.fc(out[:, -1])

    def forward(self, x: Any, y: Any) -> Any:
        return F.cross_entropy(self.logits(x), y)


def _lstm_model(with_loss: bool = True) -> tuple[Any, bytes]:
    module = _LstmClassifier()
    x0 = torch.randn(2, 5, N_IN)
    if with_loss:
        return module, _export(module, (x0, torch.zeros(2, dtype=torch.long)), ["x", "y"],
                               {"x": {0: "batch", 1: "seq"}, "y": {0: "batch"}})

    class Logits(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.rnn, self.fc = inner.rnn, inner.fc

        def forward(self, x: Any) -> Any:
            out, _ = self.rnn(x)
            return self.fc(out[:, -1])

    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Logits(module), (x0,), buf, dynamo=False, opset_version=17, input_names=["x"],
                          output_names=["logits"], training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False, dynamic_axes={"x": {0: "batch", 1: "seq"},
                                                                   "logits": {0: "batch"}})
    return module, buf.getvalue()


def _seq_batches(lengths: tuple[int, ...] = LENGTHS, batch: int = 4, seed: int = 1) -> list[tuple]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, t, N_IN)).astype(np.float32),
             rng.integers(0, N_CLS, batch).astype(np.int64)) for t in lengths]


def _torch_sgd(module: Any, data: list[tuple], lr: float) -> list[float]:
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = module(torch.from_numpy(x), torch.from_numpy(y))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _weights(module: Any) -> dict[str, np.ndarray]:
    return {n: v.detach().numpy().copy() for n, v in module.named_parameters()}


def test_lstm_dynamic_length_has_scans_and_trains_as_torch_in_float32() -> None:
    """The baseline the other LSTM tests build on: the legacy session's gradient graph loops with Scan
    (one graph for every length) and SGD follows torch at four lengths."""
    module, model = _lstm_model()
    sess = TrainingSession(model, _params())
    assert any(n.op_type == "Scan" for n in sess._graphs.full.graph.node)
    data = _seq_batches()
    ours = _step_losses(sess, data, 0.2)
    theirs = _torch_sgd(module, data, 0.2)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    state = sess.get_state()
    for n, w in _weights(module).items():
        assert _rel(state[n], w) < 1e-5, n


def test_lstm_forward_only_run_at_a_new_length_equals_torch() -> None:
    module, model = _lstm_model()
    sess = TrainingSession(model, _params())
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    for x, y in _seq_batches((9, 1), seed=7):
        got = float(sess.run(["loss"], {"x": x, "y": y}, ro)[0])
        assert abs(got - module(torch.from_numpy(x), torch.from_numpy(y)).item()) <= 1e-6 * got


def _step_losses(sess: TrainingSession, data: list, lr: float, scale: float | None = None, *,
                 all_finite: bool = False) -> list[float]:
    """The losses of a session's steps over ``data`` (x, y batches) at learning rate ``lr``; under mixed
    precision at the fixed loss ``scale``, and with ``all_finite`` every update checked to be applied (all
    gradients finite)."""
    feeds = {"Learning_Rate": np.array([lr], np.float32)}
    if scale is not None:
        feeds[sess.loss_scale_input_name] = np.array([scale], np.float32)
    fetch = ["loss", "all_gradients_finite"] if all_finite else ["loss"]
    out = []
    for x, y in data:
        got = sess.run(fetch, {"x": x, "y": y, **feeds})
        assert not all_finite or bool(got[1])
        out.append(float(got[0]))
    return out


def test_lstm_dynamic_length_mixed_precision_follows_torch_loosely() -> None:
    """float16 mixed precision with a fixed loss scale: every update is applied, the losses are finite, fall
    over repeated passes, and stay near torch's float32 training (the LSTM node stays float32, the Linear
    runs in float16: measured 8e-5 relative on the losses, 1.3e-4 on the weights)."""
    module, model = _lstm_model()
    sess = TrainingSession(model, _params(use_mixed_precision=True))
    data = _seq_batches() * 3
    ours = _step_losses(sess, data, 0.2, 1024.0, all_finite=True)
    theirs = _torch_sgd(module, data, 0.2)
    assert np.all(np.isfinite(ours))
    np.testing.assert_allclose(ours, theirs, rtol=1e-3)
    n = len(LENGTHS)
    assert sum(ours[-n:]) < sum(ours[:n])  # the same batches, a lower loss on the third pass
    state = sess.get_state()
    for name, w in _weights(module).items():
        assert _rel(state[name], w) < 1e-3, (name, _rel(state[name], w))


@pytest.mark.parametrize("mode", ["auto", "legacy"])
def test_lstm_accumulation_over_two_lengths_averages_the_gradients(mode: str) -> None:
    """gradient_accumulation_steps=2 with micro-batches of different sequence lengths (which cannot be
    concatenated into one batch): each update is the mean of the two micro-steps' gradients, as torch's
    SGD applies it after two backwards of loss/2."""
    module, model = _lstm_model()
    sess = TrainingSession(model, _params(gradient_accumulation_steps=2, gradient_accumulation_mode=mode))
    data = _seq_batches()
    lr = np.array([0.3], np.float32)
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    for k, (x, y) in enumerate(data):
        feeds = {"x": x, "y": y, "Learning_Rate": lr}
        if mode == "legacy" and k % 2 == 0:
            sess.run(["loss", "Group_Accumulated_Gradients"], feeds, ro)
        else:
            sess.run(["loss"], feeds)
    opt = torch.optim.SGD(module.parameters(), lr=0.3)
    for k in range(0, len(data), 2):
        opt.zero_grad()
        for x, y in data[k:k + 2]:
            (module(torch.from_numpy(x), torch.from_numpy(y)) / 2).backward()
        opt.step()
    state = sess.get_state()
    for n, w in _weights(module).items():
        assert _rel(state[n], w) < 1e-5, (n, _rel(state[n], w))


@pytest.mark.parametrize("opt", ["SGDOptimizer", "AdamOptimizer"])
def test_lstm_dynamic_length_onnxruntime_backend_equals_numpy_engine(opt: str) -> None:
    pytest.importorskip("onnxruntime")
    _, model = _lstm_model()
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    ours = TrainingSession(model, _params(opt))
    theirs = TrainingSession(model, _params(opt), sess_options=so)
    lr = np.array([0.05], np.float32)
    for x, y in _seq_batches():
        feeds = {"x": x, "y": y, "Learning_Rate": lr}
        a = float(ours.run(["loss"], feeds)[0])
        b = float(theirs.run(["loss"], feeds)[0])
        assert abs(a - b) <= 1e-5 * max(abs(a), 1.0), (x.shape, a, b)
    sa, sb = ours.get_state(), theirs.get_state()
    for n in sa:
        np.testing.assert_allclose(sb[n], sa[n], rtol=1e-5, atol=1e-6, err_msg=n)


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_lstm_dynamic_length_artifacts_adamw_follows_torch_adamw(backend: str, tmp_path: Any) -> None:
    """generate_artifacts (CrossEntropyLoss, AdamW) + Module + Optimizer at four lengths against
    torch.optim.AdamW. onnxruntime-training's AdamW (the Hugging Face variant, eps 1e-6, no weight decay
    by default) adds eps to the uncorrected sqrt(v): torch's with eps/sqrt(1 − β2^t) at step t is the same
    update."""
    from onnxtrain.training import artifacts
    from onnxtrain.training.api import CheckpointState, Module, Optimizer

    module, model = _lstm_model(with_loss=False)
    params = [n for n, _ in module.named_parameters()]
    artifacts.generate_artifacts(onnx.load_from_string(model), requires_grad=params,
                                 loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=str(tmp_path))
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    ours = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"),
                  session_options=backend_options(backend))
    opt = Optimizer(str(tmp_path / "optimizer_model.onnx"), ours)
    lr, b2 = 0.01, 0.999
    opt.set_learning_rate(lr)
    topt = torch.optim.AdamW(module.parameters(), lr=lr, betas=(0.9, b2), eps=1e-6, weight_decay=0.0)
    for t, (x, y) in enumerate(_seq_batches(LENGTHS * 2), start=1):
        loss = float(ours(x, y))
        opt.step()
        ours.lazy_reset_grad()
        topt.param_groups[0]["eps"] = 1e-6 / np.sqrt(1 - b2**t)
        topt.zero_grad()
        theirs = module(torch.from_numpy(x), torch.from_numpy(y))
        theirs.backward()
        topt.step()
        assert abs(loss - theirs.item()) <= 2e-5 * abs(theirs.item()), (t, loss, theirs.item())
    for n, w in _weights(module).items():
        got = state.parameters[n].data
        np.testing.assert_allclose(got, w, rtol=0, atol=2e-5, err_msg=n)
    # the eval model runs at another length too
    ours.eval()
    x, y = _seq_batches((7,), seed=9)[0]
    want = F.cross_entropy(module.logits(torch.from_numpy(x)), torch.from_numpy(y)).item()
    assert abs(float(ours(x, y)) - want) <= 1e-5 * want


class _OtherRnn(torch.nn.Module):
    """A bidirectional GRU, a 2-layer bidirectional LSTM or a ReLU RNN; mean over the steps, Linear, CE."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        if kind == "gru_bidirectional":
            self.rnn = torch.nn.GRU(N_IN, HID, batch_first=True, bidirectional=True)
        elif kind == "lstm_2_layers_bidirectional":
            self.rnn = torch.nn.LSTM(N_IN, HID, num_layers=2, batch_first=True, bidirectional=True)
        else:
            self.rnn = torch.nn.RNN(N_IN, HID, batch_first=True, nonlinearity="relu")
        self.fc = torch.nn.Linear(HID * (1 + self.rnn.bidirectional), N_CLS)

    def forward(self, x: Any, y: Any) -> Any:
        out, _ = self.rnn(x)
        return F.cross_entropy(self.fc(out.mean(1)), y)


# by default each layer once, on the two backends in turn; on both with ONNXTRAIN_FULL_TESTS=1
# (tests/tiers.py)
@pytest.mark.parametrize("kind,backend", covering(
    ["gru_bidirectional", "lstm_2_layers_bidirectional", "rnn_relu"], ["numpy", "onnxruntime"], strength=1))
def test_other_recurrent_layers_accumulate_over_lengths_as_torch(kind: str, backend: str) -> None:
    """Two micro-steps per update (auto mode) at lengths 1, 4, 2 and 7 on either backend: the weights equal
    torch's after two SGD steps of the averaged gradients."""
    module = _OtherRnn(kind)
    model = _export(module, (torch.randn(2, 5, N_IN), torch.zeros(2, dtype=torch.long)), ["x", "y"],
                    {"x": {0: "batch", 1: "seq"}, "y": {0: "batch"}})
    sess = TrainingSession(model, _params(gradient_accumulation_steps=2, gradient_accumulation_mode="auto"),
                           sess_options=backend_options(backend))
    data = _seq_batches((1, 4, 2, 7))
    ours = _step_losses(sess, data, 0.2)
    opt = torch.optim.SGD(module.parameters(), lr=0.2)
    theirs = []
    for k in range(0, len(data), 2):
        opt.zero_grad()
        for x, y in data[k:k + 2]:
            loss = module(torch.from_numpy(x), torch.from_numpy(y))
            (loss / 2).backward()
            theirs.append(loss.item())
        opt.step()
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    state = sess.get_state()
    for n, w in _weights(module).items():
        assert _rel(state[n], w) < 1e-5, (n, _rel(state[n], w))


# ---- (b) convolutions and pools with dynamic spatial sizes --------------------------------------------

class _SameConvNet(torch.nn.Module):
    """padding='same' convolutions (odd, even and dilated kernels) and ceil_mode pools, global mean,
    cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1 = torch.nn.Conv2d(2, 4, 3, padding="same")
        self.c2 = torch.nn.Conv2d(4, 4, 4, padding="same")
        self.c3 = torch.nn.Conv2d(4, N_CLS, 3, padding="same", dilation=2)

    def forward(self, x: Any, y: Any) -> Any:
        h = F.max_pool2d(torch.relu(self.c1(x)), 2, 2, ceil_mode=True)
        h = F.avg_pool2d(torch.tanh(self.c2(h)), 3, 2, padding=1, ceil_mode=True)
        return F.cross_entropy(self.c3(h).mean((2, 3)), y)


def _image_batches(sizes: list[tuple[int, int]], seed: int = 2) -> list[tuple]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((3, 2, h, w)).astype(np.float32),
             rng.integers(0, N_CLS, 3).astype(np.int64)) for h, w in sizes]


SIZES = [(9, 7), (12, 13), (9, 7), (5, 10)]


def _same_conv_export(module: Any) -> bytes:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _export(module, (torch.randn(3, 2, 8, 8), torch.zeros(3, dtype=torch.long)), ["x", "y"],
                       {"x": {0: "batch", 2: "h", 3: "w"}, "y": {0: "batch"}})


@pytest.mark.parametrize("option", ["float32", "accumulation", "float16"])
def test_same_conv_ceil_pool_net_trains_at_several_sizes_as_torch(option: str) -> None:
    """TorchScript exports padding='same' as auto_pad SAME_UPPER (dilated and even kernels included) and
    the pools with ceil_mode; H and W dynamic. SGD at four sizes: plain, accumulating two micro-steps of
    different sizes (auto mode), or float16 mixed precision (Conv in half: measured 4e-5 on the losses and
    3.3e-4 on the weights)."""
    module = _SameConvNet()
    model = _same_conv_export(module)
    attrs = set()
    for n in onnx.load_from_string(model).graph.node:
        for a in n.attribute:
            v = helper.get_attribute_value(a)
            attrs.add((n.op_type, a.name, tuple(v) if isinstance(v, list) else v))
    assert {("Conv", "auto_pad", b"SAME_UPPER"), ("MaxPool", "ceil_mode", 1), ("AveragePool", "ceil_mode", 1),
            ("Conv", "dilations", (2, 2))} <= attrs
    acc = 2 if option == "accumulation" else 1
    kw = {"float32": {}, "float16": {"use_mixed_precision": True},
          "accumulation": {"gradient_accumulation_steps": 2, "gradient_accumulation_mode": "auto"}}[option]
    sess = TrainingSession(model, _params(**kw))
    data = _image_batches(SIZES)
    ours = _step_losses(sess, data, 0.3, 512.0 if option == "float16" else None)
    opt, theirs = torch.optim.SGD(module.parameters(), lr=0.3), []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k in range(0, len(data), acc):
            opt.zero_grad()
            for x, y in data[k:k + acc]:
                loss = module(torch.from_numpy(x), torch.from_numpy(y))
                (loss / acc).backward()
                theirs.append(loss.item())
            opt.step()
    tol = 2e-3 if option == "float16" else 1e-5
    np.testing.assert_allclose(ours, theirs, rtol=tol)
    state = sess.get_state()
    for n, w in _weights(module).items():
        assert _rel(state[n], w) < tol, (n, _rel(state[n], w))


def test_same_conv_ceil_pool_net_artifacts_adamw_follows_torch(tmp_path: Any) -> None:
    """generate_artifacts on the logits of the same net (H, W dynamic), CrossEntropyLoss and AdamW, four
    sizes, against torch's AdamW with the Hugging Face eps (see the LSTM test)."""
    from onnxtrain.training import artifacts
    from onnxtrain.training.api import CheckpointState, Module, Optimizer

    net = _SameConvNet()

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: Any) -> Any:
            n = self.net
            h = F.max_pool2d(torch.relu(n.c1(x)), 2, 2, ceil_mode=True)
            h = F.avg_pool2d(torch.tanh(n.c2(h)), 3, 2, padding=1, ceil_mode=True)
            return n.c3(h).mean((2, 3))

    module = Logits()
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randn(3, 2, 8, 8),), buf, dynamo=False, opset_version=17,
                          input_names=["x"], output_names=["logits"], do_constant_folding=False,
                          training=torch.onnx.TrainingMode.TRAINING,
                          dynamic_axes={"x": {0: "b", 2: "h", 3: "w"}, "logits": {0: "b"}})
    artifacts.generate_artifacts(onnx.load_from_string(buf.getvalue()),
                                 requires_grad=[n for n, _ in module.named_parameters()],
                                 loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=str(tmp_path))
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    ours = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    opt = Optimizer(str(tmp_path / "optimizer_model.onnx"), ours)
    opt.set_learning_rate(0.01)
    topt = torch.optim.AdamW(module.parameters(), lr=0.01, eps=1e-6, weight_decay=0.0)
    for t, (x, y) in enumerate(_image_batches(SIZES), start=1):
        loss = float(ours(x, y))
        opt.step()
        ours.lazy_reset_grad()
        topt.param_groups[0]["eps"] = 1e-6 / np.sqrt(1 - 0.999**t)
        topt.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = F.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y))
        theirs.backward()
        topt.step()
        assert abs(loss - theirs.item()) <= 1e-5 * theirs.item(), (x.shape, loss, theirs.item())
    for n, w in _weights(module).items():
        assert _rel(state.parameters[n].data, w) < 2e-5, (n, _rel(state.parameters[n].data, w))


class _CeilPools(torch.nn.Module):
    """A conv, then max and average pools (with and without the pads counted) in ceil_mode, whose last
    window at some sizes would start in the right padding (torch and ONNX then drop it)."""

    def __init__(self, k: int, s: int, p: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c = torch.nn.Conv2d(2, N_CLS, 3, padding=1)
        self.k, self.s, self.p = k, s, p

    def forward(self, x: Any, y: Any) -> Any:
        h = self.c(x)
        a = F.max_pool2d(h, self.k, self.s, self.p, ceil_mode=True)
        b = F.avg_pool2d(h, self.k, self.s, self.p, ceil_mode=True, count_include_pad=False)
        c = F.avg_pool2d(h, self.k, self.s, self.p, ceil_mode=True, count_include_pad=True)
        return F.cross_entropy(a.mean((2, 3)) + 0.7 * b.mean((2, 3)) + 0.3 * c.mean((2, 3)), y)


# by default each pool shape once, on the two backends in turn; on both with ONNXTRAIN_FULL_TESTS=1
@pytest.mark.parametrize("k,s,p,backend", covering(
    [(2, 3, 1), (3, 2, 1), (3, 3, 1)], ["numpy", "onnxruntime"], strength=1), ids=str)
def test_ceil_mode_pools_train_at_several_sizes_as_torch(k: int, s: int, p: int, backend: str) -> None:
    module = _CeilPools(k, s, p)
    model = _export(module, (torch.randn(3, 2, 8, 8), torch.zeros(3, dtype=torch.long)), ["x", "y"],
                    {"x": {0: "batch", 2: "h", 3: "w"}, "y": {0: "batch"}})
    sess = TrainingSession(model, _params(), sess_options=backend_options(backend))
    data = _image_batches([(5, 6), (8, 7), (5, 5), (11, 4)])
    ours = _step_losses(sess, data, 0.3)
    theirs = _torch_sgd(module, data, 0.3)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    state = sess.get_state()
    for n, w in _weights(module).items():
        assert _rel(state[n], w) < 1e-5, (n, _rel(state[n], w))


def _same_pads(n: int, k: int, s: int, d: int, upper: bool) -> tuple[int, int]:
    out = -(-n // s)
    total = max((out - 1) * s + (k - 1) * d + 1 - n, 0)
    small = total // 2
    return (small, total - small) if upper else (total - small, small)


def _auto_pad_model(w1: np.ndarray, b1: np.ndarray, w2: np.ndarray, auto_pad: str,
                    dilation: int = 2) -> bytes:
    """Conv(auto_pad, stride 2) → Relu → MaxPool(auto_pad, 3, stride 2) → Conv(auto_pad, stride 1,
    ``dilation``) → ReduceMean over H, W → SoftmaxCrossEntropyLoss; H and W symbolic."""
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], auto_pad=auto_pad, strides=[2, 2]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], auto_pad=auto_pad, kernel_shape=[3, 3], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2"], ["c2"], auto_pad=auto_pad, dilations=[dilation] * 2),
        helper.make_node("ReduceMean", ["c2"], ["m"], axes=[2, 3], keepdims=0),
        helper.make_node("SoftmaxCrossEntropyLoss", ["m", "y"], ["loss"]),
    ]
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1"),
             numpy_helper.from_array(w2, "w2")]
    g = helper.make_graph(nodes, "same", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, "H", "W"]),
        helper.make_tensor_value_info("y", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
def test_hand_built_auto_pad_same_net_trains_at_several_sizes_as_torch(auto_pad: str) -> None:
    upper = auto_pad == "SAME_UPPER"
    w1, b1, w2 = _weights_same()
    sess = TrainingSession(_auto_pad_model(w1, b1, w2, auto_pad), _params())
    tw = {k: torch.tensor(v, requires_grad=True) for k, v in (("w1", w1), ("b1", b1), ("w2", w2))}

    def pad(x: Any, k: tuple[int, int], s: int, d: int, value: float = 0.0) -> Any:
        (ht, hb), (wl, wr) = (_same_pads(x.shape[2 + i], k[i], s, d, upper) for i in range(2))
        return F.pad(x, (wl, wr, ht, hb), value=value)

    def forward(x: Any, y: Any) -> Any:
        h = torch.relu(F.conv2d(pad(x, (3, 4), 2, 1), tw["w1"], tw["b1"], stride=2))
        h = F.max_pool2d(pad(h, (3, 3), 2, 1, -np.inf), 3, 2)
        h = F.conv2d(pad(h, (2, 3), 1, 2), tw["w2"], dilation=2)
        return F.cross_entropy(h.mean((2, 3)), y)

    topt = torch.optim.SGD(list(tw.values()), lr=0.3)
    lr = np.array([0.3], np.float32)
    for x, y in _image_batches([(11, 9), (16, 13), (7, 8), (11, 9)]):
        ours = float(sess.run(["loss"], {"x": x, "y": y, "Learning_Rate": lr})[0])
        topt.zero_grad()
        theirs = forward(torch.from_numpy(x), torch.from_numpy(y))
        theirs.backward()
        topt.step()
        assert abs(ours - theirs.item()) <= 1e-5 * theirs.item(), (x.shape, ours, theirs.item())
    state = sess.get_state()
    for n, w in tw.items():
        assert _rel(state[n], w.detach().numpy()) < 1e-5, n


def _weights_same() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    w1 = (rng.standard_normal((4, 2, 3, 4)) * 0.4).astype(np.float32)
    b1 = (rng.standard_normal(4) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((N_CLS, 4, 2, 3)) * 0.4).astype(np.float32)
    return w1, b1, w2


def _backends_agree(model: bytes) -> None:
    pytest.importorskip("onnxruntime")
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    ours, theirs = TrainingSession(model, _params()), TrainingSession(model, _params(), sess_options=so)
    lr = np.array([0.3], np.float32)
    for x, y in _image_batches([(11, 9), (16, 13), (7, 8)]):
        feeds = {"x": x, "y": y, "Learning_Rate": lr}
        a, b = float(ours.run(["loss"], feeds)[0]), float(theirs.run(["loss"], feeds)[0])
        assert abs(a - b) <= 1e-5 * abs(a), (x.shape, a, b)
    sa, sb = ours.get_state(), theirs.get_state()
    for n in sa:
        np.testing.assert_allclose(sb[n], sa[n], rtol=1e-5, atol=1e-6, err_msg=n)


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
def test_auto_pad_same_net_onnxruntime_backend_equals_numpy_engine(auto_pad: str) -> None:
    _backends_agree(_auto_pad_model(*_weights_same(), auto_pad, dilation=1))


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
def test_dilated_auto_pad_same_conv_on_the_onnxruntime_backend(auto_pad: str) -> None:
    """onnxruntime 1.32's Conv kernel refuses dilations with auto_pad SAME_*: the backend hands the node
    over with the explicit pads SAME means (onnxtrain/engine/ort_same_pads.py)."""
    _backends_agree(_auto_pad_model(*_weights_same(), auto_pad, dilation=2))


# ---- (c) BCEWithLogitsLoss exported by TorchScript, large logits --------------------------------------

class _BceNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 4)
        with torch.no_grad():
            self.lin.weight.mul_(200.0)  # logits up to a few hundred: log σ underflows in float32
            self.lin.bias.mul_(50.0)

    def forward(self, x: Any, y: Any) -> Any:
        return F.binary_cross_entropy_with_logits(self.lin(x), y)


def _bce_batches(n: int = 4, seed: int = 4) -> list[tuple]:
    rng = np.random.default_rng(seed)
    return [(rng.uniform(-1, 1, (6, 3)).astype(np.float32), (rng.random((6, 4)) > 0.5).astype(np.float32))
            for _ in range(n)]


def _bce_model() -> tuple[Any, bytes]:
    module = _BceNet()
    x, y = _bce_batches(1)[0]
    model = _export(module, (torch.from_numpy(x), torch.from_numpy(y)), ["x", "y"],
                    {"x": {0: "batch"}, "y": {0: "batch"}})
    ops = {n.op_type for n in onnx.load_from_string(model).graph.node}
    assert {"Sigmoid", "Log"} <= ops  # the written-out form the rewrite targets
    return module, model


def _bce_torch_sgd(module: Any, data: list[tuple], lr: float) -> list[float]:
    with torch.no_grad():
        zmax = max(float(module.lin(torch.from_numpy(x)).abs().max()) for x, _ in data)
    assert zmax > 100.0, zmax
    return _torch_sgd(module, data, lr)


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_bce_large_logits_legacy_session_follows_torch(backend: str) -> None:
    module, model = _bce_model()
    so = SessionOptions()
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
        so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    sess = TrainingSession(model, _params(), sess_options=so)
    data = _bce_batches()
    ours = _step_losses(sess, data, 0.5)
    theirs = _bce_torch_sgd(module, data, 0.5)
    assert np.all(np.isfinite(ours)), ours
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    state = sess.get_state()
    for n, w in _weights(module).items():
        assert _rel(state[n], w) < 1e-5, n


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_bce_large_logits_forward_only_run_equals_torch(backend: str) -> None:
    """The legacy session's evaluation graph (a forward-only run) computes the stable log-sigmoid loss too
    (it was the forward model as written: NaN where the training run and torch are finite)."""
    module, model = _bce_model()
    sess = TrainingSession(model, _params(), sess_options=backend_options(backend))
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    x, y = _bce_batches(1)[0]
    want = module(torch.from_numpy(x), torch.from_numpy(y)).item()
    trained = float(sess.run(["loss"], {"x": x, "y": y, "Learning_Rate": np.array([0.0], np.float32)})[0])
    assert abs(trained - want) <= 1e-5 * want  # the training run is stable
    got = float(sess.run(["loss"], {"x": x, "y": y}, ro)[0])
    assert abs(got - want) <= 1e-5 * want, (got, want)


def test_bce_large_logits_mixed_precision_is_finite_and_near_torch() -> None:
    module, model = _bce_model()
    sess = TrainingSession(model, _params(use_mixed_precision=True))
    data = _bce_batches()
    ours = _step_losses(sess, data, 0.5, 256.0, all_finite=True)
    theirs = _bce_torch_sgd(module, data, 0.5)
    assert np.all(np.isfinite(ours)), ours
    np.testing.assert_allclose(ours, theirs, rtol=1e-3)  # measured 1.5e-4


def test_bce_large_logits_artifacts_train_and_evaluate_as_torch(tmp_path: Any) -> None:
    """The exported loss as the model's output (loss=None), SGD: training and eval losses equal torch's."""
    from onnxtrain.training import artifacts
    from onnxtrain.training.api import CheckpointState, Module, Optimizer

    module, model = _bce_model()
    artifacts.generate_artifacts(onnx.load_from_string(model), requires_grad=["lin.weight", "lin.bias"],
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=str(tmp_path))
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    ours = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    opt = Optimizer(str(tmp_path / "optimizer_model.onnx"), ours)
    opt.set_learning_rate(0.5)
    data = _bce_batches()
    got = []
    for x, y in data:
        got.append(float(np.atleast_1d(ours(x, y))[0]))
        opt.step()
        ours.lazy_reset_grad()
    theirs = _bce_torch_sgd(module, data, 0.5)
    assert np.all(np.isfinite(got)), got
    np.testing.assert_allclose(got, theirs, rtol=1e-5)
    for n, w in _weights(module).items():
        assert _rel(state.parameters[n].data, w) < 1e-5, n
    ours.eval()
    x, y = _bce_batches(1, seed=11)[0]
    want = module(torch.from_numpy(x), torch.from_numpy(y)).item()
    assert np.isfinite(want)
    np.testing.assert_allclose(float(np.atleast_1d(ours(x, y))[0]), want, rtol=1e-5)


class _LstmBce(torch.nn.Module):
    """(a) and (c) together: a dynamic-length LSTM whose last step's logits (Linear scaled ×300, up to a few
    hundred) go into BCEWithLogitsLoss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = torch.nn.LSTM(N_IN, HID, batch_first=True)
        self.fc = torch.nn.Linear(HID, N_CLS)
        with torch.no_grad():
            self.fc.weight.mul_(300.0)

    def forward(self, x: Any, y: Any) -> Any:
        out, _ = self.rnn(x)
        return F.binary_cross_entropy_with_logits(self.fc(out[:, -1]), y)


@pytest.mark.parametrize("option", ["float32", "float16"])
def test_lstm_into_bce_with_large_logits_follows_torch(option: str) -> None:
    module = _LstmBce()
    model = _export(module, (torch.randn(2, 5, N_IN), torch.zeros(2, N_CLS)), ["x", "y"],
                    {"x": {0: "batch", 1: "seq"}, "y": {0: "batch"}})
    rng = np.random.default_rng(5)
    data = [(rng.standard_normal((4, t, N_IN)).astype(np.float32),
             (rng.random((4, N_CLS)) > 0.5).astype(np.float32)) for t in (5, 8, 3)]
    sess = TrainingSession(model, _params(use_mixed_precision=option == "float16"))
    ours = _step_losses(sess, data, 0.05, 64.0 if option == "float16" else None)
    with torch.no_grad():
        assert float(module.fc(module.rnn(torch.from_numpy(data[0][0]))[0][:, -1]).abs().max()) > 50.0
    theirs = _torch_sgd(module, data, 0.05)
    assert np.all(np.isfinite(ours)), ours
    np.testing.assert_allclose(ours, theirs, rtol=1e-5 if option == "float32" else 2e-3)
