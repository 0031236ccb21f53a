"""Data that ships with onnxtrain: the 8×8 handwritten digits (1,797 images, 10 classes).

The images are the UCI "Optical Recognition of Handwritten Digits" test set as scikit-learn
ships it (``sklearn.datasets.load_digits``), stored here as a compressed .npz.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

DIGITS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "digits.npz")
TEST_FRACTION = 0.2
SPLIT_SEED = 0


@dataclass
class Split:
    x: np.ndarray  # float32 [N, 64] (or [N, 1, 8, 8] with images=True), pixel values scaled to [0, 1]
    y: np.ndarray  # int64 [N]


def load_digits(images: bool = False) -> tuple[Split, Split]:
    """The fixed (train, test) split of the bundled digits: 1,438 and 359 samples."""
    with np.load(DIGITS_PATH) as d:
        x = d["images"].astype(np.float32) / 16.0
        y = d["labels"].astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(y))
    x, y = x[order], y[order]
    x = x.reshape(len(y), 1, 8, 8) if images else x.reshape(len(y), 64)
    n_test = int(round(len(y) * TEST_FRACTION))
    return Split(x[n_test:], y[n_test:]), Split(x[:n_test], y[:n_test])
