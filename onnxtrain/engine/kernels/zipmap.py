"""``ai.onnx.ml`` ZipMap (inference only): each row of class scores as a dict from class label to score,
the form scikit-learn's converters give a classifier's probabilities by default.

The output is a list of dicts, one per row (a [C] input is one row), keyed by the ``classlabels_int64s``
(Python ints) or ``classlabels_strings`` (str), with Python float values, as onnxruntime returns them; keys
come in ascending order and a repeated label keeps its last column, as in onnxruntime's ``std::map``.
"""

from __future__ import annotations

import numpy as np

from onnxtrain.engine.kernels.ml import ML
from onnxtrain.engine.kernels.ml_linear import _text
from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel


def _labels(attrs: Attrs, op: str) -> list[int] | list[str]:
    """The node's class labels: exactly one of its two label attributes."""
    strings, ints = attrs.get("classlabels_strings"), attrs.get("classlabels_int64s")
    if bool(strings) == bool(ints):
        raise ValueError(f"{op}: give classlabels_strings or classlabels_int64s, one and not both")
    return [_text(s) for s in strings] if strings else [int(i) for i in ints]


@kernel("ZipMap", domain=ML)
def zipmap(inputs: Inputs, attrs: Attrs) -> Outputs:
    op = f"ZipMap {attrs.name!r}"
    labels = attrs.cached("labels", lambda: _labels(attrs, op))
    x = np.asarray(inputs[0])
    if x.dtype != np.float32:
        raise ValueError(f"{op}: the input must be float32 (tensor(float)), got {x.dtype}")
    if x.ndim not in (1, 2):
        raise ValueError(f"{op}: the input must be [N, C] or [C], got shape {list(x.shape)}")
    rows = x.reshape(1, -1) if x.ndim == 1 else x
    if rows.shape[1] != len(labels):
        raise ValueError(f"{op}: {rows.shape[1]} scores per row for {len(labels)} class labels")
    last = {label: j for j, label in enumerate(labels)}  # a repeated label keeps its last column
    keys = sorted(last)
    cols = [last[k] for k in keys]
    return ([dict(zip(keys, row)) for row in rows[:, cols].tolist()],)
