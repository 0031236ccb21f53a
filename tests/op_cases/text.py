"""Op table rows for the text kernels with non-string outputs (onnxtrain/engine/kernels/text.py).

StringConcat, StringNormalizer and StringSplit return strings, which the table's numeric comparison
cannot hold: they are checked against onnxruntime in tests/engine/test_text.py, as are the
TfIdfVectorizer cases onnx.reference gets wrong or cannot run (permuted ngram_indexes with weights, IDF
and TFIDF without weights).
"""

from __future__ import annotations

import numpy as np

from tests.op_cases import OpCase

_WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog"]


def _tokens(shape: tuple[int, ...], vocab: int = 6, dtype=np.int64):
    """Token ids in [0, vocab): float-free inputs (the row's float dtype is not used)."""
    return lambda rng, dt: [rng.integers(0, vocab, shape).astype(dtype)]


def _words(shape: tuple[int, ...]):
    def make(rng, dt):
        return [np.array(rng.choice(_WORDS, shape), dtype=object)]

    return make


def _emails(rng, dt):
    users = ["ann", "bob.k", "c-d", "x y", ""]
    hosts = ["gmail.com", "yahoo.com", "hotmail.com", "gmail.org"]
    mails = [f"{rng.choice(users)}@{rng.choice(hosts)}" for _ in range(12)]
    return [np.array(mails, dtype=object).reshape(3, 4)]


_POOL = {  # 1-grams 1, 2, 3; 2-grams (1, 2), (2, 2), (4, 5); 3-grams (1, 2, 3), (0, 0, 0)
    "ngram_counts": [0, 3, 9],
    "pool_int64s": [1, 2, 3, 1, 2, 2, 2, 4, 5, 1, 2, 3, 0, 0, 0],
    "ngram_indexes": list(range(8)),
}
_STR_POOL = {
    "ngram_counts": [0, 3],
    "pool_strings": ["cat", "dog", "mat", "the", "cat", "cat", "sat", "a", "dog"],
    "ngram_indexes": list(range(6)),
}


def _tfidf(mode: str, lo: int, hi: int, skip: int, weights: bool = False, pool: dict | None = None) -> dict:
    pool = pool or _POOL
    attrs = {"mode": mode, "min_gram_length": lo, "max_gram_length": hi, "max_skip_count": skip, **pool}
    if weights:
        attrs["weights"] = [0.5 + i for i in range(len(pool["ngram_indexes"]))]
    return attrs


CASES = [
    OpCase("TfIdfVectorizer", make_inputs=_tokens((40,)), attrs=_tfidf("TF", 1, 3, 0), opset=9, grad=False),
    OpCase("TfIdfVectorizer", make_inputs=_tokens((4, 30), dtype=np.int32), attrs=_tfidf("TF", 2, 3, 2),
           opset=9, grad=False, variant="batch_int32_skip2"),
    OpCase("TfIdfVectorizer", make_inputs=_tokens((3, 25)), attrs=_tfidf("IDF", 1, 2, 1, weights=True),
           opset=9, grad=False, variant="idf_weights"),
    OpCase("TfIdfVectorizer", make_inputs=_tokens((3, 25)), attrs=_tfidf("TFIDF", 1, 3, 3, weights=True),
           opset=9, grad=False, variant="tfidf_weights"),
    OpCase("TfIdfVectorizer", make_inputs=_words((3, 15)), attrs=_tfidf("TF", 1, 2, 1, pool=_STR_POOL),
           opset=9, grad=False, variant="strings"),
    OpCase("RegexFullMatch", make_inputs=_emails, attrs={"pattern": r"[\w.\-]{1,25}@(yahoo|gmail)\.com"},
           opset=20, grad=False),
    OpCase("RegexFullMatch", make_inputs=_words((2, 6)), attrs={"pattern": r"(?i)[a-c].t|D.*"},
           opset=20, grad=False, variant="flags_alternation"),
]
