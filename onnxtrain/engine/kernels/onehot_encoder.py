"""``ai.onnx.ml`` OneHotEncoder (inference only; scikit-learn's OneHotEncoder exports to it): each element
of X becomes a float32 row of zeros with a one at its category's position, so Y has X's shape plus one axis
of ``len(cats)``.

String inputs are looked up in ``cats_strings``; int64, int32, float and double inputs are truncated to
integers and looked up in ``cats_int64s``, as the schema says. A value of no category gives a row of zeros
(``zeros`` = 1, the default) or an error naming the node and the value (``zeros`` = 0); NaN and ±inf are of
no category. A repeated category takes its last position, as in onnxruntime (which also caps X at rank 2;
any rank runs here, as the spec allows).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxtrain.engine.kernels.ml import ML
from onnxtrain.engine.kernels.ml_linear import _text
from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel


def _categories(attrs: Attrs, op: str) -> tuple[dict[Any, int], int]:
    """(category → its last position, the number of positions), from exactly one of the two category
    attributes."""
    strings, ints = attrs.get("cats_strings"), attrs.get("cats_int64s")
    if bool(strings) == bool(ints):
        raise ValueError(f"{op}: give cats_strings or cats_int64s, one and not both")
    cats = [_text(s) for s in strings] if strings else [int(i) for i in ints]
    return {c: j for j, c in enumerate(cats)}, len(cats)


@kernel("OneHotEncoder", domain=ML)
def one_hot_encoder(inputs: Inputs, attrs: Attrs) -> Outputs:
    op = f"OneHotEncoder {attrs.name!r}"
    table, count = attrs.cached("categories", lambda: _categories(attrs, op))
    strings = bool(attrs.get("cats_strings"))
    x = np.asarray(inputs[0])
    if (x.dtype == object) != strings:
        given, needed = ("strings", "int64s") if strings else ("int64s", "strings")
        raise ValueError(f"{op}: a {'string' if x.dtype == object else x.dtype} input is looked up in "
                         f"cats_{needed}; the node gives cats_{given}")
    flat = x.reshape(-1)
    if strings:
        pos = np.fromiter((table.get(v, -1) if isinstance(v, str) else -1 for v in flat.tolist()), np.int64,
                          count=flat.size)
    else:
        pos = _int_positions(flat, table)
    y = np.zeros((flat.size, count), np.float32)
    hit = pos >= 0
    if not attrs.get("zeros", 1) and not hit.all():
        value = flat[np.argmin(hit)]
        raise ValueError(f"{op}: {value if strings else value.item()!r} is of no category, and zeros = 0")
    y[np.flatnonzero(hit), pos[hit]] = 1.0
    return (y.reshape(*x.shape, count),)


def _int_positions(flat: np.ndarray, table: dict[Any, int]) -> np.ndarray:
    """Each numeric value's category position (truncated to an integer), -1 for none."""
    cats = np.array(list(table), np.int64)
    where = np.array(list(table.values()), np.int64)
    order = np.argsort(cats)
    cats, where = cats[order], where[order]
    if flat.dtype.kind == "f":
        ok = np.isfinite(flat) & (np.abs(flat) < 2.0**63)
        values = np.where(ok, flat, 0).astype(np.int64)  # truncation toward zero, as a C cast
    else:
        ok, values = np.ones(flat.shape, bool), flat.astype(np.int64)
    at = np.minimum(np.searchsorted(cats, values), len(cats) - 1)
    found = ok & (cats[at] == values)
    return np.where(found, where[at], -1)
