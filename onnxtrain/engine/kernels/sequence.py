"""Sequence and optional kernels. An ONNX sequence is a Python list of arrays (never changed in place:
each op that "modifies" one returns a new list); an empty optional is ``None``."""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel


def _position(p: Any, length: int, insert: bool = False) -> int:
    """A sequence position tensor as an index in [0, length) ([0, length] to insert before)."""
    a = np.asarray(p)
    if a.size != 1 or a.dtype.kind not in "iu":
        raise ValueError(f"position must be a single int32/int64 value, got {a.dtype}{list(a.shape)}")
    i = int(a.reshape(-1)[0])
    hi = length if insert else length - 1
    if not -length <= i <= hi:
        raise ValueError(f"position {i} is out of range for a sequence of length {length}")
    return i + length if i < 0 else i


def _sequence(v: Any, op: str) -> list:
    if not isinstance(v, list):
        raise TypeError(f"{op} expects a sequence input, got {type(v).__name__}")
    return v


@kernel("SequenceEmpty", since=11)
def sequence_empty(inputs: Inputs, attrs: Attrs) -> Outputs:
    return ([],)


@kernel("SequenceConstruct", since=11)
def sequence_construct(inputs: Inputs, attrs: Attrs) -> Outputs:
    return (list(inputs),)


@kernel("SequenceInsert", since=11)
def sequence_insert(inputs: Inputs, attrs: Attrs) -> Outputs:
    seq = _sequence(inputs[0], "SequenceInsert")
    pos = inputs[2] if len(inputs) > 2 and inputs[2] is not None else None
    i = len(seq) if pos is None else _position(pos, len(seq), insert=True)
    return ([*seq[:i], inputs[1], *seq[i:]],)


@kernel("SequenceAt", since=11)
def sequence_at(inputs: Inputs, attrs: Attrs) -> Outputs:
    seq = _sequence(inputs[0], "SequenceAt")
    return (seq[_position(inputs[1], len(seq))],)


@kernel("SequenceErase", since=11)
def sequence_erase(inputs: Inputs, attrs: Attrs) -> Outputs:
    seq = _sequence(inputs[0], "SequenceErase")
    pos = inputs[1] if len(inputs) > 1 and inputs[1] is not None else np.int64(-1)
    i = _position(pos, len(seq))
    return ([*seq[:i], *seq[i + 1:]],)


@kernel("SequenceLength", since=11)
def sequence_length(inputs: Inputs, attrs: Attrs) -> Outputs:
    return (np.array(len(_sequence(inputs[0], "SequenceLength")), np.int64),)


@kernel("ConcatFromSequence", since=11)
def concat_from_sequence(inputs: Inputs, attrs: Attrs) -> Outputs:
    seq = _sequence(inputs[0], "ConcatFromSequence")
    if not seq:
        raise ValueError("ConcatFromSequence of an empty sequence")
    axis, stack = attrs["axis"], bool(attrs.get("new_axis", 0))
    rank = seq[0].ndim + (1 if stack else 0)
    if not -rank <= axis < rank:
        raise ValueError(f"axis {axis} is out of range for rank {rank}")
    return ((np.stack if stack else np.concatenate)(seq, axis=axis),)


def _split_sizes(split: np.ndarray, dim: int, axis: int) -> list[int]:
    """The lengths of SplitToSequence's pieces by its ``split`` input along an axis of length ``dim``."""
    if split.ndim == 0:
        size = int(split)
        if size <= 0:
            raise ValueError(f"split must be positive, got {size}")
        return [size] * (dim // size) + ([dim % size] if dim % size else [])
    sizes = [int(v) for v in split.ravel()]
    if any(v < 0 for v in sizes) or sum(sizes) != dim:
        raise ValueError(f"split sizes {sizes} do not add up to dimension {dim} of axis {axis}")
    return sizes


@kernel("SplitToSequence", since=11)
def split_to_sequence(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    axis = attrs.get("axis", 0)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for rank {x.ndim}")
    axis %= x.ndim
    dim = x.shape[axis]
    split = inputs[1] if len(inputs) > 1 and inputs[1] is not None else None
    if split is not None and np.size(split) == 0:
        split = None  # an empty split tensor counts as none given, as onnxruntime takes it
    if split is None:
        parts = np.split(x, dim, axis=axis) if dim else []
        if not attrs.get("keepdims", 1):
            parts = [p.squeeze(axis) for p in parts]
        return (parts,)
    sizes = _split_sizes(np.asarray(split), dim, axis)
    if not sizes:  # a scalar split of an empty axis: no piece (np.split would give the whole)
        return ([],)
    return (np.split(x, np.cumsum(sizes)[:-1], axis=axis),)


@kernel("Optional", since=15)
def optional(inputs: Inputs, attrs: Attrs) -> Outputs:
    return (inputs[0] if inputs else None,)


@kernel("OptionalHasElement", since=15)
def optional_has_element(inputs: Inputs, attrs: Attrs) -> Outputs:
    return (np.array(bool(inputs) and inputs[0] is not None),)


@kernel("OptionalGetElement", since=15)
def optional_get_element(inputs: Inputs, attrs: Attrs) -> Outputs:
    if not inputs or inputs[0] is None:
        raise ValueError("OptionalGetElement of an empty optional")
    return (inputs[0],)
