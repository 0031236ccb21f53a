"""``ai.onnx.ml`` FeatureVectorizer (inference only): its inputs' rows side by side in one float32 [N, D]
tensor, D the sum of ``inputdimensions``.

Input i fills its ``inputdimensions[i]`` columns with the first values of each of its rows (its trailing
axes flattened; a [C] input is one row), cut or padded with zeros to that width, as onnxruntime does. All
inputs must have the same number of rows (onnxruntime assumes it).
"""

from __future__ import annotations

import numpy as np

from onnxtrain.engine.kernels.ml import ML
from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel


@kernel("FeatureVectorizer", domain=ML)
def feature_vectorizer(inputs: Inputs, attrs: Attrs) -> Outputs:
    op = f"FeatureVectorizer {attrs.name!r}"
    widths = [int(d) for d in attrs.get("inputdimensions") or []]
    if len(widths) != len(inputs):
        raise ValueError(f"{op}: {len(inputs)} inputs for {len(widths)} inputdimensions (one each)")
    if any(w < 0 for w in widths):
        raise ValueError(f"{op}: inputdimensions {widths} holds a negative width")
    rows = []
    for k, v in enumerate(inputs):
        a = np.asarray(v)
        if a.dtype.kind not in "fi" or a.ndim == 0:
            raise ValueError(f"{op}: input {k} must be a numeric tensor of rank 1 or more, got "
                             f"{a.dtype}{list(a.shape)}")
        rows.append(a.reshape(1, -1) if a.ndim == 1 else a.reshape(len(a), int(np.prod(a.shape[1:]))))
    n = len(rows[0]) if rows else 0
    if any(len(r) != n for r in rows):
        raise ValueError(f"{op}: the inputs have {[len(r) for r in rows]} rows; they must have as many")
    y = np.zeros((n, sum(widths)), np.float32)
    start = 0
    for r, w in zip(rows, widths):
        used = min(w, r.shape[1])
        y[:, start:start + used] = r[:, :used]
        start += w
    return (y,)
