"""Write the DictVectorizer fixtures of tests/engine/test_ml_maps.py into tests/data/sklearn_dict/.

    python tools/make_sklearn_dictvectorizer_fixture.py [--out DIR]

Needs scikit-learn and skl2onnx (not in CI: the test reads the files this writes, and feeds dicts of its
own). It fits ``DictVectorizer(sparse=False)`` on a few dicts of string keys and float values, and
``make_pipeline(DictVectorizer(sparse=False), LogisticRegression())`` on them with three classes, and writes
skl2onnx's exports of them for a ``map(string, tensor(float))`` input: ``dict_vectorizer.onnx`` and
``dict_logreg_3c.onnx`` (with its ZipMap, as users get it by default).
"""

from __future__ import annotations

import os

from sklearn_fixtures import OPSETS, out_dir, save_model

# the training dicts (a few keys each, of a vocabulary of six) and their classes
ROWS = [
    {"red": 1.0, "size": 2.5, "weight": 0.3},
    {"green": 1.0, "size": 1.0},
    {"blue": 1.0, "size": 3.5, "weight": 1.2, "age": 4.0},
    {"red": 1.0, "weight": 0.9, "age": 1.0},
    {"green": 1.0, "size": 0.5, "age": 2.0},
    {"blue": 1.0, "size": 4.0, "weight": 2.0},
    {"red": 1.0, "size": 2.0, "age": 3.0},
    {"green": 1.0, "weight": 0.1},
    {"blue": 1.0, "size": 3.0, "age": 5.0},
]
LABELS = [0, 1, 2, 0, 1, 2, 0, 1, 2]


def main() -> None:
    out = out_dir(__doc__, "sklearn_dict")
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import DictionaryType, FloatTensorType, StringTensorType
    from sklearn.feature_extraction import DictVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    types = [("X", DictionaryType(StringTensorType([]), FloatTensorType([])))]
    vectorizer = DictVectorizer(sparse=False).fit(ROWS)
    pipeline = make_pipeline(DictVectorizer(sparse=False), LogisticRegression(max_iter=500)).fit(ROWS, LABELS)
    for name, model in (("dict_vectorizer", vectorizer), ("dict_logreg_3c", pipeline)):
        onx = to_onnx(model, initial_types=types, target_opset=OPSETS)
        save_model(onx, os.path.join(out, f"{name}.onnx"))


if __name__ == "__main__":
    main()
