"""torch's default exporter (dynamo) writes a BatchNorm traced in training mode as an inference
BatchNormalization: building its gradients warns, naming the node; an export in eval mode, or one that keeps
training mode (TorchScript with TrainingMode.TRAINING) has training_mode set, so neither warns."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest

from onnxtrain.autodiff import build_gradient_model

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript", reason="torch's dynamo exporter needs onnxscript")


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x)).square().mean()


def _export(training: bool):
    torch.manual_seed(0)
    net = _Net().train(training)
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.onnx.export(net, (x,), dynamo=True, optimize=False, input_names=["x"],
                                 output_names=["loss"], verbose=False).model_proto


def test_batch_norm_traced_in_training_mode_warns() -> None:
    model = _export(training=True)
    bn = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    assert len(bn) == 1 and not any(a.name == "training_mode" for a in bn[0].attribute)
    with pytest.warns(UserWarning, match=rf"BatchNormalization \['{bn[0].name}'\]: torch traced them in"):
        build_gradient_model(model, "loss", ["fc.weight"])


def test_batch_norm_exported_in_eval_mode_is_quiet() -> None:
    model = _export(training=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_gradient_model(model, "loss", ["fc.weight"])


def test_legacy_session_warns_when_it_would_train_folded_constants() -> None:
    """With the exporter's optimizer on (its default), a Linear's weight becomes its folded transpose
    ``val_<n>``; the legacy session's weight discovery would train that constant: it warns, naming it."""
    from onnxtrain import TrainingParameters, TrainingSession

    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)  # on a 3-D input: a MatMul with the weight's transpose, which is folded
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((2, 5, 4)).astype(np.float32))

    class WithLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x).square().mean()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.onnx.export(WithLoss(), (x,), dynamo=True, input_names=["x"], output_names=["loss"],
                                  verbose=False).model_proto
    folded = [t.name for t in model.graph.initializer if t.name.startswith("val_") and t.data_type == 1]
    assert folded, [t.name for t in model.graph.initializer]
    params = TrainingParameters()
    params.loss_output_name = "loss"
    with pytest.warns(UserWarning, match=rf"training \['{folded[0]}'.*optimize=False"):
        TrainingSession(model.SerializeToString(), params)


class _Tied(torch.nn.Module):
    """A language-model-style tying: the input embedding, a second module's embedding and the output head
    share one weight, which torch names ``shared.weight`` and its exporter writes as ``head.weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = torch.nn.Embedding(20, 8)
        self.enc = torch.nn.Embedding(20, 8)
        self.enc.weight = self.shared.weight
        self.head = torch.nn.Linear(8, 20, bias=False)
        self.head.weight = self.shared.weight
        self.mix = torch.nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.mix(self.enc(ids))))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def test_tied_weight_trains_under_the_name_the_export_keeps(tmp_path) -> None:
    """A tied weight is one initializer under one of torch's names for it: asking for another name is an
    error that says how to list them all; the name kept gets the gradient of every use, as torch's."""
    from onnxtrain.testing import run_engine
    from onnxtrain.training.artifacts import LossType, generate_artifacts

    torch.manual_seed(0)
    net = _Tied()
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 20, (3, 5)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.onnx.export(net, (ids,), dynamo=True, optimize=False, input_names=["ids"],
                                  output_names=["loss"], verbose=False).model_proto
    inits = {t.name for t in model.graph.initializer}
    deduplicated = [n for n, _ in net.named_parameters()]
    assert "shared.weight" in deduplicated and "shared.weight" not in inits, inits
    with pytest.raises(RuntimeError, match=r"\['shared.weight'\].*tied.*remove_duplicate=False"):
        generate_artifacts(model, requires_grad=deduplicated, loss=LossType.MSELoss,
                           artifact_directory=tmp_path)

    params = dict(net.named_parameters(remove_duplicate=False))
    wrt = [n for n in params if n in inits]
    assert sorted(wrt) == ["head.weight", "mix.bias", "mix.weight"], wrt
    grads = build_gradient_model(model, "loss", wrt)
    onnx.checker.check_model(grads, full_check=True)
    got = dict(zip([o.name for o in grads.graph.output], run_engine(grads, {"ids": ids.numpy()})))
    loss = net(ids)
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-6)
    for n in wrt:  # head.weight's gradient sums the embedding's and the head's, as torch's shared.weight
        np.testing.assert_allclose(got[f"{n}_grad"], params[n].grad.numpy(), rtol=1e-5, atol=1e-7)
