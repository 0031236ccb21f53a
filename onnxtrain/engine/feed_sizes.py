"""Inputs declared with one symbolic dimension but fed different sizes of it, named when a run fails.

Dimension names are labels, not constraints: an exporter may reuse "batch" for a flattened batch·sequence
axis, and onnxruntime runs such a model, so a mismatch alone refuses nothing. A run that fails with one
(a batch of 5 inputs with 4 labels) is told apart from other failures, since the node that failed is then
seldom where the mistake is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from onnxtrain.engine.interface import EngineError


class Declared(Protocol):
    """A graph input as declared: its name and dims (ints, symbolic names, None; the whole None or empty
    where the rank is unknown), e.g. onnxtrain's ``NodeArg`` or the on-device API's input specs."""

    name: str
    shape: Sequence[Any] | None


class FeedSizeMismatch(EngineError, ValueError):
    """A run that failed with inputs that share a symbolic dimension fed different sizes of it: an
    :class:`EngineError`, as any failed run, and a ``ValueError`` naming the inputs, the dimension and the
    sizes."""


def _shape(value: Any) -> tuple[int, ...] | None:
    try:
        return np.shape(value.numpy() if hasattr(value, "numpy") and callable(value.numpy) else value)
    except (TypeError, ValueError):
        return None


def shared_dim_mismatch(inputs: Iterable[Declared], feeds: Mapping[str, Any], what: str) -> str | None:
    """Which of ``inputs`` that share a symbolic dimension were fed different sizes of it in ``feeds``, as a
    message beginning with ``what``; None when they agree."""
    seen: dict[str, tuple[str, int, int, tuple[int, ...]]] = {}
    for spec in inputs:
        name, dims = spec.name, spec.shape
        shape = _shape(feeds[name]) if dims is not None and name in feeds else None
        if shape is None or len(shape) != len(dims):
            continue
        for i, d in enumerate(dims):
            if not isinstance(d, str) or not d:
                continue
            first = seen.setdefault(d, (name, i, shape[i], shape))
            if first[2] != shape[i]:
                other, at, size, other_shape = first
                return (f"{what}: inputs {other!r} and {name!r} share dimension {d!r} (index {at} of "
                        f"{other!r}, {i} of {name!r}) but have sizes {size} and {shape[i]} (shapes "
                        f"{list(other_shape)} and {list(shape)})")
    return None
