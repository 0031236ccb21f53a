"""``ai.onnx.ml`` DictVectorizer and CastMap (inference only): the two ops that take a map (a Python dict, as
onnxruntime's Python API feeds one) and make a tensor of its values.

DictVectorizer writes, for each entry of its vocabulary (``string_vocabulary`` or ``int64_vocabulary``, the
one of the map's key type), the map's value of that key, or zero ("" for strings) where the map has none;
keys outside the vocabulary are left out, and a repeated vocabulary entry gets its value at each place. The
output is the map's value type, shaped [1, V] as onnxruntime gives it (the spec says "1-D"); the schema
takes one map, not a sequence of them.

CastMap writes the values of a map of int64 keys in ascending key order, cast to float, int64 or string
(``cast_to``): all of them (``map_form`` DENSE, [1, entries]), or each at the place its key names in a [1,
``max_map``] row (SPARSE), the others padded. As onnxruntime: a SPARSE map's keys past ``max_map`` - 1 are
left out (the spec forbids them), a negative key is refused, the padding is 0, or "0.f" for strings; a
float is written as C's ``%f`` writes it ("2.500000", "-nan"), made an int64 by truncation (NaN, infinities
and floats beyond int64's range give its minimum, as on x86-64); a string is read as C's ``strtof`` and
``strtoll`` read one (the number at its start, after white space; none, or one out of range, refused).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from decimal import Decimal
from numbers import Integral
from typing import Any

import numpy as np

from onnxtrain.engine.kernels.ml import ML
from onnxtrain.engine.kernels.ml_linear import _text
from onnxtrain.engine.kernels.text import _object_array
from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel

_DTYPES: dict[str, Any] = {"float": np.float32, "double": np.float64, "int64": np.int64, "string": object}
_MAP_TYPE = re.compile(r"map\((\w+),\s*tensor\((\w+)\)\)")
_INT64_MIN = np.iinfo(np.int64).min


def _declared_map(attrs: Attrs) -> tuple[str, str] | None:
    """(key type, value type) of the node's map input as the graph declares it ("string", "double"), or None
    when not declared."""
    t = attrs.input_types[0] if attrs.input_types else None
    m = _MAP_TYPE.fullmatch(t.replace(" ", "")) if t else None
    return (m.group(1), m.group(2)) if m else None


def _checked_map(x: Any, string_keys: bool, op: str) -> Mapping:
    """``x``, a map of str keys (``string_keys``) or integer ones; refused otherwise."""
    if not isinstance(x, Mapping):
        raise ValueError(f"{op}: the input must be a map (a dict), got {type(x).__name__}")
    kind = str if string_keys else Integral
    bad = next((k for k in x if not isinstance(k, kind)), None)
    if bad is not None:
        raise ValueError(f"{op}: the map's keys must be {'str' if string_keys else 'int64'}, got "
                         f"{type(bad).__name__} {bad!r}")
    return x


def _check_values(values: list[Any], strings: bool, op: str) -> None:
    """Refuse values of a map that are not str (``strings``), or not numbers (a str is not read as one)."""
    for v in values:
        if isinstance(v, str) != strings or isinstance(v, bytes):
            raise ValueError(f"{op}: the map's values must be {'str' if strings else 'numbers'}, got "
                             f"{type(v).__name__} {v!r}")


# ---------------------------------------------------------------- DictVectorizer


def _vocabulary(attrs: Attrs, op: str) -> tuple[list[str] | list[int], bool]:
    """The node's vocabulary and whether it is of strings: exactly one of its two attributes (an empty one
    counts as given, as onnxruntime takes it), of the map's key type where the graph declares it."""
    strings, ints = attrs.get("string_vocabulary"), attrs.get("int64_vocabulary")
    if (strings is None) == (ints is None):
        raise ValueError(f"{op}: give string_vocabulary or int64_vocabulary, one and not both")
    declared = _declared_map(attrs)
    if declared is not None and declared[0] != ("string" if strings is not None else "int64"):
        given = "string_vocabulary" if strings is not None else "int64_vocabulary"
        raise ValueError(f"{op}: {given} does not match the input's {declared[0]} keys")
    return ([_text(s) for s in strings], True) if strings is not None else ([int(i) for i in ints], False)


@kernel("DictVectorizer", domain=ML)
def dict_vectorizer(inputs: Inputs, attrs: Attrs) -> Outputs:
    op = f"DictVectorizer {attrs.name!r}"
    vocabulary, strings = attrs.cached("vocabulary", lambda: _vocabulary(attrs, op))
    x = _checked_map(inputs[0], strings, op)
    declared = _declared_map(attrs)
    if declared is None or declared[1] not in _DTYPES:
        raise ValueError(f"{op}: the input's map type must be declared, with float, double, int64 or string "
                         f"values; got {attrs.input_types[0] if attrs.input_types else None}")
    dtype = _DTYPES[declared[1]]
    values = [x.get(k, "" if dtype is object else 0) for k in vocabulary]
    _check_values(values, dtype is object, op)
    if dtype is object:
        return (_object_array(values, (1, len(values))),)
    return (np.asarray(values, dtype=dtype).reshape(1, len(values)),)


# ---------------------------------------------------------------- CastMap

_CASTS = ("TO_FLOAT", "TO_STRING", "TO_INT64")
_FORMS = ("DENSE", "SPARSE")
_PADS: dict[str, Any] = {"TO_FLOAT": 0.0, "TO_INT64": 0, "TO_STRING": "0.f"}  # onnxruntime's padding

# what C's strtof and strtoll read at the start of a string (after white space); the hexadecimal form first
_C_SPACE = " \t\n\v\f\r"
_FLOAT_START = re.compile(
    r"[+-]?(?:0x(?:[0-9a-f]+\.?[0-9a-f]*|\.[0-9a-f]+)(?:p[+-]?\d+)?"
    r"|(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?|inf(?:inity)?|nan(?:\(\w*\))?)", re.IGNORECASE | re.ASCII)
_INT_START = re.compile(r"[+-]?[0-9]+")
# below this a float32 is tiny (glibc's strtof tells an inexact one by its value rounded to float's
# precision, the exponent unbounded: under the least normal float, less half the spacing below it)
_TINY = Decimal(2.0**-126 - 2.0**-151)  # (exact)


def _cast_map_form(attrs: Attrs, op: str) -> tuple[str, str, int]:
    """(cast_to, map_form, max_map) of the node, checked as onnxruntime checks them."""
    cast_to, form, max_map = _text(attrs["cast_to"]), _text(attrs["map_form"]), int(attrs["max_map"])
    if cast_to not in _CASTS:
        raise ValueError(f"{op}: cast_to must be one of {', '.join(_CASTS)}, got {cast_to!r}")
    if form not in _FORMS:
        raise ValueError(f"{op}: map_form must be DENSE or SPARSE, got {form!r}")
    if form == "SPARSE" and max_map <= 0:
        raise ValueError(f"{op}: max_map must be positive with map_form SPARSE, got {max_map}")
    return cast_to, form, max_map


def _strtof(s: str, key: int, op: str) -> float:
    """The float32 C's ``strtof`` reads at the start of ``s``; refused where it reads none, or one beyond
    float's range (overflowing, or tiny and not exact), as ``std::stof`` throws then."""
    m = _FLOAT_START.match(s.lstrip(_C_SPACE))
    if m is None:
        raise ValueError(f"{op}: the value {s!r} of key {key} does not begin with a number")
    text = m.group(0)
    sign, body = (-1.0 if text[0] == "-" else 1.0), text.lstrip("+-").lower()
    if body.startswith(("nan", "inf")):
        return math.copysign(math.nan if body[0] == "n" else math.inf, sign)
    hexadecimal = body.startswith("0x")
    digits = body[2:].partition("p")[0] if hexadecimal else body.partition("e")[0]
    if not digits.strip("0."):  # a zero, of its sign
        return math.copysign(0.0, sign)
    try:
        wide = sign * float.fromhex(body) if hexadecimal else float(text)  # (rounded to a double)
    except OverflowError:
        wide = math.inf
    with np.errstate(over="ignore"):
        value = float(np.float32(wide))
    if abs(wide) < 2.0**-125:  # tiny, where not exact, or no double at all (exact decimals compared)
        exact = Decimal(wide) if hexadecimal else Decimal(text)
        if not wide or abs(exact) < _TINY and Decimal(value) != exact:
            value = math.inf
    if math.isinf(value):
        raise ValueError(f"{op}: the value {s!r} of key {key} is out of float's range")
    return value


def _strtoll(s: str, key: int, op: str) -> int:
    """The int64 C's ``strtoll`` reads (in base 10) at the start of ``s``; refused where it reads none or
    one beyond int64's range, as ``std::stoll`` throws then."""
    m = _INT_START.match(s.lstrip(_C_SPACE))
    if m is None:
        raise ValueError(f"{op}: the value {s!r} of key {key} does not begin with an integer")
    n = int(m.group(0)) if len(m.group(0).lstrip("+-").lstrip("0")) <= 19 else 2**63
    if not -(2**63) <= n < 2**63:
        raise ValueError(f"{op}: the value {s!r} of key {key} is out of int64's range")
    return n


def _c_float_text(v: float) -> str:
    """A float32 as C's ``%f`` (``std::to_string``) writes it: six decimals, "nan" or "-nan", "inf"."""
    if math.isnan(v):
        return "-nan" if math.copysign(1.0, v) < 0 else "nan"
    return f"{v:f}"


def _truncated(v: np.ndarray) -> np.ndarray:
    """float32 values made int64 by truncation toward zero; NaN, infinities and values beyond int64's range
    give its minimum, as x86-64's conversion does (C leaves them undefined)."""
    wide = v.astype(np.float64)
    fits = np.isfinite(wide) & (wide >= -(2.0**63)) & (wide < 2.0**63)
    out = np.full(v.shape, _INT64_MIN, np.int64)
    out[fits] = np.trunc(wide[fits]).astype(np.int64)
    return out


def _cast_values(values: list[Any], strings: bool, cast_to: str, keys: list[int], op: str) -> list[Any]:
    """The map's ``values`` (str when ``strings``, else numbers held as float32) cast as ``cast_to`` says,
    as Python values."""
    if strings:
        if cast_to == "TO_STRING":
            return list(values)
        read = _strtof if cast_to == "TO_FLOAT" else _strtoll
        return [read(v, k, op) for v, k in zip(values, keys)]
    floats = np.asarray(values, np.float32).reshape(-1)
    if cast_to == "TO_FLOAT":
        return floats.tolist()
    if cast_to == "TO_INT64":
        return _truncated(floats).tolist()
    return [_c_float_text(v) for v in floats.tolist()]


@kernel("CastMap", domain=ML)
def cast_map(inputs: Inputs, attrs: Attrs) -> Outputs:
    op = f"CastMap {attrs.name!r}"
    cast_to, form, max_map = attrs.cached("form", lambda: _cast_map_form(attrs, op))
    x = _checked_map(inputs[0], False, op)
    keys = sorted(x)
    declared = _declared_map(attrs)
    if declared is not None:
        strings = declared[1] == "string"
    else:  # (no declaration: the values say)
        strings = bool(keys) and all(isinstance(v, str) for v in x.values())
    if form == "SPARSE":
        if keys and keys[0] < 0:
            raise ValueError(f"{op}: a SPARSE map's keys must not be negative, got {keys[0]}")
        keys = [k for k in keys if k < max_map]
    values = [x[k] for k in keys]
    _check_values(values, strings, op)
    values = _cast_values(values, strings, cast_to, keys, op)
    if form == "SPARSE":
        row = [_PADS[cast_to]] * max_map
        for k, v in zip(keys, values):
            row[k] = v
        values = row
    shape = (1, len(values))
    if cast_to == "TO_STRING":
        return (_object_array(values, shape),)
    return (np.asarray(values, np.float32 if cast_to == "TO_FLOAT" else np.int64).reshape(shape),)
