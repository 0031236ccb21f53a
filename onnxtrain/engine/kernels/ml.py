"""Kernels of the ``ai.onnx.ml`` domain: LabelEncoder (versions 1, 2 and 4), Binarizer and
ArrayFeatureExtractor (inference only: none has a gradient).

A string tensor is a numpy object array of ``str``, as in :mod:`onnxtrain.engine.kernels.text`. Where
onnx's reference implementation and onnxruntime differ, these follow the spec and onnxruntime: from
LabelEncoder's version 4 a float key that is NaN matches every NaN input (before, none, as in onnxruntime),
and a vector given to ArrayFeatureExtractor comes back as one row. Of repeated LabelEncoder keys the last
one's value is taken, as the spec says and onnx's reference does (onnxruntime takes the first). Binarizer
maps NaN to 0, as onnx's reference does (onnxruntime refuses NaN inputs).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxtrain.engine.kernels.text import _object_array, _strings
from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel

ML = "ai.onnx.ml"
_KEY_KINDS = ("floats", "int64s", "strings")


def _mapping(attrs: Attrs) -> tuple[list[Any], list[Any], Any, Any]:
    """(keys, values, the default value, the output's dtype) of a LabelEncoder node, whichever of its
    versions' attributes it has."""
    keys = next((attrs[f"keys_{k}"] for k in _KEY_KINDS if attrs.get(f"keys_{k}") is not None), None)
    if keys is None and attrs.get("keys_tensor") is not None:
        keys = list(np.asarray(attrs["keys_tensor"]).reshape(-1))
    kind = next((k for k in _KEY_KINDS if attrs.get(f"values_{k}") is not None), None)
    if kind is not None:
        values = list(attrs[f"values_{kind}"])
        dtype = {"floats": np.float32, "int64s": np.int64, "strings": object}[kind]
        default = attrs.get({"floats": "default_float", "int64s": "default_int64",
                             "strings": "default_string"}[kind])
        if default is None:
            default = {"floats": -0.0, "int64s": -1, "strings": "_Unused"}[kind]
    elif attrs.get("values_tensor") is not None:
        t = np.asarray(attrs["values_tensor"])
        values, dtype = list(t.reshape(-1)), (object if t.dtype.kind in "OUS" else t.dtype)
        d = attrs.get("default_tensor")
        if d is not None:
            default = np.asarray(d).reshape(-1)[0]
        else:  # the spec's defaults by the values' type
            default = "_Unused" if dtype is object else (-1 if np.dtype(dtype).kind in "iub" else -0.0)
    else:
        raise ValueError(f"LabelEncoder {attrs.name!r}: no values_* attribute")
    if keys is None:
        raise ValueError(f"LabelEncoder {attrs.name!r}: no keys_* attribute")
    if len(keys) != len(values):
        raise ValueError(f"LabelEncoder {attrs.name!r}: {len(keys)} keys for {len(values)} values")
    if isinstance(default, bytes):
        default = default.decode("utf-8")
    values = [v.decode("utf-8") if isinstance(v, bytes) else v for v in values]
    keys = [k.decode("utf-8") if isinstance(k, bytes) else k for k in keys]
    return keys, values, default, dtype


def _encode_numbers(x: np.ndarray, keys: list[Any], values: list[Any], default: Any, dtype: Any,
                    nan_matches: bool) -> np.ndarray:
    """Each element of numeric ``x`` mapped through keys → values (the last of repeated keys wins; with
    ``nan_matches`` a NaN key matches every NaN), else ``default``."""
    table = dict(zip(np.asarray(keys, dtype=x.dtype).tolist(), range(len(keys))))  # key → its last index
    nan_at = max((i for k, i in table.items() if isinstance(k, float) and k != k), default=None)
    found = [(k, i) for k, i in table.items() if not (isinstance(k, float) and k != k)]
    vals = np.asarray(values, dtype=dtype)
    out = np.full(x.shape, default, dtype=dtype)
    if found:
        ks = np.asarray([k for k, _ in found], dtype=x.dtype)
        order = np.argsort(ks, kind="stable")
        ks, idx = ks[order], np.asarray([i for _, i in found], np.int64)[order]
        pos = np.minimum(np.searchsorted(ks, x), len(ks) - 1)
        hit = ks[pos] == x
        out[hit] = vals[idx[pos[hit]]]
    if nan_at is not None and nan_matches and x.dtype.kind == "f":
        out[np.isnan(x)] = vals[nan_at]
    return out


def _label_encoder_v1(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    """Version 1: strings to their index in ``classes_strings`` (else ``default_int64``), or integers to
    the string at that index (else ``default_string``)."""
    classes = [c.decode("utf-8") if isinstance(c, bytes) else c for c in attrs["classes_strings"]]
    if x.dtype.kind in "OUS":
        index = {c: i for i, c in enumerate(classes)}
        default = attrs.get("default_int64")
        default = -1 if default is None else default
        return np.asarray([index.get(s, default) for s in _strings(x, "LabelEncoder").flat],
                          np.int64).reshape(x.shape)
    default = attrs.get("default_string")
    default = "_Unused" if default is None else default
    default = default.decode("utf-8") if isinstance(default, bytes) else default
    n = len(classes)
    return _object_array([classes[i] if 0 <= i < n else default for i in x.reshape(-1).tolist()], x.shape)


@kernel("LabelEncoder", domain=ML)
def label_encoder(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = np.asarray(inputs[0])
    if attrs.get("classes_strings") is not None:
        return (_label_encoder_v1(x, attrs),)
    keys, values, default, dtype = _mapping(attrs)
    if x.dtype.kind in "OUS":
        table = dict(zip(keys, values))
        items = [table.get(s, default) for s in _strings(x, "LabelEncoder").flat]
        if dtype is object:
            return (_object_array(items, x.shape),)
        return (np.asarray(items, dtype=dtype).reshape(x.shape),)
    nan_matches = attrs.opset >= 4  # the spec says so from version 4 (onnxruntime: NaN matched no key before)
    if dtype is object:
        table = dict(zip(np.asarray(keys, dtype=x.dtype).tolist(), values))
        nans = [v for k, v in table.items() if isinstance(k, float) and k != k]
        nan = nans[-1] if nans and nan_matches else None
        items = [nan if nan is not None and v != v else table.get(v, default) for v in x.reshape(-1).tolist()]
        return (_object_array(items, x.shape),)
    return (_encode_numbers(x, keys, values, default, dtype, nan_matches),)


@kernel("Binarizer", domain=ML)
def binarizer(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = np.asarray(inputs[0])
    threshold = attrs.get("threshold")
    return ((x > (0.0 if threshold is None else threshold)).astype(x.dtype),)


@kernel("ArrayFeatureExtractor", domain=ML)
def array_feature_extractor(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, indices = np.asarray(inputs[0]), np.asarray(inputs[1]).reshape(-1)
    last = x.shape[-1] if x.ndim else 0
    bad = indices[(indices < 0) | (indices >= last)]
    if bad.size:
        raise ValueError(f"ArrayFeatureExtractor {attrs.name!r}: index {int(bad[0])} is out of range for the "
                         f"last axis of size {last}")
    out = np.take(x, indices, axis=-1)
    return (out.reshape(1, -1) if x.ndim == 1 else out,)
