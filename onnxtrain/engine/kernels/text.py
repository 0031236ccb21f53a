"""Text kernels: StringConcat, StringNormalizer, StringSplit, RegexFullMatch and TfIdfVectorizer.

A string tensor is a numpy object array of Python ``str`` (what onnx's ``numpy_helper`` makes of
one); the kernels also take numpy unicode arrays and ``bytes`` elements (read as UTF-8) and always
return object arrays. Where the ONNX spec leaves a detail open, the kernels do what onnxruntime does:

* StringSplit: an empty string has no substrings (count 0), with or without a delimiter;
* StringNormalizer: upper/lower case is mapped one code point at a time by Unicode's simple case mapping
  (C's ``towupper``/``towlower`` in a UTF-8 locale), whatever the ``locale`` attribute says: ``İ`` → ``i``,
  ``ᾀ`` → ``ᾈ``, and a character that has only a several-character mapping (``ß`` → ``SS``) stays as it is;
* TfIdfVectorizer: ``weights[i]`` weighs the i-th n-gram of the pool (spec and onnxruntime; onnx's
  reference implementation reads it per output coordinate instead). N-grams mapped to the same output
  coordinate add up: their counts (TF), weighted counts (TFIDF), or, in IDF mode, the weight of each one
  present (the spec's counts truncated to 1; onnxruntime keeps the weight of the last one its scan meets).

RegexFullMatch patterns are RE2 syntax by the spec: :mod:`onnxtrain.engine.re2` runs them with RE2's meaning.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from onnxtrain.engine.re2 import compile_re2
from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel


def _strings(x: Any, op: str) -> np.ndarray:
    """``x`` as an object array of ``str``."""
    a = np.asarray(x)
    if a.dtype.kind in "US":
        return np.char.decode(a, "utf-8").astype(object) if a.dtype.kind == "S" else a.astype(object)
    if a.dtype.kind != "O":
        raise ValueError(f"{op}: expects a string tensor, got {a.dtype}")
    if all(type(s) is str for s in a.flat):
        return a
    out = np.empty(a.shape, dtype=object)
    for i, s in enumerate(a.flat):
        if isinstance(s, bytes):
            s = s.decode("utf-8")
        elif not isinstance(s, str):
            raise ValueError(f"{op}: expects a string tensor, got an element of type {type(s).__name__}")
        out.flat[i] = s
    return out


def _object_array(items: Sequence[str], shape: tuple[int, ...]) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out.reshape(shape)


# ---------------------------------------------------------------- StringConcat


@kernel("StringConcat", since=20)
def string_concat(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, y = (_strings(v, "StringConcat") for v in inputs)
    return (np.asarray(np.add(x, y), dtype=object),)  # numpy broadcasts; str + str on each pair


# ---------------------------------------------------------------- StringNormalizer


def _per_code_point(change: Callable[[str], str], simple: Callable[[str], str]) -> Callable[[str], str]:
    """Unicode's simple (one code point to one) case mapping, one code point at a time: ``change`` (Python's
    full mapping) where it gives one code point, else ``simple(c)`` if that is one code point, else ``c``."""

    def one(c: str) -> str:
        m = change(c)
        if len(m) == 1:
            return m
        m = simple(c)
        return m if len(m) == 1 else c

    def run(s: str) -> str:
        if s.isascii():
            return change(s)
        return "".join(map(one, s))

    return run


# the code points whose full mapping is several but whose simple mapping is one: U+0130 (İ) lowers to
# "i"; the Greek letters with ypogegrammeni (ᾀ, ᾳ, ...) upper to their one-code-point title case (ᾈ, ᾼ)
_LOWER = _per_code_point(str.lower, lambda c: "i" if c == "\u0130" else c)
_UPPER = _per_code_point(str.upper, str.title)


@kernel("StringNormalizer", since=10)
def string_normalizer(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = _strings(inputs[0], "StringNormalizer")
    if not (x.ndim == 1 or (x.ndim == 2 and x.shape[0] == 1)):
        raise ValueError(f"StringNormalizer: X must have shape [C] or [1, C], got {list(x.shape)}")
    action = attrs["case_change_action"]
    if action not in ("NONE", "LOWER", "UPPER"):
        raise ValueError(f"StringNormalizer: case_change_action must be NONE, LOWER or UPPER, got {action!r}")
    words = x.ravel().tolist()
    stop = attrs["stopwords"]
    if stop:
        if attrs["is_case_sensitive"]:
            drop = set(stop)
            words = [w for w in words if w not in drop]
        else:
            drop = {_LOWER(s) for s in stop}
            words = [w for w in words if _LOWER(w) not in drop]
    if action != "NONE":
        change = _LOWER if action == "LOWER" else _UPPER
        words = [change(w) for w in words]
    if not words:  # everything was a stop word: one empty string
        words = [""]
    return (_object_array(words, (len(words),) if x.ndim == 1 else (1, len(words))),)


# ---------------------------------------------------------------- StringSplit


@kernel("StringSplit", since=20)
def string_split(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = _strings(inputs[0], "StringSplit")
    delimiter = attrs["delimiter"] or None  # unset or "": runs of whitespace, stripped at both ends
    maxsplit = attrs["maxsplit"]
    limit = -1 if maxsplit is None or maxsplit < 0 else maxsplit
    parts = [
        [] if not s else s.split(delimiter, limit) if delimiter else s.strip().split(None, limit)
        for s in x.flat
    ]
    width = max(map(len, parts), default=0)
    y = np.full((len(parts), width), "", dtype=object)
    for row, p in zip(y, parts):
        row[: len(p)] = p
    counts = np.fromiter(map(len, parts), np.int64, len(parts)).reshape(x.shape)
    return y.reshape(*x.shape, width), counts


# ---------------------------------------------------------------- RegexFullMatch


@kernel("RegexFullMatch", since=20)
def regex_full_match(inputs: Inputs, attrs: Attrs) -> Outputs:
    rx = attrs.cached("regex", lambda: compile_re2(attrs["pattern"]))
    x = _strings(inputs[0], "RegexFullMatch")
    hits = np.fromiter((rx.fullmatch(s) is not None for s in x.flat), np.bool_, x.size)
    return (hits.reshape(x.shape),)


# ---------------------------------------------------------------- TfIdfVectorizer


class _NgramPool:
    """The n-gram pool of one TfIdfVectorizer node, as sorted key arrays per n-gram length.

    Tokens get ids ``0..V-1`` (their rank among the pool's distinct tokens). The first ``k`` tokens of an
    n-gram (a k-prefix) get an id per length: a 1-prefix's id is its token's; a k-prefix's is the rank of
    ``id(k-1 prefix) * V + token`` among ``keys[k]``, the sorted keys of every k-prefix in the pool.
    ``gram[k]`` maps k-prefix ids to the index of the pool n-gram of length k they spell (-1 if none).
    """

    def __init__(self, attrs: Attrs):
        op = "TfIdfVectorizer"
        ints, strs = attrs["pool_int64s"], attrs["pool_strings"]
        if (ints is None) == (strs is None):
            raise ValueError(f"{op}: exactly one of pool_int64s and pool_strings must be set")
        self.strings = strs is not None
        pool = list(strs if strs is not None else ints)
        self.mode = attrs["mode"]
        if self.mode not in ("TF", "IDF", "TFIDF"):
            raise ValueError(f"{op}: mode must be TF, IDF or TFIDF, got {self.mode!r}")
        for name in ("min_gram_length", "max_gram_length", "max_skip_count", "ngram_counts", "ngram_indexes"):
            if attrs[name] is None:
                raise ValueError(f"{op}: the {name} attribute is required")
        lo, hi, self.max_skip = attrs["min_gram_length"], attrs["max_gram_length"], attrs["max_skip_count"]
        if not 1 <= lo <= hi or self.max_skip < 0:
            raise ValueError(f"{op}: needs 1 <= min_gram_length <= max_gram_length and max_skip_count >= 0, "
                             f"got {lo}, {hi}, {self.max_skip}")
        starts = list(attrs["ngram_counts"]) + [len(pool)]
        if any(not 0 <= a <= b <= len(pool) for a, b in zip(starts, starts[1:])):
            raise ValueError(f"{op}: ngram_counts {attrs['ngram_counts']} must be non-decreasing offsets "
                             f"into a pool of {len(pool)} items")
        grams: list[tuple[Any, ...]] = []
        for k in range(len(starts) - 1):
            n, seg = k + 1, pool[starts[k] : starts[k + 1]]
            if len(seg) % n:
                raise ValueError(f"{op}: the {n}-grams of the pool hold {len(seg)} items, "
                                 f"not a multiple of {n}")
            grams += [tuple(seg[j : j + n]) for j in range(0, len(seg), n)]
        coords = np.asarray(attrs["ngram_indexes"], np.int64)
        if len(coords) != len(grams) or not len(grams) or coords.min() < 0:
            raise ValueError(f"{op}: ngram_indexes must hold one non-negative coordinate per pool n-gram "
                             f"({len(grams)}), got {len(coords)} values")
        weights = attrs["weights"]
        if weights is not None and len(weights) != len(grams):
            raise ValueError(f"{op}: weights must hold one value per pool n-gram ({len(grams)}), "
                             f"got {len(weights)}")
        self.coords = coords
        self.weights = None if weights is None else np.asarray(weights, np.float32)
        self.n_grams = len(grams)
        self.out_size = int(coords.max()) + 1

        tokens = sorted({t for g in grams for t in g})
        index = {t: i for i, t in enumerate(tokens)}
        self.vocab: Any = index if self.strings else np.asarray(tokens, np.int64)
        self.V = v = len(tokens)
        longest = max(len(g) for g in grams)
        self.keys: list[np.ndarray] = [np.arange(v, dtype=np.int64)]  # keys[k - 1]: the k-prefixes
        self.gram: list[np.ndarray] = []
        prefix = np.asarray([index[g[0]] for g in grams], np.int64)  # each n-gram's current prefix id
        length = np.asarray([len(g) for g in grams])
        for k in range(1, longest + 1):
            if k > 1:
                has = length >= k
                key = prefix[has] * v + np.asarray([index[g[k - 1]] for g in grams if len(g) >= k], np.int64)
                self.keys.append(np.unique(key))
                prefix[has] = np.searchsorted(self.keys[-1], key)
            at = np.full(len(self.keys[-1]), -1, np.int64)
            ends = np.flatnonzero(length == k)
            at[prefix[ends]] = ends  # a repeated n-gram: the last one counts
            self.gram.append(at)
        self.sizes = [n for n in range(lo, min(hi, longest) + 1) if (length == n).any()]

    def token_ids(self, x: np.ndarray) -> np.ndarray:
        """Each token's id, -1 for tokens not in the pool."""
        op = "TfIdfVectorizer"
        if self.strings:
            if x.dtype.kind not in "OUS":
                raise ValueError(f"{op}: pool_strings needs a string input, got {x.dtype}")
            x = _strings(x, op)
            get = self.vocab.get
            return np.fromiter((get(s, -1) for s in x.flat), np.int64, x.size).reshape(x.shape)
        if x.dtype.kind not in "iu":
            raise ValueError(f"{op}: pool_int64s needs an int32 or int64 input, got {x.dtype}")
        pos = np.minimum(np.searchsorted(self.vocab, x), self.V - 1)
        return np.where(self.vocab[pos] == x, pos, -1)

    def counts(self, tok: np.ndarray) -> np.ndarray:
        """(rows, n_grams) occurrences of each pool n-gram in each row of token ids."""
        rows, length = tok.shape
        total = np.zeros(rows * self.n_grams, np.int64)
        base = (np.arange(rows, dtype=np.int64) * self.n_grams)[:, None]
        for n in self.sizes:
            for skip in range(self.max_skip + 1 if n > 1 else 1):  # a 1-gram is counted once
                d = skip + 1
                m = length - d * (n - 1)  # n-grams of this spacing that fit in a row
                if m <= 0:
                    break
                ids = tok[:, :m]
                ok = ids >= 0
                for k in range(1, n):
                    nxt = tok[:, k * d : k * d + m]
                    keys = self.keys[k]
                    key = ids * self.V + nxt
                    ids = np.minimum(np.searchsorted(keys, key), len(keys) - 1)
                    ok &= (nxt >= 0) & (keys[ids] == key)
                g = self.gram[n - 1][np.where(ok, ids, 0)]
                hit = ok & (g >= 0)
                total += np.bincount((base + g)[hit], minlength=total.size)
        return total.reshape(rows, self.n_grams)


@kernel("TfIdfVectorizer", since=9)
def tfidf_vectorizer(inputs: Inputs, attrs: Attrs) -> Outputs:
    pool: _NgramPool = attrs.cached("pool", lambda: _NgramPool(attrs))
    x = np.asarray(inputs[0])
    if x.ndim not in (1, 2):
        raise ValueError(f"TfIdfVectorizer: X must have shape [C] or [N, C], got {list(x.shape)}")
    rows = x.reshape(1, -1) if x.ndim == 1 else x
    c = pool.counts(pool.token_ids(rows))
    if pool.mode == "TF":
        vals = c.astype(np.float32)
    else:
        vals = (c > 0).astype(np.float32) if pool.mode == "IDF" else c.astype(np.float32)
        if pool.weights is not None:
            vals *= pool.weights
    y = np.zeros((rows.shape[0], pool.out_size), np.float32)
    np.add.at(y, (slice(None), pool.coords), vals)
    return (y.reshape(pool.out_size) if x.ndim == 1 else y,)
