"""What a value fed to a tensor input becomes before its dtype and shape are checked: shared by the inference
sessions, the legacy session and the on-device ``Module`` (which does not load the inference module)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from onnxtrain.errors import InvalidFeedType, NoneFed


def feed_array(name: str, v: Any, dtype: np.dtype | None) -> np.ndarray:
    """``v`` fed to tensor input ``name`` of ``dtype`` (None when not declared) as an array, its dtype not yet
    checked: a list, a tuple or a Python number takes the input's type, as in onnxruntime; an array or an
    object that carries its own dtype (a numpy scalar, a torch tensor, anything with ``__array__``) keeps it.
    None, and str or bytes for a numeric input, are refused (numpy would read them as NaN and as numbers)."""
    if isinstance(v, np.ndarray):  # a subclass (np.matrix, a masked array) as its plain data, as onnxruntime
        return _row_major(v if type(v) is np.ndarray else np.asarray(v))
    if v is None:
        raise NoneFed(f"input {name!r}: None was fed; feed a tensor, or leave out an optional input")
    numeric = dtype is not None and dtype != np.dtype(object)
    if numeric and isinstance(v, (str, bytes)):
        raise InvalidFeedType(f"input {name!r}: a {type(v).__name__} was fed to a tensor of {dtype}")
    takes_type = numeric and not isinstance(v, np.generic) and isinstance(v, (list, tuple, bool, int, float))
    try:
        return _row_major(np.asarray(v, dtype=dtype) if takes_type else np.asarray(v))
    except (OverflowError, ValueError, TypeError) as e:  # a RuntimeError, as onnxruntime's
        kind = "" if dtype is None else f" of {dtype}"
        raise InvalidFeedType(f"input {name!r}: could not create a tensor{kind} from the value given: "
                              f"{e}") from None


def _row_major(a: np.ndarray) -> np.ndarray:
    """``a``, or a C-ordered copy of a strided or Fortran-ordered one, as onnxruntime copies such feeds:
    reductions and softmax then sum in one order whatever the feed's layout (their last bits followed it)."""
    return a if a.flags.c_contiguous else a.copy(order="C")


__all__ = ["feed_array"]


def empty_run(feeds: Mapping[str, Any]) -> bool:
    """Whether a training run is fed an empty tensor (a batch of no sample): such a run leaves BatchNorm's
    running statistics as they were, as torch's training-mode BatchNorm does (batch statistics of 0/0)."""
    return any(getattr(v, "size", 1) == 0 for v in feeds.values())
