"""Inputs that share a symbolic dimension and fail the run: the error names them (spec §6.2 SHOULD).

An input batch of 5 with a target batch of 4 fails with a ValueError naming both inputs and the dimension
(onnxruntime-training fails inside its Sub kernel instead); matching batches still train, to torch's loss.
The names are not constraints: a model whose exporter reused "batch" for a flattened batch·sequence axis
(so that the labels' "batch" is not the tokens') trains, as it does in onnxruntime-training.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

from onnxtrain import SessionOptions
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


def tagger_artifacts(folder) -> torch.nn.Module:
    """Artifacts (cross-entropy) in ``folder`` of a tagger whose logits are flattened to [batch·seq, vocab]
    but still called "batch" by torch's exporter; returns the torch model."""
    torch.manual_seed(0)

    class Tagger(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(20, 8)
            self.head = torch.nn.Linear(8, 5)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(tokens)).reshape(-1, 5)

    net = Tagger()
    path = os.path.join(folder, "tagger.onnx")
    torch.onnx.export(net, torch.zeros(2, 4, dtype=torch.int64), path, input_names=["tokens"],
                      output_names=["logits"], dynamic_axes={"tokens": {0: "batch"}, "logits": {0: "batch"}},
                      dynamo=False, opset_version=17)
    model = onnx.load(path)
    artifacts.generate_artifacts(model, requires_grad=[t.name for t in model.graph.initializer],
                                 loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=str(folder))
    return net


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_reused_dimension_name_trains(tmp_path, backend):
    """torch's exporter told ``logits: {0: "batch"}`` for logits flattened to [batch·seq, vocab]: the
    labels the loss block adds are [batch] by name but batch·seq long. Training and eval run, to torch's
    loss, on both backends (onnxruntime's, whose labels are checked against the scores, passes the check: they
    agree); 11 labels for the 12 token rows fail, naming the inputs."""
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    net = tagger_artifacts(tmp_path)
    train = onnx.load(str(tmp_path / "training_model.onnx"))
    labels = next(i for i in train.graph.input if i.name == "labels")
    assert [d.dim_param for d in labels.type.tensor_type.shape.dim] == ["batch"]  # the reused name

    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", backend)
    m = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"),
               session_options=so)
    rng = np.random.default_rng(1)
    tokens, y = rng.integers(0, 20, (3, 4)), rng.integers(0, 5, 12)
    want = torch.nn.functional.cross_entropy(net(torch.tensor(tokens)), torch.tensor(y)).item()
    with pytest.warns(UserWarning, match=r"share dimension 'batch'.*the run went through"):
        assert float(m(tokens, y)) == pytest.approx(want, rel=1e-6)
    m.eval()
    with pytest.warns(UserWarning, match="the run went through"):
        assert float(m(tokens, y)) == pytest.approx(want, rel=1e-6)
    m.train()
    with pytest.raises(ValueError, match=r"inputs 'tokens' and 'labels' share dimension 'batch'"):
        m(tokens, y[:11])


def test_mismatch_the_runtime_misses_is_an_error_on_the_onnxruntime_backend(setup):
    """onnxruntime 1.32's cross-entropy takes 5 score rows and 4 labels without a word (it gathers the
    labels' rows); the backend reshapes the labels to the scores' batch first, so the run fails and the
    error names the inputs, as on the numpy engine."""
    pytest.importorskip("onnxruntime")
    import onnxtrain

    folder, _ = setup
    tagger = os.path.join(folder, "ce")
    os.makedirs(tagger, exist_ok=True)
    model = onnx.load(os.path.join(folder, "mlp.onnx"))
    artifacts.generate_artifacts(model, requires_grad=[t.name for t in model.graph.initializer],
                                 loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tagger)
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    state = CheckpointState.load_checkpoint(os.path.join(tagger, "checkpoint"))
    m = Module(os.path.join(tagger, "training_model.onnx"), state, session_options=so)
    x, y = np.ones((5, 4), np.float32), np.zeros(4, np.int64)
    with pytest.raises(ValueError, match=r"inputs 'input' and 'labels' share dimension 'batch'.*5 and 4"):
        m(x, y)
