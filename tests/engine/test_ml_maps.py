"""ai.onnx.ml DictVectorizer and CastMap (engine/kernels/ml_maps.py), fed a dict, against onnxruntime 1.32
where its Python API can feed the map (a dict of str or int keys, every value made a float: maps of float
values only, and no empty one), else against the spec's values computed here: string and int64 keys, float,
double, int64 and string values, keys outside the vocabulary, an empty dict, CastMap's three casts, two
forms and max_map; bad attributes and wrongly typed feeds refused by name; scikit-learn's DictVectorizer
and a pipeline of it as skl2onnx exports them (tests/data/sklearn_dict/, written by
tools/make_sklearn_dictvectorizer_fixture.py)."""

from __future__ import annotations

import math
import os
import platform
import re
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import AttributeProto, TensorProto, helper

import onnxtrain
from onnxtrain.engine import compile_model
from onnxtrain.errors import InvalidFeedType

ort = pytest.importorskip("onnxruntime")

_ML = "ai.onnx.ml"
_S, _I64, _F, _D = TensorProto.STRING, TensorProto.INT64, TensorProto.FLOAT, TensorProto.DOUBLE
_OUT = {"TO_FLOAT": _F, "TO_INT64": _I64, "TO_STRING": _S}
_INT64_MIN = -(2**63)
FIXTURES = os.path.join(os.path.dirname(__file__), "..", "data", "sklearn_dict")


def _model(node: onnx.NodeProto, key: int, value: int, out: int, check: bool = True) -> onnx.ModelProto:
    """One node reading the map input ``x`` (of ``key`` and ``value`` types) into the tensor ``y``."""
    values = helper.make_tensor_type_proto(value, None)
    x = helper.make_value_info("x", helper.make_map_type_proto(key, values))
    g = helper.make_graph([node], "g", [x], [helper.make_tensor_value_info("y", out, [1, None])])
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(_ML, 3)]
    m = helper.make_model(g, opset_imports=opsets, ir_version=10)
    if check:
        onnx.checker.check_model(m, full_check=True)
    return m


def _vectorizer(key: int, value: int, check: bool = True, **vocab: Any) -> onnx.ModelProto:
    node = helper.make_node("DictVectorizer", ["x"], ["y"], name="dv", domain=_ML)
    for name, items in vocab.items():  # (an empty list given its type: onnx cannot tell it)
        kind = AttributeProto.STRINGS if name == "string_vocabulary" else AttributeProto.INTS
        node.attribute.append(helper.make_attribute(name, items, attr_type=kind))
    return _model(node, key, value, value, check)


def _cast_map(value: int = _F, check: bool = True, **attrs: Any) -> onnx.ModelProto:
    node = helper.make_node("CastMap", ["x"], ["y"], name="cm", domain=_ML, **attrs)
    return _model(node, _I64, value, _OUT[attrs.get("cast_to", "TO_FLOAT")], check)


def _ort_session(m: onnx.ModelProto) -> Any:
    options = ort.SessionOptions()
    options.log_severity_level = 4  # (the refusals tested below log errors too)
    return ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _ort(m: onnx.ModelProto, feed: dict) -> np.ndarray:
    return _ort_session(m).run(None, {"x": feed})[0]


def _ours(m: onnx.ModelProto, feed: dict) -> np.ndarray:
    """The output of ``InferenceSession.run`` on ``{"x": feed}``, which the engine's plan run on the dict
    itself (no session's checks) gives alike."""
    got = onnxtrain.InferenceSession(m.SerializeToString()).run(None, {"x": feed})[0]
    plan = compile_model(m).run({"x": feed})[0]
    assert plan.dtype == got.dtype and plan.shape == got.shape
    np.testing.assert_array_equal(plan, got)
    return got


def _same(got: np.ndarray, want: np.ndarray) -> None:
    """The same dtype, shape and values (NaN where NaN, the signs of zeros and NaNs alike; strings as str)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got, want)
    if got.dtype == object:
        assert all(type(v) is str for v in got.ravel()) and got.tolist() == want.tolist()
    else:
        np.testing.assert_array_equal(got, want)
        if got.dtype.kind == "f":
            np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def _refused(m: onnx.ModelProto, feed: Any, message: str) -> None:
    """Running ``m`` on ``feed`` raises a ValueError from its node whose message begins with ``message``."""
    with pytest.raises(Exception) as caught:
        compile_model(m).run({"x": feed})
    cause = caught.value if isinstance(caught.value, ValueError) else caught.value.__cause__
    assert isinstance(cause, ValueError), caught.value
    assert re.match(re.escape(message), str(cause)), str(cause)


# ---------------------------------------------------------------- DictVectorizer


@pytest.mark.parametrize("feed", [
    {"a": 4.0, "c": 8.0},
    {"a": 4.0, "q": 1.0, "zz": -3.5},  # keys outside the vocabulary: left out
    {"b": 1, "z": True, "c": np.float32(2.5), "a": np.float64(1e300)},  # numbers of other types; float's inf
    {"a": float("nan"), "b": -0.0, "c": np.array(7.25)},  # NaN, a negative zero, a 0-d array
])
def test_string_keys_match_onnxruntime(feed: dict) -> None:
    """The spec's example vocabulary ["a", "c", "b", "z"] and a repeated entry: each place gets the value of
    its key, or 0."""
    m = _vectorizer(_S, _F, string_vocabulary=["a", "c", "b", "z", "a"])
    want = _ort(m, feed)
    assert want.shape == (1, 5)
    _same(_ours(m, feed), want)


@pytest.mark.parametrize("feed", [{1: 2.5, 7: 1.0}, {3: -1.0, 1: 0.5, -4: 9.0},
                                  {np.int64(3): 2.0, True: 6.0}])
def test_int64_keys_match_onnxruntime(feed: dict) -> None:
    m = _vectorizer(_I64, _F, int64_vocabulary=[3, 1, -4, 10])
    _same(_ours(m, feed), _ort(m, feed))


def test_an_empty_vocabulary_gives_no_column_as_onnxruntime() -> None:
    m = _vectorizer(_S, _F, string_vocabulary=[])
    want = _ort(m, {"a": 1.0})
    assert want.shape == (1, 0)
    _same(_ours(m, {"a": 1.0}), want)


@pytest.mark.parametrize("key, value, vocab, feed, want", [
    (_S, _D, {"string_vocabulary": ["a", "b", "c"]}, {"c": 0.1, "a": 1e300, "x": 2.0},
     np.array([[1e300, 0.0, 0.1]])),  # double values, not rounded to float
    (_I64, _D, {"int64_vocabulary": [5, 6]}, {6: np.float64(-2.25)}, np.array([[0.0, -2.25]])),
    (_S, _I64, {"string_vocabulary": ["n", "m"]}, {"m": 2**62 + 1, "n": -7}, np.array([[-7, 2**62 + 1]])),
    (_I64, _S, {"int64_vocabulary": [2, 9, 2]}, {2: "two", 3: "three"},
     np.array([["two", "", "two"]], dtype=object)),  # no value: the empty string
])
def test_other_value_types_as_the_spec_says(key: int, value: int, vocab: dict, feed: dict,
                                            want: np.ndarray) -> None:
    """Maps of double, int64 and string values, which onnxruntime has kernels for but its Python API
    cannot feed (it makes every dict a map of float values, refused by these kernels' type): the spec's
    values, each vocabulary entry's value of the map's type, else zero."""
    m = _vectorizer(key, value, **vocab)
    with pytest.raises(Exception, match="Unexpected (input data|value) type"):
        _ort(m, feed)
    _same(_ours(m, feed), want)


@pytest.mark.parametrize("key, vocab, zero", [
    (_S, {"string_vocabulary": ["a", "b"]}, np.zeros((1, 2), np.float32)),
    (_I64, {"int64_vocabulary": [4]}, np.zeros((1, 1), np.float32)),
])
def test_an_empty_dict_gives_zeros(key: int, vocab: dict, zero: np.ndarray) -> None:
    """The spec's maps may be empty (zeros throughout); onnxruntime's Python API alone refuses an empty
    dict."""
    m = _vectorizer(key, _F, **vocab)
    with pytest.raises(RuntimeError, match="Size of dictionary is empty"):
        _ort(m, {})
    _same(_ours(m, {}), zero)


@pytest.mark.parametrize("key, vocab, message, ort_runs", [
    (_S, {}, "give string_vocabulary or int64_vocabulary, one and not both", False),
    (_S, {"string_vocabulary": ["a"], "int64_vocabulary": [1]},
     "give string_vocabulary or int64_vocabulary, one and not both", True),
    (_S, {"int64_vocabulary": [1]}, "int64_vocabulary does not match the input's string keys", False),
    (_I64, {"string_vocabulary": ["1"]}, "string_vocabulary does not match the input's int64 keys", False),
])
def test_bad_vocabularies_are_refused_naming_the_node(key: int, vocab: dict, message: str,
                                                      ort_runs: bool) -> None:
    """The spec asks for one vocabulary, of the keys' type: onnxruntime refuses a node without the one of
    the keys' type, and takes that one where both are given (the spec's "one and only one" refused here)."""
    m = _vectorizer(key, _F, check=False, **vocab)
    feed = {"a": 1.0} if key == _S else {1: 1.0}
    if ort_runs:
        _ort(m, feed)
    else:
        with pytest.raises(Exception, match="vocabulary"):
            _ort_session(m)
    _refused(m, feed, f"DictVectorizer 'dv': {message}")


@pytest.mark.parametrize("key, value, feed, message", [
    (_S, _F, np.array([1.0], np.float32), "expected a dict for map(string,tensor(float)), got ndarray"),
    (_S, _F, [{"a": 1.0}], "expected a dict for map(string,tensor(float)), got list"),
    (_S, _F, {1: 2.0}, "map(string,tensor(float)) takes str keys, got key 1 of type int"),
    (_S, _F, {b"a": 2.0}, "map(string,tensor(float)) takes str keys, got key b'a' of type bytes"),
    (_I64, _F, {1.0: 2.0}, "map(int64,tensor(float)) takes int keys, got key 1.0 of type float"),
    (_I64, _F, {1: 2.0, "b": 1.0}, "map(int64,tensor(float)) takes int keys, got key 'b' of type str"),
    (_I64, _F, {2**70: 1.0}, "key 1180591620717411303424 is out of int64's range"),
    (_S, _F, {"a": "x"}, "map(string,tensor(float)) takes real numbers as values, got 'x' of type str for "
                         "key 'a'"),
    (_S, _F, {"a": None}, "map(string,tensor(float)) takes real numbers as values, got None of type NoneType "
                          "for key 'a'"),
    (_I64, _S, {1: 2.0}, "map(int64,tensor(string)) takes str as values, got 2.0 of type float for key 1"),
    (_S, _I64, {"a": 2.5}, "map(string,tensor(int64)) takes integers as values, got 2.5 of type float for "
                           "key 'a'"),
])
def test_wrongly_typed_feeds_are_refused_naming_the_input(key: int, value: int, feed: Any,
                                                          message: str) -> None:
    """A feed of another type than the input's map: refused naming the input (InvalidFeedType, an
    onnxruntime InvalidArgument), as onnxruntime refuses each of those it can be given."""
    m = _vectorizer(key, value, **({"string_vocabulary": ["a"]} if key == _S else {"int64_vocabulary": [1]}))
    if value == _F:
        with pytest.raises(Exception):  # noqa: B017 - onnxruntime's binding raises RuntimeError or its own
            _ort(m, feed)
    sess = onnxtrain.InferenceSession(m.SerializeToString())
    with pytest.raises(InvalidFeedType) as caught:
        sess.run(None, {"x": feed})
    assert str(caught.value) == f"input 'x': {message}"


@pytest.mark.parametrize("feed, message", [
    (np.array([1.0], np.float32), "the input must be a map (a dict), got ndarray"),
    ({1: 2.0}, "the map's keys must be str, got int 1"),
    ({"a": "1.5"}, "the map's values must be numbers, got str '1.5'"),
])
def test_the_plan_refuses_a_wrongly_typed_map_naming_the_node(feed: Any, message: str) -> None:
    """The engine's plan checks no feed: the kernel refuses what is no map of the node's keys, and a str
    value of a numeric map (numpy would read "1.5" as a number)."""
    _refused(_vectorizer(_S, _F, string_vocabulary=["a"]), feed, f"DictVectorizer 'dv': {message}")


def test_the_session_describes_a_map_input_as_onnxruntime() -> None:
    m = _vectorizer(_S, _D, string_vocabulary=["a"])
    ours, theirs = onnxtrain.InferenceSession(m.SerializeToString()), _ort_session(m)
    for ask in ("get_inputs", "get_outputs"):
        assert [(a.name, a.type, a.shape) for a in getattr(ours, ask)()] == \
            [(a.name, a.type, a.shape) for a in getattr(theirs, ask)()]
    assert ours.get_inputs()[0].type == "map(string,tensor(double))"


# ---------------------------------------------------------------- CastMap

_FORMS = [{"map_form": "DENSE"}, {"map_form": "SPARSE", "max_map": 6}, {"map_form": "SPARSE"}]
_FLOAT_FEEDS = [
    {5: 1.5, 0: -2.7, 3: 1e10},
    {7: 1.0, 1: 2.0},  # (SPARSE: a key past max_map - 1 left out, as onnxruntime does)
    {4: 1e-7, 2: -0.0, 1: 123456789.0, 0: 0.1, 5: 3.0e38},
    {2: float("nan"), 3: float("-nan"), 0: float("inf"), 1: float("-inf")},
]


@pytest.mark.parametrize("cast_to", ["TO_FLOAT", "TO_INT64", "TO_STRING"])
@pytest.mark.parametrize("form", _FORMS, ids=["dense", "sparse6", "sparse1"])
@pytest.mark.parametrize("feed", _FLOAT_FEEDS, ids=["mixed", "past_max", "values", "nonfinite"])
def test_float_maps_match_onnxruntime(cast_to: str, form: dict, feed: dict) -> None:
    """Values in ascending key order (DENSE) or at their keys' places padded with 0 / "0.f" (SPARSE), cast
    from float32: floats written as C's %f writes them ("-nan" too), int64 by truncation."""
    m = _cast_map(cast_to=cast_to, **form)
    got = _ours(m, feed)
    if cast_to == "TO_INT64" and any(math.isinf(v) or math.isnan(v) for v in feed.values()):
        # C leaves the conversion undefined: onnxruntime gives int64's minimum on x86-64, as the engine does
        # on every machine
        if form["map_form"] == "SPARSE":  # (keys 0 to 3)
            max_map = form.get("max_map", 1)
            want = np.array([[_INT64_MIN] * min(4, max_map) + [0] * max(0, max_map - 4)])
        else:
            want = np.full((1, 4), _INT64_MIN)
        _same(got, want)
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return
    _same(got, _ort(m, feed))


@pytest.mark.parametrize("cast_to", ["TO_FLOAT", "TO_INT64", "TO_STRING"])
def test_negative_keys_are_dense_only(cast_to: str) -> None:
    """DENSE takes any key, in ascending order; SPARSE refuses a negative one, as onnxruntime does."""
    feed = {-1: 2.0, 2: 3.5, -9: 4.0}
    dense = _cast_map(cast_to=cast_to)
    _same(_ours(dense, feed), _ort(dense, feed))
    sparse = _cast_map(cast_to=cast_to, map_form="SPARSE", max_map=4)
    with pytest.raises(Exception, match="Negative index values are not permitted"):
        _ort(sparse, feed)
    _refused(sparse, feed, "CastMap 'cm': a SPARSE map's keys must not be negative, got -9")


@pytest.mark.parametrize("cast_to, pad", [("TO_FLOAT", np.float32(0)), ("TO_INT64", np.int64(0)),
                                          ("TO_STRING", "0.f")])
def test_an_empty_dict(cast_to: str, pad: Any) -> None:
    """No value: DENSE gives [1, 0], SPARSE max_map pads (onnxruntime's Python API refuses an empty dict)."""
    dense, sparse = _cast_map(cast_to=cast_to), _cast_map(cast_to=cast_to, map_form="SPARSE", max_map=3)
    with pytest.raises(RuntimeError, match="Size of dictionary is empty"):
        _ort(dense, {})
    dtype = object if cast_to == "TO_STRING" else type(pad)
    _same(_ours(dense, {}), np.empty((1, 0), dtype))
    _same(_ours(sparse, {}), np.array([[pad] * 3], dtype))


# the strings' values as glibc's std::stof and std::stoll read them (the number at the start, after white
# space), which onnxruntime's CastMap calls; onnxruntime's Python API cannot feed a map of strings
_STRINGS = {0: " 3.5abc", 1: "1e", 2: "0x1p3", 3: "-Infinity", 4: "\t\n+.5e-1x", 5: "-0", 6: "3,5", 7: "12"}
_AS_FLOATS = [3.5, 1.0, 8.0, -math.inf, 0.05, -0.0, 3.0, 12.0]
_INT_STRINGS = {0: " 12abc", 1: "3.7", 2: "-0x10", 3: "+5", 4: "9223372036854775807",
                5: "-9223372036854775808"}
_AS_INTS = [12, 3, 0, 5, 2**63 - 1, -(2**63)]


def test_string_maps_to_floats_as_strtof_reads_them() -> None:
    got = _ours(_cast_map(_S, cast_to="TO_FLOAT"), _STRINGS)
    _same(got, np.array([_AS_FLOATS], np.float32))
    nan = _ours(_cast_map(_S, cast_to="TO_FLOAT"), {0: "nan(12)", 1: "-NAN"})
    assert np.isnan(nan).all() and np.signbit(nan).tolist() == [[False, True]]


def test_string_maps_to_int64_as_strtoll_reads_them() -> None:
    _same(_ours(_cast_map(_S, cast_to="TO_INT64"), _INT_STRINGS), np.array([_AS_INTS], np.int64))


def test_string_maps_to_strings_and_sparse_padding() -> None:
    feed = {3: "c", 0: "a", 9: "past"}
    _same(_ours(_cast_map(_S, cast_to="TO_STRING"), feed), np.array([["a", "c", "past"]], dtype=object))
    got = _ours(_cast_map(_S, cast_to="TO_STRING", map_form="SPARSE", max_map=4), feed)
    _same(got, np.array([["a", "0.f", "0.f", "c"]], dtype=object))
    got = _ours(_cast_map(_S, cast_to="TO_INT64", map_form="SPARSE", max_map=3), {2: "7"})
    _same(got, np.array([[0, 0, 7]], np.int64))


@pytest.mark.parametrize("cast_to, text, why", [
    ("TO_FLOAT", "abc", "does not begin with a number"),
    ("TO_FLOAT", "", "does not begin with a number"),
    ("TO_FLOAT", "1e39", "is out of float's range"),
    ("TO_FLOAT", "3.4028236e38", "is out of float's range"),  # rounds to infinity
    ("TO_FLOAT", "1e-39", "is out of float's range"),  # below the least normal float, not exact
    ("TO_FLOAT", "1.17549430e-38", "is out of float's range"),  # rounds to it, but tiny at float's precision
    ("TO_INT64", "x1", "does not begin with an integer"),
    ("TO_INT64", " - 3", "does not begin with an integer"),
    ("TO_INT64", "9223372036854775808", "is out of int64's range"),
])
def test_unreadable_strings_are_refused_naming_the_node(cast_to: str, text: str, why: str) -> None:
    """Where std::stof and std::stoll throw (no number, or one beyond the type's range)."""
    _refused(_cast_map(_S, cast_to=cast_to), {4: text}, f"CastMap 'cm': the value {text!r} of key 4 {why}")


def test_exact_tiny_floats_are_read() -> None:
    """A subnormal float that a string gives exactly is read, as strtof reads it (no range error)."""
    got = _ours(_cast_map(_S), {0: "0x1p-149", 1: "1.17549435e-38", 2: "0e-400"})
    _same(got, np.array([[2.0**-149, np.finfo(np.float32).tiny, 0.0]], np.float32))
    # ("1.17549435e-38", a little under the least normal float, rounds to it: not tiny, as in glibc)


@pytest.mark.parametrize("attrs, message", [
    ({"cast_to": "TO_DOUBLE"}, "cast_to must be one of TO_FLOAT, TO_STRING, TO_INT64, got 'TO_DOUBLE'"),
    ({"map_form": "PACKED"}, "map_form must be DENSE or SPARSE, got 'PACKED'"),
    ({"map_form": "SPARSE", "max_map": 0}, "max_map must be positive with map_form SPARSE, got 0"),
    ({"map_form": "SPARSE", "max_map": -2}, "max_map must be positive with map_form SPARSE, got -2"),
])
def test_bad_attributes_are_refused_naming_the_node(attrs: dict, message: str) -> None:
    """As onnxruntime refuses them when it makes the session."""
    node = helper.make_node("CastMap", ["x"], ["y"], name="cm", domain=_ML, **attrs)
    m = _model(node, _I64, _F, _F, check=False)
    with pytest.raises(Exception, match="CAST_TO|PACK_MAP|max_map"):
        _ort_session(m)
    _refused(m, {1: 2.0}, f"CastMap 'cm': {message}")


def test_dense_ignores_max_map() -> None:
    m = _cast_map(map_form="DENSE", max_map=0, check=False)
    _same(_ours(m, {4: 1.0, 2: 3.0}), _ort(m, {4: 1.0, 2: 3.0}))


def test_a_wrongly_typed_map_is_refused() -> None:
    """A float map given strings, a string map given floats, a string key: refused naming the input by the
    session, the node by the plan."""
    sess = onnxtrain.InferenceSession(_cast_map().SerializeToString())
    with pytest.raises(InvalidFeedType, match=r"input 'x': map\(int64,tensor\(float\)\) takes real numbers"):
        sess.run(None, {"x": {1: "2.0"}})
    with pytest.raises(InvalidFeedType, match=r"input 'x': map\(int64,tensor\(float\)\) takes int keys"):
        sess.run(None, {"x": {"1": 2.0}})
    _refused(_cast_map(), {1: "2.0"}, "CastMap 'cm': the map's values must be numbers, got str '2.0'")
    _refused(_cast_map(_S), {1: 2.0}, "CastMap 'cm': the map's values must be str, got float 2.0")
    _refused(_cast_map(), {"1": 2.0}, "CastMap 'cm': the map's keys must be int64, got str '1'")


# ---------------------------------------------------------------- scikit-learn's exports

_SKLEARN_FEEDS = [
    {"red": 1.0, "size": 2.0},
    {"blue": 1.0, "age": 3.0, "unknown": 7.0},
    {"green": 1.0, "weight": 0.5, "size": 1.5, "age": 0.25},
    {"size": 10.0},
]


def test_sklearn_exports_match_onnxruntime() -> None:
    """scikit-learn's DictVectorizer(sparse=False), alone and before a LogisticRegression of three classes
    (its probabilities through ZipMap), as skl2onnx exports them for a map(string, tensor(float)) input."""
    names = sorted(f for f in os.listdir(FIXTURES) if f.endswith(".onnx")) if os.path.isdir(FIXTURES) else []
    assert names == ["dict_logreg_3c.onnx", "dict_vectorizer.onnx"], \
        "run tools/make_sklearn_dictvectorizer_fixture.py"
    for name in names:
        model = onnx.load(os.path.join(FIXTURES, name))
        assert model.graph.node[0].op_type == "DictVectorizer"
        ours = onnxtrain.InferenceSession(model.SerializeToString())
        theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        for feed in _SKLEARN_FEEDS:
            got, want = ours.run(None, {"X": feed}), theirs.run(None, {"X": feed})
            _same(got[0], want[0])  # the vectorized row, or the labels
            if len(want) > 1:  # ZipMap's dicts: the same keys, the probabilities to float32's rounding
                assert [list(d) for d in got[1]] == [list(d) for d in want[1]]
                np.testing.assert_allclose([list(d.values()) for d in got[1]],
                                           [list(d.values()) for d in want[1]], rtol=1e-6, atol=1e-7)
