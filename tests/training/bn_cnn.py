"""The small torch CNN with BatchNorm that the on-device BatchNorm tests export in training mode."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

from onnxtrain.training.api import CheckpointState, Module, Optimizer

torch = pytest.importorskip("torch")

BATCH = 6
STATS = ("bn.running_mean", "bn.running_var")


class CNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 3 * 3, 3)

    def forward(self, x):
        h = torch.nn.functional.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return self.fc(torch.flatten(h, 1))


def batch(i: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(10 + i)
    return rng.standard_normal((BATCH, 1, 8, 8)).astype(np.float32) * 2 + 0.5, rng.integers(0, 3, BATCH)


def export_cnn(folder: str | os.PathLike) -> tuple[CNN, onnx.ModelProto]:
    """The net (with the exported values) and its model exported in training mode to ``folder``/cnn.onnx,
    its running statistics moved away from the defaults so that a stale or updated value shows."""
    torch.manual_seed(0)
    net = CNN()
    with torch.no_grad():  # statistics away from the defaults, so that a stale or updated value shows
        net.bn.running_mean.uniform_(-0.5, 0.5)
        net.bn.running_var.uniform_(0.5, 2.0)
    path = os.path.join(folder, "cnn.onnx")
    net.train()
    torch.onnx.export(net, torch.randn(2, 1, 8, 8), path, input_names=["input"], output_names=["output"],
                      dynamic_axes={"input": {0: "b"}}, dynamo=False, opset_version=17,
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    model = onnx.load(path)
    with torch.no_grad():  # the export ran the net in training mode: back to the exported values
        sd = net.state_dict()
        for t in model.graph.initializer:
            if t.name in sd:
                sd[t.name].copy_(torch.from_numpy(onnx.numpy_helper.to_array(t).copy()))
    return net, model


def open_artifacts(folder: str | os.PathLike, lr: float) -> tuple[CheckpointState, Module, Optimizer]:
    """The checkpoint state, Module (with the eval model when the folder has one) and Optimizer (learning
    rate ``lr``) of the artifacts in ``folder``."""
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    eval_path = os.path.join(folder, "eval_model.onnx")
    module = Module(os.path.join(folder, "training_model.onnx"), state,
                    eval_path if os.path.exists(eval_path) else None)
    opt = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    opt.set_learning_rate(lr)
    return state, module, opt


def train_steps(module: Module, opt: Optimizer, batches: list[tuple[np.ndarray, np.ndarray]]) -> list[float]:
    """One training step per batch (forward and backward, update, gradients reset); the losses."""
    losses = []
    for x, y in batches:
        losses.append(float(module(x, y)))
        opt.step()
        module.lazy_reset_grad()
    return losses
