"""Write the scikit-learn text fixtures of tests/engine/test_tokenizer.py into tests/data/sklearn_text/.

    python tools/make_sklearn_text_fixtures.py [--out DIR]

Needs scikit-learn and skl2onnx (not in CI: the test reads the files this writes). It fits
``CountVectorizer()``, ``TfidfVectorizer()`` and ``TfidfVectorizer(ngram_range=(1, 2))`` on a dozen short
English sentences and writes skl2onnx's exports of them for an ``X`` input of shape [None, 1]
(StringNormalizer, com.microsoft Tokenizer, TfIdfVectorizer, and for tf-idf a Mul and a Normalizer):
``<name>.onnx``, and ``<name>.npy`` with scikit-learn's ``transform(sentences).toarray()`` as float32. The
sentences go to ``sentences.txt``, one a line (an object array of strings would need pickle to load).

The sentences have no word of one character: skl2onnx's Tokenizer takes scikit-learn's default token pattern
``\\b\\w\\w+\\b`` as ``[a-zA-Z0-9_]+``, which keeps such words ("a", the "t" of "don't"), so an export's
bigrams across them differ from scikit-learn's (onnxruntime's runs of the export agree with ours there).
"""

from __future__ import annotations

import os

import numpy as np
from sklearn_fixtures import OPSETS, out_dir, save_model

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Never jump over the lazy dog quickly!",
    "Is this the first document?",
    "This document is the second document.",
    "And this is the third one.",
    "The weather today is sunny and warm.",
    "My dog likes to play fetch in the park.",
    "Coffee in the morning keeps me awake.",
    "We walked along the beach at sunset.",
    "The old library has thousands of books.",
    "Children laughed while the clown juggled apples.",
    "Rain is expected later this week, so bring an umbrella.",
]


def main() -> None:
    out = out_dir(__doc__, "sklearn_text")
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import StringTensorType
    from sklearn.feature_extraction.text import CountVectorizer, TfidfVectorizer

    with open(os.path.join(out, "sentences.txt"), "w", encoding="utf-8", newline="\n") as f:
        f.write("".join(f"{s}\n" for s in SENTENCES))
    models = {"count_vectorizer": CountVectorizer(), "tfidf_vectorizer": TfidfVectorizer(),
              "tfidf_vectorizer_bigrams": TfidfVectorizer(ngram_range=(1, 2))}
    for name, est in models.items():
        est.fit(SENTENCES)
        onx = to_onnx(est, initial_types=[("X", StringTensorType([None, 1]))], target_opset=OPSETS)
        save_model(onx, os.path.join(out, f"{name}.onnx"))
        np.save(os.path.join(out, f"{name}.npy"), est.transform(SENTENCES).toarray().astype(np.float32))


if __name__ == "__main__":
    main()
