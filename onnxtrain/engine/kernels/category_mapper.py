"""``ai.onnx.ml`` CategoryMapper (inference only): strings to int64 and int64 to strings through the paired
``cats_strings`` / ``cats_int64s`` lists, elementwise, any shape.

A value of no category becomes ``default_int64`` (-1) or ``default_string`` ("_Unused"); of a repeated
category the last pair counts, as in onnxruntime.
"""

from __future__ import annotations

import numpy as np

from onnxtrain.engine.kernels.ml import ML
from onnxtrain.engine.kernels.ml_linear import _text
from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel


def _tables(attrs: Attrs, op: str) -> tuple[dict[str, int], dict[int, str]]:
    """(string → int64, int64 → string), the last of repeated categories winning."""
    strings = [_text(s) for s in attrs.get("cats_strings") or []]
    ints = [int(i) for i in attrs.get("cats_int64s") or []]
    if len(strings) != len(ints):
        raise ValueError(f"{op}: {len(strings)} cats_strings for {len(ints)} cats_int64s (they pair up)")
    return dict(zip(strings, ints)), dict(zip(ints, strings))


@kernel("CategoryMapper", domain=ML)
def category_mapper(inputs: Inputs, attrs: Attrs) -> Outputs:
    op = f"CategoryMapper {attrs.name!r}"
    to_int, to_str = attrs.cached("tables", lambda: _tables(attrs, op))
    x = np.asarray(inputs[0])
    flat = x.reshape(-1).tolist()
    if x.dtype == object:
        default = int(attrs.get("default_int64", -1))
        y = np.fromiter((to_int.get(v, default) for v in flat), np.int64, count=len(flat))
    elif x.dtype == np.int64:
        default_s = _text(attrs.get("default_string", "_Unused"))
        y = np.empty(len(flat), object)
        y[:] = [to_str.get(v, default_s) for v in flat]
    else:
        raise ValueError(f"{op}: the input must be string or int64, got {x.dtype}")
    return (y.reshape(x.shape),)
