"""Train an MLP on the bundled 8×8 digits with the legacy TrainingSession; prints test accuracy."""

from __future__ import annotations

import time

import numpy as np

import onnxtrain
from onnxtrain.data import load_digits
from onnxtrain.zoo import mlp


def train(epochs: int = 30, batch: int = 32, lr: float = 1e-3, seed: int = 0, verbose: bool = True) -> float:
    """Train and return the test accuracy."""
    train_set, test_set = load_digits()
    p = onnxtrain.TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "AdamOptimizer"
    p.enable_grad_norm_clip = False
    sess = onnxtrain.TrainingSession(mlp([64, 128, 10], seed=seed).SerializeToString(), p)
    rng = np.random.default_rng(seed)
    lr_feed = np.array([lr], np.float32)
    evaluate = onnxtrain.RunOptions()
    evaluate.only_execute_path_to_fetches = True  # forward only: no update
    t0 = time.perf_counter()
    for epoch in range(epochs):
        order = rng.permutation(len(train_set.y))
        losses = []
        for i in range(0, len(order) - batch + 1, batch):
            idx = order[i:i + batch]
            losses.append(sess.run(["loss"], {"x": train_set.x[idx], "y": train_set.y[idx],
                                              "Learning_Rate": lr_feed})[0])
        logits = sess.run(["logits"], {"x": test_set.x, "y": test_set.y}, evaluate)[0]
        acc = float(np.mean(logits.argmax(1) == test_set.y))
        if verbose:
            print(f"epoch {epoch + 1:2d}  loss {np.mean(losses):.4f}  test accuracy {acc:.3f}  "
                  f"({time.perf_counter() - t0:.1f} s)")
    return acc


if __name__ == "__main__":
    train()
