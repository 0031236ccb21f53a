"""The MLP trained with the legacy session on the bundled digits reaches >= 95 % test accuracy."""

from __future__ import annotations

import os
import sys
import time

from onnxtrain.data import load_digits

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))


def test_bundled_digits_split() -> None:
    train, test = load_digits()
    assert train.x.shape == (1438, 64) and test.x.shape == (359, 64)
    assert sorted(set(train.y.tolist())) == list(range(10))
    assert train.x.min() >= 0.0 and train.x.max() <= 1.0


def test_mlp_reaches_95_percent_on_digits_quickly() -> None:
    from train_digits import train

    t0 = time.perf_counter()
    acc = train(epochs=20, verbose=False)
    assert acc >= 0.95, acc
    assert time.perf_counter() - t0 < 60
