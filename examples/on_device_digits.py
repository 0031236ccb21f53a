"""The on-device training tutorial's flow (onnxruntime-training's MNIST notebook) on the bundled 8×8 digits.

Offline, a forward-only MLP (built with ``onnxtrain.zoo``, no torch needed) becomes training artifacts
through ``artifacts.generate_artifacts`` (cross-entropy loss, AdamW, every weight trainable). On the
"device", ``CheckpointState``, ``Module`` and ``Optimizer`` load them and train: ``module.train()``, a step
per batch (``optimizer.step()``, ``module.lazy_reset_grad()``), then ``module.eval()`` for the test loss and
accuracy after each epoch. Finally ``export_model_for_inferencing`` writes a plain inference model, which
onnxruntime runs when it is installed.

    python examples/on_device_digits.py [--epochs N] [--folder DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass, field

import numpy as np

from onnxtrain.data import load_digits
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module, Optimizer
from onnxtrain.zoo import mlp


@dataclass
class Result:
    """What a run reached: the per-epoch mean training loss, test loss and test accuracy, the test logits of
    the trained model in eval mode, and the path of the exported inference model."""

    train_losses: list[float] = field(default_factory=list)
    test_losses: list[float] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)
    test_logits: np.ndarray | None = None
    inference_model: str = ""


def prepare_artifacts(folder: str, seed: int = 0) -> None:
    """The offline step: a forward-only 64-128-10 MLP (input ``x``, output ``logits``) and its artifacts."""
    model = mlp([64, 128, 10], seed=seed, loss=False)
    trainable = [t.name for t in model.graph.initializer]  # the notebook trains every parameter
    os.makedirs(folder, exist_ok=True)
    artifacts.generate_artifacts(model, requires_grad=trainable, frozen_params=[],
                                 loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW,
                                 additional_output_names=["logits"], artifact_directory=folder)


def run(folder: str, epochs: int = 8, batch: int = 32, lr: float = 2e-3, seed: int = 0,
        verbose: bool = True) -> Result:
    """Generate the artifacts in ``folder``, train on the digits and export the inference model there."""
    prepare_artifacts(folder, seed)
    train_set, test_set = load_digits()

    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    model = Module(os.path.join(folder, "training_model.onnx"), state,
                   os.path.join(folder, "eval_model.onnx"))
    optimizer = Optimizer(os.path.join(folder, "optimizer_model.onnx"), model)
    optimizer.set_learning_rate(lr)

    rng = np.random.default_rng(seed)
    result = Result()
    for epoch in range(epochs):
        model.train()
        order = rng.permutation(len(train_set.y))
        losses = []
        for start in range(0, len(order), batch):
            idx = order[start:start + batch]
            loss, _ = model(train_set.x[idx], train_set.y[idx])
            optimizer.step()
            model.lazy_reset_grad()
            losses.append(float(loss))
        model.eval()
        test_loss, logits = model(test_set.x, test_set.y)
        accuracy = float(np.mean(np.argmax(logits, axis=1) == test_set.y))
        result.train_losses.append(float(np.mean(losses)))
        result.test_losses.append(float(test_loss))
        result.accuracies.append(accuracy)
        result.test_logits = np.asarray(logits)
        if verbose:
            print(f"epoch {epoch + 1}: train loss {result.train_losses[-1]:.4f}, "
                  f"test loss {result.test_losses[-1]:.4f}, test accuracy {accuracy:.3f}")

    result.inference_model = os.path.join(folder, "inference_model.onnx")
    model.export_model_for_inferencing(result.inference_model, ["logits"])
    return result


def predict_with_onnxruntime(path: str, x: np.ndarray) -> np.ndarray:
    """The logits onnxruntime's InferenceSession computes with the exported model."""
    import onnxruntime

    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    return session.run([session.get_outputs()[0].name], {session.get_inputs()[0].name: x})[0]


def main(argv: list[str] | None = None) -> Result:
    """Run the tutorial's flow; print the epochs and a few of onnxruntime's predictions."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--folder", default=None, help="where the artifacts go (default: a temporary folder)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.folder or tmp, epochs=args.epochs)
        _, test_set = load_digits()
        try:
            logits = predict_with_onnxruntime(result.inference_model, test_set.x[:10])
        except ImportError:
            print("onnxruntime is not installed: the inference model is not run")
        else:
            print("onnxruntime predicts", np.argmax(logits, axis=1).tolist(), "for the labels",
                  test_set.y[:10].tolist())
    return result


if __name__ == "__main__":
    main()
