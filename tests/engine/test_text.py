"""Text kernels against onnxruntime (RE2 for RegexFullMatch, its own TfIdfVectorizer and string ops).

onnxruntime's StringNormalizer needs a locale the machine has: the models say ``C.UTF-8``, which our
kernel ignores (it maps case per code point whatever the locale). Where onnxruntime and the spec part
(whitespace in StringSplit) onnx.reference is the oracle.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from onnxtrain.engine import compile_model
from onnxtrain.engine.plan import EngineError
from onnxtrain.ir.builder import make_model


def _model(op: str, inputs: list[np.ndarray], attrs: dict[str, Any], n_out: int = 1, opset: int = 20):
    names = [f"x{i}" for i in range(len(inputs))]
    node = helper.make_node(op, names, [f"y{i}" for i in range(n_out)], name=op, **attrs)
    g_in = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for n, v in zip(names, inputs)]
    g_out = [helper.make_empty_tensor_value_info(f"y{i}") for i in range(n_out)]
    return make_model(helper.make_graph([node], op, g_in, g_out), opset)


def _feeds(inputs: list[np.ndarray]) -> dict[str, np.ndarray]:
    return {f"x{i}": v for i, v in enumerate(inputs)}


def _ours(model: onnx.ModelProto, inputs: list[np.ndarray]) -> list[np.ndarray]:
    return compile_model(model).run(_feeds(inputs))


def _ort(model: onnx.ModelProto, inputs: list[np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, _feeds(inputs))


def _same(ours: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(ours) == len(want)
    for a, b in zip(ours, want):
        b = np.asarray(b)
        assert a.shape == b.shape, (a, b)
        assert a.dtype == b.dtype or (a.dtype == object and b.dtype.kind in "OU"), (a.dtype, b.dtype)
        if a.dtype == object:
            assert a.tolist() == b.tolist()
        else:
            np.testing.assert_array_equal(a, b)


def _s(*v: Any) -> np.ndarray:
    return np.array(v, dtype=object)


def _check(op: str, inputs: list[np.ndarray], attrs: dict[str, Any], n_out: int = 1, opset: int = 20) -> None:
    m = _model(op, inputs, attrs, n_out, opset)
    _same(_ours(m, inputs), _ort(m, inputs))


# ---------------------------------------------------------------- StringConcat


@pytest.mark.parametrize("x, y", [
    (_s("abc", "def"), _s(".com", ".net")),
    (_s(["a", "bb"], ["", "d"], ["é", "中"]).reshape(3, 2), _s("!", "?")),  # broadcast [3, 2] + [2]
    (_s(["x"], ["y"]), _s("1", "2", "3")),  # [2, 1] + [3] -> [2, 3]
    (np.array("cat", dtype=object), np.array("s", dtype=object)),
    (np.empty((0, 2), dtype=object), _s("a", "b")),
], ids=["same_shape", "broadcast", "outer", "scalar", "empty"])
def test_string_concat_matches_onnxruntime(x: np.ndarray, y: np.ndarray) -> None:
    _check("StringConcat", [x, y], {})


def test_string_concat_reads_unicode_arrays_and_bytes() -> None:
    m = _model("StringConcat", [_s("a", "b"), _s("c", "d")], {})
    got = _ours(m, [np.array(["ab", "é"]), _s(b"x", b"y")])[0]
    want = _ort(m, [_s("ab", "é"), _s("x", "y")])[0]
    assert got.dtype == object and got.tolist() == want.tolist()


# ---------------------------------------------------------------- StringNormalizer

_DAYS = _s("Monday", "tuesday", "MONDAY", "Straße", "École", "ǅemal", "wednesday")


@pytest.mark.parametrize("x, attrs", [
    (_DAYS, {"case_change_action": "LOWER"}),
    (_DAYS, {"case_change_action": "UPPER", "stopwords": ["monday", "école"]}),
    (_DAYS, {"case_change_action": "UPPER", "stopwords": ["monday"], "is_case_sensitive": 1}),
    (_DAYS, {"case_change_action": "NONE", "stopwords": ["MONDAY", "Straße"], "is_case_sensitive": 1}),
    (_DAYS, {"stopwords": ["STRASSE", "TUESDAY"]}),
    (_DAYS.reshape(1, -1), {"case_change_action": "LOWER", "stopwords": ["wednesday"]}),
    (_s("a", "A"), {"stopwords": ["a"]}),  # everything removed: [""]
    (_s("a", "A").reshape(1, 2), {"stopwords": ["a"], "case_change_action": "UPPER"}),  # [[""]]
], ids=["lower", "upper_stop_insensitive", "upper_stop_sensitive", "none_stop_sensitive", "stop_only",
        "one_row", "all_removed", "all_removed_row"])
def test_string_normalizer_matches_onnxruntime(x: np.ndarray, attrs: dict[str, Any]) -> None:
    _check("StringNormalizer", [x], {**attrs, "locale": "C.UTF-8"}, opset=10)


@pytest.mark.parametrize("action", ["LOWER", "UPPER"])
def test_string_normalizer_maps_case_as_onnxruntime_on_every_code_point(action: str) -> None:
    """Unicode's simple case mapping (towlower/towupper): İ lowers to i and ᾀ uppers to ᾈ, though
    Python's full mapping makes several code points of each."""
    x = np.array([chr(c) for c in range(0x80, 0x2000)] + ["İstanbul", "ᾳδη", "Straße"], dtype=object)
    _check("StringNormalizer", [x], {"case_change_action": action, "locale": "C.UTF-8"}, opset=10)


def test_string_normalizer_stopwords_use_the_simple_case_mapping() -> None:
    x = _s("İ", "ᾀ", "x")
    _check("StringNormalizer", [x], {"stopwords": ["i", "ᾈ"], "locale": "C.UTF-8"}, opset=10)


@pytest.mark.parametrize("x, attrs, msg", [
    (_s("a", "b", "c", "d").reshape(2, 2), {}, r"\[C\] or \[1, C\]"),
    (_s("a"), {"case_change_action": "TITLE"}, "case_change_action"),
])
def test_string_normalizer_refuses_bad_shapes_and_actions(x, attrs, msg) -> None:
    with pytest.raises(EngineError, match=f"StringNormalizer.*{msg}"):
        _ours(_model("StringNormalizer", [x], attrs, opset=10), [x])


# ---------------------------------------------------------------- StringSplit

_PIECES = _s("a-b-c", "", "-", "--x--", "no dash", "a-b", "é-中-")


@pytest.mark.parametrize("x, attrs", [
    (_PIECES, {"delimiter": "-"}),
    (_PIECES, {"delimiter": "--"}),
    (_PIECES, {"delimiter": "-", "maxsplit": 1}),
    (_PIECES, {"delimiter": "-", "maxsplit": 0}),
    (_PIECES, {"delimiter": "-", "maxsplit": -1}),
    (_s("a b", "  lead", "trail  ", "a  b   c ", "", "   ", "one").reshape(7, 1), {}),
    (_s("a b  c d ", "  x y z"), {"maxsplit": 1}),
    (_s("a b  c d ", "  x y z"), {"delimiter": "", "maxsplit": 2}),
    (np.empty((0, 3), dtype=object), {"delimiter": ","}),
], ids=["dash", "double_dash", "maxsplit1", "maxsplit0", "maxsplit_neg", "whitespace_2d", "whitespace_max1",
        "empty_delimiter_max2", "empty_tensor"])
def test_string_split_matches_onnxruntime(x: np.ndarray, attrs: dict[str, Any]) -> None:
    _check("StringSplit", [x], attrs, n_out=2)


def test_string_split_whitespace_means_every_whitespace_character() -> None:
    """onnxruntime splits on spaces only; the spec says whitespace, as onnx.reference (Python) does."""
    from onnx.reference import ReferenceEvaluator

    x = _s("a\tb\nc", " x \t y\r\n", "p\u3000q")
    m = _model("StringSplit", [x], {}, n_out=2)  # StringSplit has two outputs: one alone is an invalid node
    _same(_ours(m, [x]), ReferenceEvaluator(m).run(None, _feeds([x])))


# ---------------------------------------------------------------- RegexFullMatch

_TEXTS = _s("www.google.com", "www.bbc.co.uk", "abc123", "123", "٣٤", "é", "É", "E", "a_b", "a\n", "",
            "ab ab", "Hello World", "x.y@gmail.com", "aaa", "ab\tc")


@pytest.mark.parametrize("pattern", [
    r"www\.[\w.-]+\.\bcom\b", r"\d+", r"\w+", r"\D+", r"\W*", r"[a-z]+\d*", r"a\s?b(\s\w+)?", r"(?i)e",
    r"(ab|cd)( ab)*", r"a*?", r"[^@]+@(gmail|yahoo)\.com", r"(?i)hello\sworld", r".*", r"a$", r"^a{2,3}$",
    r"ab\b.*", r"\S+\s\S+",
])
def test_regex_full_match_agrees_with_re2(pattern: str) -> None:
    _check("RegexFullMatch", [_TEXTS.reshape(4, 4)], {"pattern": pattern})


_RE2_TEXTS = _s("é", "É", "K", "k", "\u212a", "ſ", "s", "Ω", "ω", "ǅ", "\x0b", " \t", "a\x0b", "", "a", "aaa",
                "a{,3}", "a\n", "a.b", "axb", "ab", "a b", "_1", "x^", "]", "-", "Ks", "3é")


@pytest.mark.parametrize("pattern", [
    r"(?i)é", r"(?i)[a-z]+", r"(?i)\w+", r"(?i)\W", r"(?i)[^k]", r"(?i)ω", r"(?i)ǆ", r"(?i)\B\B.",
    r"(?i).\b.", r"\s", r"\S+", r"a\s", r"[\s\d]+", r"a{,3}", r"a{2,}", r"a$\n", r"(?m)a$\n", r"\B",
    r"[[:alpha:]]+", r"[[:^space:]^x]+", r"[^\W\d]+", r"[\W\d]+", r"[^[:^alpha:]\d]+", r"\x{e9}", r"\Qa.b\E",
    r"a\z", r"(?<n>a)b", r"[]x^-]+", r"(?i)[[:upper:]][^\W\d]?",
], ids=str)
def test_regex_full_match_reads_re2_semantics(pattern: str) -> None:
    """What Python's re reads otherwise: RE2's Unicode case folding under (?i) with ASCII classes (which
    do fold: the Kelvin sign is \\w there, but not at a \\b), \\s without \\v, a literal {,3}, $ at the very
    end only, \\B on the empty string, POSIX classes, complemented classes inside brackets, \\x{..},
    \\Q..\\E, \\z and (?<name>...)."""
    _check("RegexFullMatch", [_RE2_TEXTS], {"pattern": pattern})


@pytest.mark.parametrize("pattern", [
    r"\141", r"\12", r"a\1410", r"\0", r"[\141-\143]+", r"^*a", r"a$+", r"\A?a", r"a\z{2}", r"(?m)^*a",
    r"(?m)a$*", r"a^{1,2}", r"(?U)a+b*?", r"(?iU)K+", r"(?U:a*)b", r"(?-U)a",
], ids=str)
def test_regex_full_match_runs_what_re2_runs(pattern: str) -> None:
    """RE2 reads a backslash and two or three octal digits as a character (\\12 is a newline, \\141 an
    "a"), lets an anchor be repeated (^*, $+, \\A?, \\z{2}) and has an ungreedy flag U (which changes
    no full match); Python's re refused all three."""
    _check("RegexFullMatch", [_s("a", "\n", "aa0", "\x07a", "abc", "aab", "Kk", "\u212a", "b", "", "a\n")],
           {"pattern": pattern})


@pytest.mark.parametrize("pattern", [r"(a", r"\p{L}+", r"[\pL]", r"a\Z", r"\C"])
def test_regex_full_match_refuses_what_python_cannot_compile(pattern: str) -> None:
    x = _s("abc")
    with pytest.raises(EngineError, match="RegexFullMatch: pattern") as e:
        _ours(_model("RegexFullMatch", [x], {"pattern": pattern}), [x])
    assert repr(pattern) in str(e.value)


@pytest.mark.parametrize("pattern", [r"(a)\1", r"a(?=b)", r"a(?!b)", r"(?<=a)b", r"(?<!a)b",
                                     r"(?P<n>a)(?P=n)", r"x(?>ab)", r"a*+", r"a++", r"a?+", r"a{2}+"])
def test_regex_full_match_refuses_what_re2_refuses(pattern: str) -> None:
    """Backreferences, lookaround, atomic groups and possessive quantifiers: RE2 has none of them, so
    onnxruntime refuses such a pattern; Python's re ran them (with its own meaning)."""
    x = _s("abc")
    with pytest.raises(Exception):  # noqa: B017 (onnxruntime's error class is its own)
        _ort(_model("RegexFullMatch", [x], {"pattern": pattern}), [x])
    with pytest.raises(EngineError, match="RegexFullMatch: pattern") as e:
        _ours(_model("RegexFullMatch", [x], {"pattern": pattern}), [x])
    assert "RE2 refuses" in str(e.value)


@pytest.mark.parametrize("pattern", [r"\{+", r"a}+", r"\++", r"[+*]+", r"a+?b", r"a{2,3}?"])
def test_regex_full_match_runs_plus_after_literals(pattern: str) -> None:
    """A + after a literal brace or an escaped plus, or a lazy quantifier, is no possessive one."""
    _check("RegexFullMatch", [_s("{{", "a}}", "++", "+*", "aab", "aaa")], {"pattern": pattern})


# ---------------------------------------------------------------- TfIdfVectorizer


def _random_tfidf(rng: np.random.Generator, strings: bool) -> tuple[dict[str, Any], np.ndarray]:
    """A random pool of 1- to 3-grams over a small vocabulary, its attributes and a matching input."""
    vocab = [f"w{i}" for i in range(6)] if strings else list(range(-2, 4))
    counts, pool, n_grams = [], [], 0
    for n in (1, 2, 3):
        counts.append(len(pool))
        grams = {tuple(rng.choice(len(vocab), n)) for _ in range(int(rng.integers(0, 6)))}
        for g in sorted(grams):
            pool += [vocab[i] for i in g]
        n_grams += len(grams)
    if n_grams == 0:
        pool, n_grams = [vocab[0]], 1
    lo = int(rng.integers(1, 4))
    mode = str(rng.choice(["TF", "IDF", "TFIDF"]))
    coords = rng.permutation(n_grams + 2)[:n_grams]  # a permutation with gaps
    if mode != "IDF" and rng.random() < 0.5:  # two n-grams on one coordinate (IDF: see the test below)
        coords[coords == coords.max()] = coords.min()
    attrs: dict[str, Any] = {
        "mode": mode,
        "min_gram_length": lo,
        "max_gram_length": int(rng.integers(lo, 4)),
        "max_skip_count": int(rng.integers(0, 4)),
        "ngram_counts": counts,
        "ngram_indexes": [int(i) for i in coords],
        "pool_strings" if strings else "pool_int64s": pool,
    }
    if rng.random() < 0.7:
        attrs["weights"] = [float(w) for w in rng.uniform(0.1, 3.0, n_grams).astype(np.float32)]
    length = int(rng.integers(0, 30))
    shape = (int(rng.integers(1, 4)), length) if rng.random() < 0.6 else (length,)
    idx = rng.integers(0, len(vocab), shape)
    x = np.array([vocab[i] for i in idx.ravel()], dtype=object).reshape(shape) if strings else (
        idx.astype(rng.choice([np.int32, np.int64])) - 2)
    return attrs, x


@pytest.mark.parametrize("strings", [False, True], ids=["ints", "strings"])
def test_tfidf_vectorizer_matches_onnxruntime_on_random_pools(strings: bool) -> None:
    rng = np.random.default_rng(7 + strings)
    modes = set()
    for _ in range(40):
        attrs, x = _random_tfidf(rng, strings)
        modes.add((attrs["mode"], "weights" in attrs))
        _check("TfIdfVectorizer", [x], attrs, opset=9)
    assert len(modes) == 6  # every mode, with and without weights


@pytest.mark.parametrize("attrs, x, msg", [
    ({"pool_int64s": [1], "pool_strings": ["a"]}, np.array([1]), "exactly one of"),
    ({}, np.array([1]), "exactly one of"),
    ({"pool_int64s": [1, 2, 3], "ngram_counts": [0, 0]}, np.array([1]), "not a multiple of 2"),
    ({"pool_int64s": [1, 2], "ngram_indexes": [0, 1, 2]}, np.array([1]), "one non-negative coordinate"),
    ({"pool_int64s": [1, 2], "weights": [1.0]}, np.array([1]), "weights must hold"),
    ({"pool_int64s": [1, 2]}, _s("a"), "int32 or int64 input"),
    ({"pool_strings": ["a", "b"]}, np.array([1]), "string input"),
    ({"pool_int64s": [1, 2]}, np.zeros((1, 2, 2), np.int64), r"\[C\] or \[N, C\]"),
])
def test_tfidf_vectorizer_errors_name_the_problem(attrs: dict[str, Any], x: np.ndarray, msg: str) -> None:
    base = {"mode": "TF", "min_gram_length": 1, "max_gram_length": 1, "max_skip_count": 0,
            "ngram_counts": [0], "ngram_indexes": [0, 1]}
    m = _model("TfIdfVectorizer", [x], {**base, **attrs}, opset=9)
    with pytest.raises(EngineError, match=f"TfIdfVectorizer: .*{msg}"):
        _ours(m, [x])


def _naive_counts(row: list[Any], gram: tuple[Any, ...], max_skip: int) -> int:
    """Occurrences of ``gram`` in ``row`` at every spacing up to ``max_skip`` skips (a 1-gram once)."""
    n = len(gram)
    spacings = range(1, max_skip + 2) if n > 1 else (1,)
    return sum(tuple(row[i : i + d * (n - 1) + 1 : d]) == gram
               for d in spacings for i in range(len(row) - d * (n - 1)))


def test_tfidf_vectorizer_idf_with_shared_coordinates_follows_the_spec() -> None:
    """Two n-grams on one coordinate: each present one adds its weight once (counts truncated to 1, then
    scaled, as the spec says). onnxruntime writes the weight of the last one its scan met instead."""
    pool = [1, 2, 3, 1, 2, 2, 3]
    grams = [(1,), (2,), (3,), (1, 2), (2, 3)]
    attrs = {"mode": "IDF", "min_gram_length": 1, "max_gram_length": 2, "max_skip_count": 1,
             "ngram_counts": [0, 3], "pool_int64s": pool, "ngram_indexes": [0, 1, 1, 2, 0],
             "weights": [0.5, 2.0, 8.0, 32.0, 128.0]}
    x = np.array([[1, 3, 2, 9, 3], [2, 2, 9, 9, 9], [9, 9, 9, 9, 9]], np.int64)
    want = np.zeros((3, 3), np.float32)
    for r, row in enumerate(x.tolist()):
        for g, c, w in zip(grams, attrs["ngram_indexes"], attrs["weights"]):
            want[r, c] += w * (_naive_counts(row, g, 1) > 0)
    got = _ours(_model("TfIdfVectorizer", [x], attrs, opset=9), [x])[0]
    np.testing.assert_array_equal(got, want)
    assert (want > 0).sum() >= 4
