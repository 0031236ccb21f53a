"""com.microsoft Tokenizer against onnxruntime's contrib kernel (its RE2, leftmost-longest), and
scikit-learn's CountVectorizer / TfidfVectorizer as skl2onnx exports them (StringNormalizer, Tokenizer,
TfIdfVectorizer).

The hand-built graphs compare outputs exactly (dtype, shape, every string). The scikit-learn fixtures are
written by ``tools/make_sklearn_text_fixtures.py`` (scikit-learn and skl2onnx are not needed here).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnxtrain
from onnxtrain.engine import compile_model
from onnxtrain.engine.plan import EngineError

OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
BASE = {"mark": 0, "pad_value": "#", "mincharnum": 1}


def _model(x: np.ndarray, attrs: dict[str, Any], name: str = "tok") -> onnx.ModelProto:
    node = helper.make_node("Tokenizer", ["X"], ["Y"], domain="com.microsoft", name=name, **attrs)
    rank = x.ndim + (x.size > 0)
    g = helper.make_graph(
        [node], "tokenizer", [helper.make_tensor_value_info("X", TensorProto.STRING, list(x.shape))],
        [helper.make_tensor_value_info("Y", TensorProto.STRING, [f"d{i}" for i in range(rank)])])
    m = helper.make_model(g, opset_imports=OPSETS, ir_version=8)
    onnx.checker.check_model(m, full_check=True)
    return m


def _ort(m: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"X": x})[0]


def _ours(m: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return compile_model(m).run({"X": x})[0]


def _s(*v: Any) -> np.ndarray:
    return np.array(v, dtype=object)


def _check(x: np.ndarray, attrs: dict[str, Any]) -> np.ndarray:
    m = _model(x, attrs)
    got, want = _ours(m, x), _ort(m, x)
    assert got.dtype == object and want.dtype == object
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.tolist() == want.tolist()
    assert all(type(v) is str for v in got.flat)
    return got


def _refused(x: np.ndarray, attrs: dict[str, Any], msg: str, name: str = "tok") -> str:
    """Our error for the node: an EngineError caused by a ValueError that starts by naming the node."""
    with pytest.raises(EngineError) as e:
        _ours(_model(x, attrs, name), x)
    cause = e.value.__cause__
    assert isinstance(cause, ValueError), e.value
    assert str(cause).startswith(f"Tokenizer {name!r}: "), cause
    assert msg in str(cause), cause
    return str(cause)


_TEXT = _s("Hello World", "I love computer science !", "one,two;;three  four", "", "déjà vu, 中文 ok")


# ---------------------------------------------------------------- separators


@pytest.mark.parametrize("seps", [
    [" "],
    [" ", ",", ";"],
    [";", ","],  # a piece keeps the spaces the later separators do not cut
    [r"[,;]+", r"\s+"],
    [r"\s*[,;]\s*|\s+"],
    [r"o"],
    [r"\b"],  # a match of no characters drops the character after it
    [r"x*"],  # matches nothing everywhere: every character dropped
    [r"(?m)$"],
    ["", " "],  # an empty separator among others: also matches nothing everywhere
    [r"\d+", r"(?i)O"],
], ids=["space", "three", "order", "classes", "alternation", "letter", "boundary", "empty_match", "line_end",
        "empty_among_others", "flags"])
@pytest.mark.parametrize("mark", [0, 1])
def test_separators_match_onnxruntime(seps: list[str], mark: int) -> None:
    _check(_TEXT, {**BASE, "mark": mark, "separators": seps})


def test_separators_match_leftmost_longest() -> None:
    """RE2's longest_match: of the alternatives matching at the leftmost place, the longest cuts."""
    x = _s("xaby", "xabx", "aab")
    y = _check(x, {**BASE, "separators": ["a|ab|aby"]})
    assert y.tolist() == [["x", "#"], ["x", "x"], ["#", "#"]]  # "aab": "a" then "ab", nothing between
    _check(x, {**BASE, "separators": ["a+?"]})  # lazy: still the longest
    _check(_s("ababcd", "abababcd x"), {**BASE, "separators": ["(ab)*(abcd)*"]})


def test_empty_match_inside_a_multibyte_character() -> None:
    """RE2 searches bytes: \\B matches between two bytes of "中" after a letter, and onnxruntime fails on the
    piece it cuts there (not UTF-8); we search code points, where \\B next matches at the end."""
    x = _s("a中")
    m = _model(x, {**BASE, "separators": [r"\B"]})
    with pytest.raises(Exception, match="invalid utf8"):
        _ort(m, x)
    assert _ours(m, x).tolist() == [["a中"]]


def test_empty_separator_splits_into_characters() -> None:
    y = _check(_s("abc", "", "中é\nz"), {**BASE, "mark": 1, "separators": [""], "pad_value": "<pad>"})
    assert y.tolist()[1] == ["\x02", "\x03", "<pad>", "<pad>", "<pad>", "<pad>"]


@pytest.mark.parametrize("least", [1, 2, 3, 5])
def test_mincharnum_drops_short_pieces(least: int) -> None:
    x = _s("a bb ccc dddd", "x,yy,,zzz", "é中 中中中")
    _check(x, {**BASE, "mincharnum": least, "separators": [" ", ","]})


# ---------------------------------------------------------------- tokenexp


@pytest.mark.parametrize("exp", [
    r"\b\w\w+\b",  # scikit-learn's default token pattern, as RE2 reads it (ASCII \w)
    r"[a-zA-Z0-9_]+",  # what skl2onnx writes for that pattern
    r"\w+",
    r"[^\s,;!]+",
    r"(?i)[A-Z]+",
    r"a|ab",  # leftmost-longest: "ab"
    r"b?a|ab",
    r"(?:ab)+?",  # lazy, but the longest
    r"\s*",  # matches of no characters are never tokens
    r"^\w+",
    r"\w+$",
], ids=["sklearn", "skl2onnx", "word", "class", "flags", "alternation", "alternation_optional", "lazy",
        "empty", "start", "end"])
@pytest.mark.parametrize("mark", [0, 1])
def test_tokenexp_matches_onnxruntime(exp: str, mark: int) -> None:
    x = _s("Hello World", "ab ba abab aab", "I love computer science !", "", "déjà vu, 中文 ok", "x y z")
    _check(x, {**BASE, "mark": mark, "tokenexp": exp})


@pytest.mark.parametrize("least", [1, 2, 3])
def test_tokenexp_mincharnum_searches_again_after_a_short_match(least: int) -> None:
    """A match too short is dropped and the search goes on from its second character: with \\w+ and
    mincharnum 3, "ab" then "b" are too short before "cde"."""
    x = _s("ab cde f", "a bb ccc dddd", "é中 中中中")
    for exp in (r"\w+", r"\b\w+", r"\w\w?"):
        _check(x, {**BASE, "mincharnum": least, "tokenexp": exp})


def test_tokenexp_dot_splits_into_characters_newlines_too() -> None:
    y = _check(_s("a\nb", "中é"), {**BASE, "tokenexp": "."})
    assert y.tolist() == [["a", "\n", "b"], ["中", "é", "#"]]


# ---------------------------------------------------------------- marks, padding, shapes


@pytest.mark.parametrize("pad", ["#", "", "<pad>", "##"])
@pytest.mark.parametrize("mark", [0, 1])
def test_padding_comes_after_the_end_mark(pad: str, mark: int) -> None:
    y = _check(_s("Hello World", "I love computer science !"),
               {**BASE, "mark": mark, "pad_value": pad, "separators": [" "]})
    if mark:
        assert y.tolist()[0] == ["\x02", "Hello", "World", "\x03", pad, pad, pad]


@pytest.mark.parametrize("attrs", [{"separators": [" "]}, {"separators": [""]}, {"tokenexp": r"\w+"}],
                         ids=["separators", "characters", "tokenexp"])
@pytest.mark.parametrize("mark", [0, 1])
def test_n_by_c_input(attrs: dict[str, Any], mark: int) -> None:
    x = _s(["a b", "c"], ["dd e f", ""], ["", "gg"])
    y = _check(x, {**BASE, "mark": mark, **attrs})
    assert y.shape[:2] == (3, 2)


@pytest.mark.parametrize("x", [_s(""), _s("", ""), _s([""], [""]), _s(" , ", " ")], ids=str)
@pytest.mark.parametrize("mark", [0, 1])
def test_no_token_anywhere_gives_a_last_axis_of_zero(x: np.ndarray, mark: int) -> None:
    """Even with marks: the output is the input's shape plus an axis of 0."""
    modes = [{"separators": [" ", ","]}, {"tokenexp": r"\w+"}]
    if not any(x.flat):
        modes.append({"separators": [""]})  # by characters: only empty strings have none
    for attrs in modes:
        y = _check(x, {**BASE, "mark": mark, **attrs})
        assert y.shape == (*x.shape, 0)


@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 3)], ids=str)
def test_empty_batch(shape: tuple[int, ...]) -> None:
    """[0] stays [0]; [N, C] holding nothing becomes [N, 0] (onnxruntime's kernel: not [N, C, 0])."""
    x = np.empty(shape, dtype=object)
    for attrs in ({"separators": [" "]}, {"tokenexp": r"\w+"}, {"separators": [""]}):
        y = _check(x, {**BASE, "mark": 1, **attrs})
        assert y.shape == (*shape[:-1], 0)


def test_runs_through_inference_session() -> None:
    x = _s(["The cat sat", "on the mat"])
    m = _model(x, {**BASE, "tokenexp": r"\b\w\w+\b"})
    (y,) = onnxtrain.InferenceSession(m.SerializeToString()).run(None, {"X": x})
    assert y.tolist() == [[["The", "cat", "sat"], ["on", "the", "mat"]]]


# ---------------------------------------------------------------- refused


@pytest.mark.parametrize("attrs, msg", [
    ({"tokenexp": r"\p{L}+"}, "tokenexp: pattern '\\\\p{L}+'"),
    ({"separators": [" ", r"[\pL]"]}, "separators: pattern '[\\\\pL]'"),
    ({"separators": [r"\C"]}, "RE2-only constructs"),
], ids=["tokenexp", "separator", "any_byte"])
def test_refuses_re2_only_syntax_naming_the_node(attrs: dict[str, Any], msg: str) -> None:
    """onnxruntime runs these (RE2 has Unicode classes and \\C); Python's re cannot give them RE2's
    meaning."""
    _refused(_s("abc"), {**BASE, **attrs}, msg, name="my_tokenizer")


@pytest.mark.parametrize("attrs", [{"tokenexp": r"a(?=b)"}, {"separators": [r"(a)\1"]}, {"tokenexp": "(a"}],
                         ids=["lookahead", "backreference", "unbalanced"])
def test_refuses_what_re2_refuses(attrs: dict[str, Any]) -> None:
    x = _s("abc")
    with pytest.raises(Exception):  # noqa: B017 (onnxruntime's error class is its own)
        _ort(_model(x, {**BASE, **attrs}), x)
    _refused(x, {**BASE, **attrs}, "pattern")


def test_refuses_both_separators_and_tokenexp() -> None:
    """The op's text takes exactly one of them; onnxruntime quietly uses the separators."""
    x = _s("x y")
    attrs = {**BASE, "separators": [" "], "tokenexp": "x"}
    assert _ort(_model(x, attrs), x).tolist() == [["x", "y"]]
    _refused(x, attrs, "separators and tokenexp are both set")


def _strings_attr(name: str, values: list[str]) -> onnx.AttributeProto:
    return helper.make_attribute(name, values, attr_type=onnx.AttributeProto.STRINGS)


@pytest.mark.parametrize("attrs, msg", [
    (dict(BASE), "one of the separators and tokenexp attributes is required"),
    ({**BASE, "tokenexp": ""}, "tokenexp must not be empty"),
    ({**BASE, "mincharnum": 0, "separators": [" "]}, "mincharnum must be positive"),
    ({**BASE, "mincharnum": 2, "separators": [""]}, "too big for tokenizing by characters"),
    ({**BASE, "mincharnum": 2, "tokenexp": "."}, "too big for tokenizing by characters"),
    ({"mark": 0, "mincharnum": 1, "separators": [" "]}, "the pad_value attribute is required"),
    ({"pad_value": "#", "mincharnum": 1, "separators": [" "]}, "the mark attribute is required"),
    ({"mark": 0, "pad_value": "#", "separators": [" "]}, "the mincharnum attribute is required"),
], ids=["neither", "empty_tokenexp", "mincharnum_0", "chars_mincharnum_2", "dot_mincharnum_2", "no_pad",
        "no_mark", "no_mincharnum"])
def test_refuses_bad_attributes_as_onnxruntime_does(attrs: dict[str, Any], msg: str) -> None:
    x = _s("x y")
    with pytest.raises(Exception):  # noqa: B017
        _ort(_model(x, attrs), x)
    _refused(x, attrs, msg)


def test_refuses_an_empty_separator_list() -> None:
    x = _s("x y")
    m = _model(x, BASE)
    m.graph.node[0].attribute.append(_strings_attr("separators", []))
    with pytest.raises(Exception):  # noqa: B017
        _ort(m, x)
    with pytest.raises(EngineError) as e:
        _ours(m, x)
    assert str(e.value.__cause__).startswith("Tokenizer 'tok': separators must hold at least one pattern")


def test_refuses_other_ranks_and_types() -> None:
    x = _s([["a b"]])
    _refused(x, {**BASE, "separators": [" "]}, "the input must have shape [C] or [N, C], got [1, 1, 1]")
    with pytest.raises(EngineError) as e:
        compile_model(_model(_s("a"), {**BASE, "separators": [" "]})).run({"X": np.array([1.5])})
    assert str(e.value.__cause__).startswith("Tokenizer 'tok': expects a string tensor")


# ---------------------------------------------------------------- scikit-learn's exports

SKL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "sklearn_text")
FIXTURES = ["count_vectorizer", "tfidf_vectorizer", "tfidf_vectorizer_bigrams"]


def _ort_or_none(model: bytes, x: np.ndarray) -> np.ndarray | None:
    """onnxruntime's output, or None if it cannot run the model here. Its StringNormalizer builds the locale
    the node names, by default en_US.UTF-8, which a machine may lack: then it runs a copy of the model whose
    StringNormalizer nodes name C.UTF-8 (our kernel reads no locale: case maps per code point)."""
    try:
        return ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]
    except Exception as e:
        if "locale" not in str(e):
            raise
    m = onnx.load_from_string(model)
    for node in m.graph.node:
        if node.op_type == "StringNormalizer":
            kept = []
            for a in node.attribute:
                if a.name != "locale":
                    kept.append(onnx.AttributeProto())
                    kept[-1].CopyFrom(a)
            del node.attribute[:]
            node.attribute.extend([*kept, helper.make_attribute("locale", "C.UTF-8")])
    try:
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception:
        return None
    return sess.run(None, {"X": x})[0]


def test_every_fixture_is_here() -> None:
    names = sorted(f[:-5] for f in os.listdir(SKL) if f.endswith(".onnx"))
    assert names == FIXTURES
    assert all(os.path.exists(os.path.join(SKL, f"{n}.npy")) for n in names)


@pytest.mark.parametrize("name", FIXTURES)
def test_sklearn_text_exports_match_scikit_learn_and_onnxruntime(name: str) -> None:
    """Each export run on the fixture's sentences gives scikit-learn's ``transform(...).toarray()`` (saved as
    float32, within 1e-6) and onnxruntime's output (1e-6; where onnxruntime's StringNormalizer lacks the
    locale en_US.UTF-8 the nodes ask for, on a copy naming C.UTF-8; where it cannot run at all, scikit-learn's
    output is the only oracle). Sentences the fixtures did not fit on (a one-letter word, which skl2onnx's
    token pattern keeps, an empty string, accents, capitals) are compared with onnxruntime only."""
    with open(os.path.join(SKL, "sentences.txt"), encoding="utf-8") as f:
        sentences = f.read().splitlines()
    assert len(sentences) == 12
    with open(os.path.join(SKL, f"{name}.onnx"), "rb") as f:
        model = f.read()
    want = np.load(os.path.join(SKL, f"{name}.npy"))
    sess = onnxtrain.InferenceSession(model)
    x = np.array(sentences, dtype=object).reshape(-1, 1)
    (got,) = sess.run(None, {"X": x})
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert np.count_nonzero(got) > got.shape[0]  # every sentence has terms

    other = np.array(["It is a test, isn't it?", "", "THE LAZY DOG jumps OVER the dog", "café naïve déjà vu",
                      "this-document the_first"], dtype=object).reshape(-1, 1)
    for feed in (x, other):
        ref = _ort_or_none(model, feed)
        if ref is None:
            continue
        (mine,) = sess.run(None, {"X": feed})
        assert mine.dtype == ref.dtype and mine.shape == ref.shape
        np.testing.assert_allclose(mine, ref, rtol=1e-6, atol=1e-7)
