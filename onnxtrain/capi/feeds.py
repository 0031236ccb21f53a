"""What a value fed to a tensor input becomes before its dtype and shape are checked: shared by the inference
sessions, the legacy session and the on-device ``Module`` (which does not load the inference module); and
what a dict fed to a map input (an ai.onnx.ml DictVectorizer's or CastMap's) must hold."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from onnxtrain.errors import InvalidFeedType, NoneFed


def feed_array(name: str, v: Any, dtype: np.dtype | None) -> np.ndarray:
    """``v`` fed to tensor input ``name`` of ``dtype`` (None when not declared) as an array, its dtype not yet
    checked: a list, a tuple or a Python number takes the input's type (onnxruntime's InferenceSession takes
    only lists: see :func:`check_onnxruntime_feed`); a list for a string input holds objects (each later
    its ``str()``, as onnxruntime converts them); an array or an object that carries its own dtype (a numpy
    scalar, a torch tensor, anything with ``__array__``) keeps it. None, and str or bytes for a numeric
    input, are refused (numpy would read them as NaN and as numbers)."""
    if isinstance(v, np.ndarray):  # a subclass (np.matrix, a masked array) as its plain data, as onnxruntime
        return _row_major(v if type(v) is np.ndarray else np.asarray(v))
    if v is None:
        raise NoneFed(f"input {name!r}: None was fed; feed a tensor, or leave out an optional input")
    numeric = dtype is not None and dtype != np.dtype(object)
    if numeric and isinstance(v, (str, bytes)):
        raise InvalidFeedType(f"input {name!r}: a {type(v).__name__} was fed to a tensor of {dtype}")
    takes_type = numeric and not isinstance(v, np.generic) and isinstance(v, (list, tuple, bool, int, float))
    # a list for a string input: its items as objects (str() of each later, as onnxruntime converts them)
    as_objects = dtype == np.dtype(object) and isinstance(v, list)
    try:
        if as_objects:
            return np.array(v, dtype=object)
        return _row_major(np.asarray(v, dtype=dtype) if takes_type else np.asarray(v))
    except (OverflowError, ValueError, TypeError) as e:  # a RuntimeError, as onnxruntime's
        kind = "" if dtype is None else f" of {dtype}"
        raise InvalidFeedType(f"input {name!r}: could not create a tensor{kind} from the value given: "
                              f"{e}") from None


def check_onnxruntime_feed(name: str, v: Any) -> None:
    """Refuse what onnxruntime's ``InferenceSession.run`` refuses for a tensor input ``name``: anything but a
    numpy array or a list (the caller takes OrtValues): a Python or numpy scalar, a tuple, a str, a torch
    tensor, an object with ``__array__``, with onnxruntime's message (a ``RuntimeError`` there; here also the
    ``InvalidArgument``/``TypeError`` of other bad feeds). None is left to the usual check."""
    if v is None or isinstance(v, (np.ndarray, list)):
        return
    if hasattr(v, "__iter__"):
        raise InvalidFeedType(f"Input must be a list of dictionaries or a single numpy array for input "
                              f"{name!r} (got {type(v).__name__}; onnxruntime's run takes no other "
                              "sequence: pass np.asarray(value))")
    raise InvalidFeedType(f"Unable to handle object of type {type(v)} fed to input {name!r} (onnxruntime's "
                          "run takes a numpy array, a list or an OrtValue: pass np.asarray(value))")


def _row_major(a: np.ndarray) -> np.ndarray:
    """``a``, or a C-ordered copy of a strided or Fortran-ordered one, as onnxruntime copies such feeds:
    reductions and softmax then sum in one order whatever the feed's layout (their last bits followed it)."""
    return a if a.flags.c_contiguous else a.copy(order="C")


_INT64_RANGE = (-(2**63), 2**63 - 1)


def map_feed(name: str, v: Any, string_keys: bool, value_dtype: np.dtype | None, spelled: str) -> dict:
    """``v`` fed to input ``name`` of map type ``spelled`` ("map(string,tensor(float))"): a dict of str keys
    (``string_keys``) or int keys in int64's range (Python or numpy integers, bool too, as onnxruntime's
    binding takes them), whose values are of the tensor type ``value_dtype`` where known (any real number for
    a float one, integers for an integer one, str for strings), as a new dict of Python keys and the same
    values. Anything else is refused naming the input, as onnxruntime refuses a value of another type (an
    array, a dict of keys of the other type, a str value for a float map). An empty dict is taken: the
    spec's maps may be empty (onnxruntime's binding alone refuses one)."""
    if not isinstance(v, Mapping):
        raise InvalidFeedType(f"input {name!r}: expected a dict for {spelled}, got {type(v).__name__}")
    kind = None if value_dtype is None else value_dtype.kind
    takes = {"f": (numbers.Real, np.bool_), "i": (numbers.Integral, np.bool_), "O": (str,)}.get(kind or "")
    out: dict = {}
    for k, x in v.items():
        if string_keys and not isinstance(k, str) or not string_keys and not isinstance(k, numbers.Integral):
            raise InvalidFeedType(f"input {name!r}: {spelled} takes {'str' if string_keys else 'int'} keys, "
                                  f"got key {k!r} of type {type(k).__name__}")
        if not string_keys and not _INT64_RANGE[0] <= k <= _INT64_RANGE[1]:
            raise InvalidFeedType(f"input {name!r}: key {k} is out of int64's range")
        if takes is not None:
            x0 = x.item() if isinstance(x, np.ndarray) and x.ndim == 0 else x  # a 0-d array, as its number
            if not isinstance(x0, takes):
                raise InvalidFeedType(f"input {name!r}: {spelled} takes {_VALUES[kind]} as values, got "
                                      f"{x!r} of type {type(x).__name__} for key {k!r}")
            if kind == "i" and not _INT64_RANGE[0] <= x0 <= _INT64_RANGE[1]:
                raise InvalidFeedType(f"input {name!r}: the value {x0} of key {k!r} is out of int64's range")
        out[str(k) if string_keys else int(k)] = x
    return out


_VALUES = {"f": "real numbers", "i": "integers", "O": "str"}

__all__ = ["check_onnxruntime_feed", "feed_array", "map_feed"]


def empty_run(feeds: Mapping[str, Any]) -> bool:
    """Whether a training run is fed an empty tensor (a batch of no sample): such a run leaves BatchNorm's
    running statistics as they were, as torch's training-mode BatchNorm does (batch statistics of 0/0)."""
    return any(getattr(v, "size", 1) == 0 for v in feeds.values())
