"""A custom loss written as an onnxblock.Block trains end to end with Module and Optimizer."""

from __future__ import annotations

import os

import numpy as np

from onnxtrain.training import onnxblock
from onnxtrain.training.api import CheckpointState, Module, Optimizer
from onnxtrain.training.artifacts import OptimType, generate_artifacts
from onnxtrain.zoo import mlp


class SmoothL1PlusL2(onnxblock.Block):
    """0.5·MSE + L1 on the logits against float targets (a loss none of the built-ins is)."""

    def __init__(self) -> None:
        super().__init__()
        self.mse = onnxblock.loss.MSELoss()
        self.l1 = onnxblock.loss.L1Loss()
        self.add = onnxblock.blocks.Add()
        self.mul = onnxblock.blocks.Mul()
        self.half = onnxblock.blocks.Constant(0.5)

    def build(self, logits: str) -> str:
        return self.add(self.mul(self.half(), self.mse(logits, target_name="target")),
                        self.l1(logits, target_name="target"))


def test_block_loss_trains(tmp_path) -> None:
    model = mlp([6, 16, 3], seed=3, loss=False)
    params = [t.name for t in model.graph.initializer]
    generate_artifacts(model, requires_grad=params, loss=SmoothL1PlusL2(), optimizer=OptimType.AdamW,
                       artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(os.path.join(tmp_path, "checkpoint"))
    module = Module(os.path.join(tmp_path, "training_model.onnx"), state,
                    os.path.join(tmp_path, "eval_model.onnx"))
    opt = Optimizer(os.path.join(tmp_path, "optimizer_model.onnx"), module)
    opt.set_learning_rate(0.01)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 6)).astype(np.float32)
    target = (x[:, :3] * 0.5 - x[:, 3:] * 0.25).astype(np.float32)  # a learnable linear map
    losses = []
    for _ in range(300):
        losses.append(float(module(x, target)))  # one output: Module returns it alone, as onnxruntime does
        opt.step()
        module.lazy_reset_grad()
    assert losses[-1] < 0.2 * losses[0], (losses[0], losses[-1])
    module.eval()
    assert float(module(x, target)) < 0.2 * losses[0]
