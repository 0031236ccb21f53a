"""Elementwise arithmetic, comparison and logic kernels."""

from __future__ import annotations

import numpy as np

from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel


@kernel("Add", since=7)
def add(inputs: Inputs, attrs: Attrs) -> Outputs:
    return (np.add(inputs[0], inputs[1]),)
