"""onnxtrain train scores the eval set with the loss as training computes it: a user model holding torch's
TorchScript export of BCEWithLogitsLoss (log σ terms written out) gave a NaN eval loss at logits of a few
hundred while its training loss was finite; the eval loss now equals torch's."""

from __future__ import annotations

import json
import warnings

import pytest

from onnxtrain.cli import main
from onnxtrain.data import load_digits

torch = pytest.importorskip("torch")


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(64, 10)
        with torch.no_grad():
            self.lin.weight.mul_(300.0)  # logits of a few hundred

    def forward(self, x, y):
        logits = self.lin(x)
        target = torch.nn.functional.one_hot(y, 10).float()
        return logits, torch.nn.functional.binary_cross_entropy_with_logits(logits, target)


def test_eval_loss_of_an_exported_bce_equals_torch(tmp_path):
    net = _Net()
    train, test = load_digits()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.from_numpy(train.x[:4]), torch.from_numpy(train.y[:4])),
                          str(tmp_path / "model.onnx"), dynamo=False, input_names=["x", "y"],
                          output_names=["logits", "loss"],
                          dynamic_axes={"x": {0: "n"}, "y": {0: "n"}, "logits": {0: "n"}})
    with torch.no_grad():
        want = float(net(torch.from_numpy(test.x), torch.from_numpy(test.y))[1])
    (tmp_path / "cfg.yaml").write_text(
        "model: {path: model.onnx, logits: logits, loss: loss, labels: y}\n"
        "optimizer: {name: sgd, lr: 1.0e-12}\n"  # one step that leaves the weights as torch has them
        "training: {steps: 1, batch_size: 32, eval_every: 1}\noutput: {dir: out}\n")
    assert main(["train", str(tmp_path / "cfg.yaml"), "-q", "--output-dir", str(tmp_path / "out")]) == 0
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    got = [r["eval_loss"] for r in records if "eval_loss" in r][-1]
    assert got == pytest.approx(want, rel=1e-5)
