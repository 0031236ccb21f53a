"""A training call on an empty batch leaves BatchNorm's running statistics as they were, as torch's
training-mode BatchNorm1d does (they became NaN for good: every later eval, export and checkpoint NaN)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module


def test_an_empty_batch_keeps_the_running_statistics(tmp_path) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3)).train()
    path = str(tmp_path / "m.onnx")
    torch.onnx.export(net, (torch.randn(5, 4),), path, input_names=["x"], output_names=["logits"],
                      dynamic_axes={"x": {0: "N"}}, training=torch.onnx.TrainingMode.TRAINING, dynamo=False)
    import onnx

    model = onnx.load(path)
    inits = [t.name for t in model.graph.initializer]
    stats = [n for n in inits if "running" in n]
    frozen = [n for n in inits if n in stats or "num_batches" in n]
    artifacts.generate_artifacts(model, requires_grad=[n for n in inits if n not in frozen],
                                 frozen_params=frozen, loss=artifacts.LossType.CrossEntropyLoss,
                                 artifact_directory=str(tmp_path))
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    module = Module(str(tmp_path / "training_model.onnx"), state)
    before = {n: state.parameters[n].data.copy() for n in stats}
    module(np.zeros((0, 4), np.float32), np.zeros(0, np.int64))
    bn = net[1]
    bn(torch.zeros(0, 6))  # the oracle: torch leaves them as they were
    for n in stats:
        np.testing.assert_array_equal(state.parameters[n].data, before[n])
    np.testing.assert_allclose(before[stats[0]], bn.running_mean.numpy(), rtol=1e-6)
    # a real batch still updates them, as torch does
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    module(x, np.zeros(5, np.int64))
    bn_net = net.train()
    with torch.no_grad():
        bn_net(torch.from_numpy(x))
    np.testing.assert_allclose(state.parameters[stats[0]].data, bn.running_mean.numpy(), rtol=1e-5, atol=1e-6)


def test_the_legacy_session_keeps_them_too(tmp_path) -> None:
    import onnx

    from onnxtrain import TrainingParameters, TrainingSession

    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(self.net(x), y)

    net = Net().train()
    path = str(tmp_path / "m.onnx")
    torch.onnx.export(net, (torch.randn(5, 4), torch.zeros(5, dtype=torch.long)), path,
                      input_names=["x", "y"], output_names=["loss"],
                      dynamic_axes={"x": {0: "N"}, "y": {0: "N"}},
                      training=torch.onnx.TrainingMode.TRAINING, dynamo=False)
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    sess = TrainingSession(onnx.load(path).SerializeToString(), p)
    lr = np.array([0.1], np.float32)
    before = sess.get_state()
    stats = [k for k in before if "running" in k]
    sess.run(None, {"x": np.zeros((0, 4), np.float32), "y": np.zeros(0, np.int64), "Learning_Rate": lr})
    after = sess.get_state()
    for k in stats:
        np.testing.assert_array_equal(after[k], before[k])
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    sess.run(None, {"x": x, "y": np.zeros(5, np.int64), "Learning_Rate": lr})
    with torch.no_grad():
        net(torch.from_numpy(x), torch.zeros(5, dtype=torch.long))  # torch's update from the same statistics
    np.testing.assert_allclose(sess.get_state()[stats[0]], net.net[1].running_mean.numpy(),
                               rtol=1e-5, atol=1e-6)
