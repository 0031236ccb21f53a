"""Inputs declared with one symbolic dimension but fed different sizes of it, named when a run fails.

Dimension names are labels, not constraints: an exporter may reuse "batch" for a flattened batch·sequence
axis, and onnxruntime runs such a model, so a mismatch alone refuses nothing. A run that fails with one
(a batch of 5 inputs with 4 labels) is told apart from other failures, since the node that failed is then
seldom where the mistake is.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from onnxtrain.engine.interface import EngineError
from onnxtrain.errors import RuntimeException

if TYPE_CHECKING:
    import onnx


class Declared(Protocol):
    """A graph input as declared: its name and dims (ints, symbolic names, None; the whole None or empty
    where the rank is unknown), e.g. onnxtrain's ``NodeArg`` or the on-device API's input specs."""

    name: str
    shape: Sequence[Any] | None


class FeedSizeMismatch(EngineError, RuntimeException, ValueError):
    """A run that failed with inputs that share a symbolic dimension fed different sizes of it: an
    :class:`EngineError`, as any failed run, onnxruntime's ``RuntimeException`` (what its legacy session and
    InferenceSession raise when a node's broadcast fails on such feeds), and a ``ValueError`` naming the
    inputs, the dimension and the sizes."""


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


SAME_SIZE_KEY = "onnxtrain.same_size_dims"


def same_size_dims(model: onnx.ModelProto) -> dict[str, list[tuple[str, int]]]:
    """The dims a gradient graph built with ``feeds_checked`` (``build_gradient_model``) takes for one
    size: dim name → the (input, axis) pairs that must be fed one size of it (empty for other models)."""
    for p in model.metadata_props:
        if p.key == SAME_SIZE_KEY:
            return {d: [(str(i), int(a)) for i, a in slots] for d, slots in json.loads(p.value).items()}
    return {}


def shared_dim_slots(inputs: Iterable[Declared]) -> list[list[tuple[str, int]]]:
    """The (input, axis) slots of each symbolic dimension name that occurs more than once in ``inputs``' dims
    (in one input's or two inputs'): only these can be fed two sizes of one dimension."""
    slots: dict[str, list[tuple[str, int]]] = {}
    for spec in inputs:
        for i, d in enumerate(spec.shape or ()):
            if isinstance(d, str) and d:
                slots.setdefault(d, []).append((spec.name, i))
    return [v for v in slots.values() if len(v) > 1]


def _first_split(dims: Iterable[tuple[str, list[tuple[str, int]]]], feeds: Any, strict: bool
                 ) -> tuple[str, tuple[str, int, int] | None, tuple[str, int, int | None]] | None:
    """The first of ``dims`` (dim name, its (input, axis) slots) that ``feeds`` give two sizes: (the name, its
    first fed slot and size, the other slot and size); None when they agree. ``strict``: a slot not fed, or
    without that axis, is a split too (size None); otherwise it is passed over."""
    for d, slots in dims:
        first = None
        for name, axis in slots:
            shape = getattr(feeds.get(name), "shape", None)
            if shape is None or len(shape) <= axis:
                if strict:
                    return d, first, (name, axis, None)
                continue
            if first is None:
                first = (name, axis, shape[axis])
            elif shape[axis] != first[2]:
                return d, first, (name, axis, shape[axis])
    return None


def sizes_agree(shared: list[list[tuple[str, int]]], feeds: Any) -> bool:
    """Whether ``feeds`` give every slot of each of ``shared`` (:func:`shared_dim_slots`) one size; False also
    when a slot is not fed or has no such axis."""
    return _first_split((("", slots) for slots in shared), feeds, True) is None


def same_size_error(dims: dict[str, list[tuple[str, int]]], feeds: Any, what: str) -> str | None:
    """A message beginning with ``what`` when ``feeds`` give two of the (input, axis) pairs of one of
    ``dims`` (:func:`same_size_dims`) different sizes; None when they agree (or an input is not fed)."""
    split = _first_split(dims.items(), feeds, False)
    if split is None:
        return None
    d, first, (name, axis, size) = split
    assert first is not None
    return (f"{what}: inputs {first[0]!r} and {name!r} share dimension {d!r} (index {first[1]} "
            f"of {first[0]!r}, {axis} of {name!r}) but have sizes {first[2]} and {size}; "
            "the training graph takes them for one size where their values meet in a broadcast "
            "(a 1 would not get its gradient summed): feed one size, or declare the dims apart "
            "(other names, or 1 for a broadcast one)")


def check_same_sizes(dims: dict[str, list[tuple[str, int]]], feeds: Any, what: str) -> None:
    """Raise a :class:`FeedSizeMismatch` (:func:`same_size_error`'s message, beginning with ``what``) when
    ``feeds`` give inputs sharing one of ``dims`` different sizes of it: the gradient graph takes them for one
    size and would not sum a broadcast input's gradient back."""
    why = same_size_error(dims, feeds, what)
    if why is not None:
        raise FeedSizeMismatch(why)
