"""The on-device API on a torch model with a data-dependent branch (an exported If whose branches read
weights of the main graph): training steps equal torch's, and the exported inference model keeps the
weights only a branch reads and runs in onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module, Optimizer

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
models = pytest.importorskip("tests.models")
LR = 0.02


class Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 3)
        self.b = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:  # noqa: SIM108 - scripted: an if statement exports as an If node
            y = torch.tanh(self.b(x)) * h
        else:
            y = 0.5 * h - self.b(x)
        return y


def test_branchy_model_trains_like_torch_and_exports(tmp_path) -> None:
    torch.manual_seed(0)
    net = Branchy()
    x = torch.randn(8, 4)
    model = models.export_torchscript(net, (x,), ["x"], ["y"], {"x": {0: "batch"}, "y": {0: "batch"}},
                                      script=True, training=True)
    assert "If" in {n.op_type for n in model.graph.node}
    params = [t.name for t in model.graph.initializer]
    artifacts.generate_artifacts(
        model,
        requires_grad=params,
        loss=artifacts.LossType.MSELoss,
        optimizer=artifacts.OptimType.SGD,
        artifact_directory=tmp_path,
    )
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    module = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    opt = Optimizer(str(tmp_path / "optimizer_model.onnx"), module)
    opt.set_learning_rate(LR)
    topt = torch.optim.SGD(net.parameters(), lr=LR)
    rng = np.random.default_rng(0)
    # inputs along the direction that raises sum(a(x)) or lowers it: both branches run
    toward = net.a.weight.detach().sum(0).numpy()
    toward /= np.linalg.norm(toward)
    branches = set()
    for step in range(6):
        xb = (0.3 * rng.standard_normal((8, 4)) + (2.0 if step % 2 else -2.0) * toward).astype(np.float32)
        target = rng.standard_normal((8, 3)).astype(np.float32)
        with torch.no_grad():
            branches.add(bool(net.a(torch.from_numpy(xb)).sum() > 0))
        module.train()
        ours = float(np.asarray(module(xb, target)))
        opt.step()
        module.lazy_reset_grad()
        topt.zero_grad()
        theirs = ((net(torch.from_numpy(xb)) - torch.from_numpy(target)) ** 2).mean()
        theirs.backward()
        topt.step()
        np.testing.assert_allclose(ours, theirs.item(), rtol=1e-5, err_msg=f"step {step}")
    assert branches == {True, False}
    out = tmp_path / "inference.onnx"
    module.export_model_for_inferencing(str(out), ["y"])
    exported = onnx.load(out)
    onnx.checker.check_model(exported, full_check=True)
    assert sorted(t.name for t in exported.graph.initializer) == sorted(params)
    xs = rng.standard_normal((5, 4)).astype(np.float32)
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": xs})[0]
    with torch.no_grad():
        np.testing.assert_allclose(got, net(torch.from_numpy(xs)).numpy(), rtol=1e-5, atol=1e-6)
