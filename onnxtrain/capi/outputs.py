"""The caller's own output arrays: as onnxruntime's, every output a run returns is a writable, row-major array
that shares memory with no feed and no other output (the engine may return views: an Identity of an input, a
Transpose, an initializer passed through, one value under two output names)."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.lib.array_utils import byte_bounds

from onnxtrain.capi.ortvalue import OrtValue
from onnxtrain.engine.transpose_copy import contiguous


def own_outputs(outs: list[Any], feeds: Any, held: Sequence[np.ndarray] = ()) -> list[Any]:
    """``outs`` with a copy of each array (a sequence's items too) that is read-only (an initializer or a
    Constant passed through), may share memory with a feed (an Identity of an input) or with one of ``held``
    (writable arrays the session runs on: the caller's ``add_initializer`` values), or is not C-contiguous
    (a Transpose's view): as onnxruntime's, every output is the caller's to write, none changes with a feed
    and writing one changes no later run, and each is laid out row-major (``OrtValue.data_ptr()`` with its
    shape describes it)."""
    held_ids = {id(h) for h in held}
    fed: list[np.ndarray] = []
    for v in feeds.values() if isinstance(feeds, Mapping) else ():
        if isinstance(v, OrtValue):
            v = v.numpy()
        fed += [x for x in v if isinstance(x, np.ndarray)] if isinstance(v, (list, tuple)) else [v]
    fed = [v for v in fed if isinstance(v, np.ndarray)]

    def own(o: Any) -> Any:
        if not isinstance(o, np.ndarray):
            return o
        flags = o.flags
        if not flags.c_contiguous:  # (a Transpose's view: by tiles where it swaps blocks of axes)
            return contiguous(o)
        if not flags.writeable or any(np.may_share_memory(o, f) for f in fed):
            return o.copy()
        # (only a held array itself or a view can share its memory: an output the run made is neither)
        if held_ids and (o.base is not None or id(o) in held_ids) and any(np.may_share_memory(o, h)
                                                                          for h in held):
            return o.copy()
        return o

    return [[own(v) for v in o] if isinstance(o, list) and o and isinstance(o[0], np.ndarray) else own(o)
            for o in outs]


def unshared_with(outs: list[Any], held: Iterable[Any]) -> list[Any]:
    """``outs`` (changed in place and returned) with a copy of each array that is one of ``held``'s arrays or
    a view into one (an output passing a weight through, or reshaping or slicing it): a later update writes
    those arrays in place, and the caller's array must keep the value it was given. Outputs that own their
    memory are not compared, and ``held`` is read only when some output does not."""
    suspects = [k for k, o in enumerate(outs) if isinstance(o, np.ndarray)]
    if not suspects:
        return outs
    arrays = [a for a in held if isinstance(a, np.ndarray)]
    ids = {id(a) for a in arrays}
    for k in suspects:
        o = outs[k]
        if (o.base is not None or id(o) in ids) and any(np.may_share_memory(o, a) for a in arrays):
            outs[k] = o.copy()
    return outs


def outputs_apart(outs: list[Any]) -> list[Any]:
    """``outs`` with a copy of each array that may overlap an earlier one (y and an Identity of y, or the
    items of a sequence output), as onnxruntime gives each its own buffer. Only arrays over one base object
    can overlap; the byte ranges kept per base are disjoint and sorted, so each array costs a bisection."""
    if len(outs) < 2 and not (outs and isinstance(outs[0], list)):
        return outs  # (the usual training run: one output, nothing to overlap)
    kept: dict[int, tuple[list[int], list[int]]] = {}  # base id -> (starts, ends) of the kept arrays

    def apart(a: np.ndarray) -> np.ndarray:
        if not a.size:
            return a
        base = a
        while isinstance(base.base, np.ndarray):
            base = base.base
        starts, ends = kept.setdefault(id(base.base if base.base is not None else base), ([], []))
        lo, hi = byte_bounds(a)
        k = bisect.bisect_right(starts, lo)
        if (k and ends[k - 1] > lo) or (k < len(starts) and starts[k] < hi):
            return a.copy()
        starts.insert(k, lo)
        ends.insert(k, hi)
        return a

    for k, o in enumerate(outs):
        if isinstance(o, np.ndarray):
            outs[k] = apart(o)
        elif isinstance(o, list) and o and isinstance(o[0], np.ndarray):  # a sequence of tensors: its items
            outs[k] = [apart(v) if isinstance(v, np.ndarray) else v for v in o]
    return outs
