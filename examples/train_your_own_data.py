"""Train your own .onnx model on your own arrays with a config, from Python (same as ``onnxtrain train``).

Writes, into a folder (default ``runs/own_data``): ``blobs.npz`` (named arrays), ``net.onnx`` (an
inference model without a loss: the config appends softmax cross-entropy), ``own_data.yaml``, and
the run's outputs (in ``<folder>/out``, replaced by each run: ``Trainer.run()`` overwrites by default). The
equivalent command line is
``onnxtrain train runs/own_data/own_data.yaml --output-dir runs/own_data/out --overwrite`` (without
``--overwrite`` the command refuses a folder that holds a run's checkpoints; ``--resume`` continues it).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import onnx

from onnxtrain.train import Trainer, load_config
from onnxtrain.zoo import mlp

CONFIG = """\
model:
  path: net.onnx            # relative to this file
  add_loss: cross_entropy   # the model outputs logits only: append SoftmaxCrossEntropyLoss(logits, labels)
  labels: labels            # name of the new label input
data:
  source: files
  path: blobs.npz
  feeds: {x: points, labels: classes}   # model input -> array name in the .npz
  eval_fraction: 0.2        # held out from the arrays, chosen by training.seed
optimizer: {name: adam, lr: 1.0e-2}
schedule: {kind: linear, warmup_steps: 10}
training: {batch_size: 32, epochs: 10, seed: 0}
"""


def main(folder: str = os.path.join("runs", "own_data")) -> float:
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    classes = rng.integers(0, 3, 600)
    centres = np.array([[0.0, 2.0], [2.0, -1.0], [-2.0, -1.0]])
    points = (centres[classes] + rng.standard_normal((600, 2)) * 0.6).astype(np.float32)
    np.savez(os.path.join(folder, "blobs.npz"), points=points, classes=classes)
    onnx.save(mlp([2, 16, 3], loss=False), os.path.join(folder, "net.onnx"))
    path = os.path.join(folder, "own_data.yaml")
    with open(path, "w") as f:
        f.write(CONFIG)
    result = Trainer(load_config(path), os.path.join(folder, "out")).run()
    print(f"eval accuracy {result.metrics['eval_accuracy']:.3f}; inference model: {result.exported}")
    return result.metrics["eval_accuracy"]


if __name__ == "__main__":
    main(*sys.argv[1:])
