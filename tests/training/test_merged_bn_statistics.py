"""BatchNormalization statistics that the exporter merged with other tensors of equal value.

torch's TorchScript exporter (eval mode, its default) keeps one initializer per distinct value: in a fresh
model a BatchNorm's running variance (ones) becomes an Identity of its scale, its running mean an Identity
of its bias, and another layer's fresh statistics Identities of the same tensors. Training must still give
each layer its own statistics, update them as torch does, and never write them over the scale: before the
fix, the onnxruntime backend wrote the new running variance into the scale in place (a step at learning rate
0 changed the weights) and neither backend kept the statistics. Oracle: torch in training mode.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

from onnxtrain import SessionOptions, TrainingParameters, TrainingSession
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module, Optimizer

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

STEPS, LR = 3, 0.1
BACKENDS = ["numpy", "onnxruntime"]


class Net(torch.nn.Module):
    """fc → bn1 (fresh: scale 1, bias 0, statistics 0 / 1) → relu → fc → bn2 (random affine, fresh
    statistics) → relu → fc."""

    def __init__(self, drawn: tuple[str, ...] = ("bn2",)) -> None:
        """``drawn``: the BatchNorms whose scale and bias are drawn at random (the others stay fresh)."""
        super().__init__()
        self.fc1, self.bn1 = torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8)
        self.fc2, self.bn2 = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)
        self.fc3 = torch.nn.Linear(8, 3)
        with torch.no_grad():
            for name in drawn:
                getattr(self, name).weight.uniform_(0.5, 1.5)
                getattr(self, name).bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        h = torch.relu(self.bn1(self.fc1(x)))
        return self.fc3(torch.relu(self.bn2(self.fc2(h))))


class WithLoss(torch.nn.Module):
    def __init__(self, net: Net) -> None:
        super().__init__()
        self.net = net

    def forward(self, x, labels):
        return torch.nn.functional.cross_entropy(self.net(x), labels)


def _batch(i: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(30 + i)
    return rng.standard_normal((6, 4)).astype(np.float32) * 2 + 0.5, rng.integers(0, 3, 6)


def _fresh() -> Net:
    torch.manual_seed(0)
    return Net()


def _export(module: torch.nn.Module, args: tuple, path: str, names: list[str], out: str) -> onnx.ModelProto:
    torch.onnx.export(module.eval(), args, path, input_names=names, output_names=[out],
                      dynamic_axes={names[0]: {0: "b"}}, dynamo=False, opset_version=17)
    model = onnx.load(path)
    merged = [n.output[0] for n in model.graph.node if n.op_type == "Identity" and "running" in n.output[0]]
    assert len(merged) >= 3, f"the exporter no longer merges the statistics: {merged}"  # what this tests
    return model


def _torch_run() -> tuple[list[float], dict[str, np.ndarray]]:
    """torch's losses and final state, the running variances as ONNX defines them (the biased batch
    variance where torch's running variance takes the unbiased one)."""
    net = _fresh().train()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses = []
    onnx_var = {bn: getattr(net, bn).running_var.clone() for bn in ("bn1", "bn2")}
    for i in range(STEPS):
        x, y = _batch(i)
        old = {bn: getattr(net, bn).running_var.clone() for bn in onnx_var}
        loss = torch.nn.functional.cross_entropy(net(torch.tensor(x)), torch.tensor(y))
        n = len(x)
        for bn in onnx_var:  # torch: 0.9·old + 0.1·unbiased; ONNX: 0.9·old + 0.1·biased
            unbiased = (getattr(net, bn).running_var - 0.9 * old[bn]) / 0.1
            onnx_var[bn] = 0.9 * onnx_var[bn] + 0.1 * unbiased * (n - 1) / n
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    state = {k: v.detach().numpy() for k, v in net.state_dict().items() if "num_batches" not in k}
    state.update({f"{bn}.running_var": v.detach().numpy() for bn, v in onnx_var.items()})
    return losses, state


def _options(backend: str) -> SessionOptions:
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", backend)
    return so


@pytest.mark.parametrize("backend", BACKENDS)
def test_legacy_session_keeps_each_layers_statistics(backend: str, tmp_path) -> None:
    x0, y0 = _batch(0)
    model = _export(WithLoss(_fresh()), (torch.tensor(x0), torch.tensor(y0)), str(tmp_path / "loss.onnx"),
                    ["x", "labels"], "loss")
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    p.weights_to_train = {t.name for t in model.graph.initializer if "running" not in t.name}
    sess = TrainingSession(model.SerializeToString(), p, _options(backend))
    before = {k: v.copy() for k, v in sess.get_state().items()}
    sess.run(["loss"], {"x": x0, "labels": y0, "Learning_Rate": np.array([0.0], np.float32)})
    for name in p.weights_to_train:  # a step at learning rate 0 leaves every weight as it was
        np.testing.assert_array_equal(sess.get_state()[name], before[name], err_msg=name)
    sess.load_state(before)
    losses = []
    for i in range(STEPS):
        x, y = _batch(i)
        losses.append(float(sess.run(["loss"], {"x": x, "labels": y,
                                                "Learning_Rate": np.array([LR], np.float32)})[0]))
    want_losses, want = _torch_run()
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    state = sess.get_state()
    for key, value in want.items():
        np.testing.assert_allclose(state[f"net.{key}"], value, rtol=1e-4, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("backend", BACKENDS)
def test_on_device_training_keeps_each_layers_statistics(backend: str, tmp_path) -> None:
    x0, _ = _batch(0)
    model = _export(_fresh(), (torch.tensor(x0),), str(tmp_path / "net.onnx"), ["x"], "logits")
    inits = [t.name for t in model.graph.initializer]
    stats = ["bn1.running_mean", "bn1.running_var", "bn2.running_mean", "bn2.running_var"]
    out = str(tmp_path)
    artifacts.generate_artifacts(model, requires_grad=[n for n in inits if "running" not in n],
                                 frozen_params=stats, loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=out)
    for name in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        onnx.checker.check_model(onnx.load(os.path.join(out, name)), full_check=True)
    state = CheckpointState.load_checkpoint(os.path.join(out, "checkpoint"))
    so = _options(backend)
    module = Module(os.path.join(out, "training_model.onnx"), state, os.path.join(out, "eval_model.onnx"),
                    session_options=so)
    opt = Optimizer(os.path.join(out, "optimizer_model.onnx"), module)  # the module's backend
    opt.set_learning_rate(LR)
    module.train()
    losses = []
    for i in range(STEPS):
        x, y = _batch(i)
        losses.append(float(module(x, y.astype(np.int64))))
        opt.step()
        module.lazy_reset_grad()
    want_losses, want = _torch_run()
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for key, value in want.items():
        got = state.parameters[key].data
        np.testing.assert_allclose(got, value, rtol=1e-4, atol=1e-6, err_msg=key)


def test_a_layer_reading_its_statistics_itself_keeps_their_names(tmp_path) -> None:
    """bn1's statistics were renamed (``bn1.running_mean_mean``), so the state's ``bn1.running_mean`` never
    changed and the exported model normalised layer 1 with 0 and 1; now bn1 keeps its buffers and bn2 gets
    copies named after its own. Oracle: torch's running statistics after the same training forwards."""
    torch.manual_seed(0)
    net = Net(drawn=("bn1", "bn2"))  # scales and biases apart: the exporter merges the statistics only
    x = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)
    torch.onnx.export(net.eval(), (torch.from_numpy(x),), str(tmp_path / "net.onnx"), input_names=["x"],
                      output_names=["logits"], dynamic_axes={"x": {0: "b"}}, dynamo=False, opset_version=17)
    model = onnx.load(str(tmp_path / "net.onnx"))
    stats = ["bn1.running_mean", "bn1.running_var", "bn2.running_mean", "bn2.running_var"]
    inits = {t.name for t in model.graph.initializer}
    assert {"bn1.running_mean", "bn1.running_var"} <= inits and not {"bn2.running_mean"} & inits
    trained = [t.name for t in model.graph.initializer if t.name not in stats]
    (tmp_path / "art").mkdir()
    artifacts.generate_artifacts(model, requires_grad=trained, frozen_params=stats,
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=str(tmp_path / "art"))
    state = CheckpointState.load_checkpoint(str(tmp_path / "art" / "checkpoint"))
    module = Module(str(tmp_path / "art" / "training_model.onnx"), state,
                    str(tmp_path / "art" / "eval_model.onnx"))
    labels = np.arange(16) % 3
    net.train()
    for _ in range(STEPS):
        module(x, labels)
        with torch.no_grad():
            net(torch.from_numpy(x))
    for layer in (net.bn1, net.bn2):
        name = "bn1" if layer is net.bn1 else "bn2"
        np.testing.assert_allclose(state.parameters[f"{name}.running_mean"].data, layer.running_mean.numpy(),
                                   rtol=1e-5, atol=1e-6)


def test_the_cli_exports_each_layers_trained_statistics(tmp_path) -> None:
    """`onnxtrain train` on the same export: its model.onnx and `onnxtrain export` were built from the
    exported graph, in which bn2 reads bn1's statistics through Identity nodes, so both layers normalised
    with bn1's initial 0 and 1 (3.4 off). Oracle: torch in eval mode with the checkpoint's weights."""
    from onnxtrain.checkpoint import load_checkpoint
    from onnxtrain.cli import main

    torch.manual_seed(0)
    net = Net(drawn=("bn1", "bn2"))  # scales and biases apart: the exporter merges the statistics only
    x = np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32)
    torch.onnx.export(net.eval(), (torch.from_numpy(x[:2]),), str(tmp_path / "net.onnx"), input_names=["x"],
                      output_names=["logits"], dynamic_axes={"x": {0: "b"}}, dynamo=False, opset_version=17)
    np.savez(tmp_path / "data.npz", x=x, y=(x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{path: {tmp_path / 'net.onnx'}, add_loss: cross_entropy, labels: labels}}\n"
                   f"data: {{source: files, path: {tmp_path / 'data.npz'}, feeds: {{x: x, labels: y}}, "
                   "eval_fraction: 0.25}\noptimizer: {name: adam, lr: 1.0e-2}\n"
                   "training: {batch_size: 16, steps: 12, seed: 0}\noutput: {plot: false}\n")
    out = tmp_path / "run"
    assert main(["train", str(cfg), "--output-dir", str(out)]) == 0
    assert main(["export", str(cfg), "--checkpoint", str(out), "-o", str(tmp_path / "exported.onnx")]) == 0
    ckpt = load_checkpoint(sorted((out / "checkpoints").glob("*.ckpt"))[-1])
    weights = {**ckpt.trainable, **ckpt.frozen}
    assert {"bn1.running_mean", "bn2.running_mean"} <= set(ckpt.frozen)
    state = {k: torch.from_numpy(np.array(weights[k])) for k in net.state_dict() if k in weights}
    net.load_state_dict(state, strict=False)
    with torch.no_grad():
        want = net.eval()(torch.from_numpy(x)).numpy()
    for path in (out / "model.onnx", tmp_path / "exported.onnx"):
        got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
