"""Inputs that share a symbolic dimension must agree on its size (spec §6.2 SHOULD).

An input batch of 5 with a target batch of 4 is refused before the run, naming both inputs and the
dimension (onnxruntime-training fails inside its Sub kernel instead); matching batches still train, to
torch's loss.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("batch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    path = str(folder / "mlp.onnx")
    torch.onnx.export(net, torch.randn(2, 4), path, input_names=["input"], output_names=["output"],
                      dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}}, dynamo=False,
                      opset_version=17)
    model = onnx.load(path)
    artifacts.generate_artifacts(model, requires_grad=[t.name for t in model.graph.initializer],
                                 loss=artifacts.LossType.MSELoss, artifact_directory=str(folder))
    return str(folder), net


def test_batch_mismatch_is_an_input_error(setup):
    folder, net = setup
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    m = Module(os.path.join(folder, "training_model.onnx"), state, os.path.join(folder, "eval_model.onnx"))
    x, y = np.ones((5, 4), np.float32), np.zeros((4, 3), np.float32)
    for mode in (m.train, m.eval):
        mode()
        with pytest.raises(ValueError) as e:
            m(x, y)
        msg = str(e.value)
        assert "'input'" in msg and "'target'" in msg and "'batch'" in msg and "5" in msg and "4" in msg, msg
    m.train()
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((5, 4)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32)
    want = torch.nn.functional.mse_loss(net(torch.tensor(x)), torch.tensor(y)).item()
    assert float(m(x, y)) == pytest.approx(want, rel=1e-6)
