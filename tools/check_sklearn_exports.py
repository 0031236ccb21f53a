"""Run scikit-learn, LightGBM and XGBoost models as their converters export them, on onnxtrain and on
onnxruntime, and print how far apart the outputs are.

    python tools/check_sklearn_exports.py [--rows N]

Needs scikit-learn, skl2onnx, and (for their lines) lightgbm, xgboost and onnxmltools: none is a
dependency of onnxtrain or of its tests, whose fixtures (tests/data/sklearn_*) hold a part of these
models. Each line: the model, OK when labels are equal and every float output is within 1e-5 relative
(absolute for values under 1), else DIFF, FAIL with onnxtrain's error, or SKIP when the converter
itself fails; then the largest differences and the ops of the graph. Exits 1 when a line is DIFF or FAIL.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

OPSETS = {"": 17, "ai.onnx.ml": 3}


def _gap(want: Any, got: Any) -> float:
    """The largest relative difference of two outputs (inf where labels, keys or shapes differ)."""
    if isinstance(want, list):  # ZipMap's dicts
        if [list(d) for d in want] != [list(d) for d in got]:
            return float("inf")
        want = np.array([list(d.values()) for d in want])
        got = np.array([list(d.values()) for d in got])
    want, got = np.asarray(want), np.asarray(got)
    if want.shape != got.shape:
        return float("inf")
    if want.dtype.kind not in "fc":
        return 0.0 if np.array_equal(want, got) else float("inf")
    if not want.size:
        return 0.0
    w, g = want.astype(np.float64), got.astype(np.float64)
    return float(np.max(np.abs(w - g) / np.maximum(np.abs(w), 1.0)))  # relative; absolute below 1


def _sklearn_models(rows: int) -> Iterator[tuple[str, Callable[[], Any], np.ndarray]]:
    """(name, a function fitting and exporting the model, the rows to run)."""
    from skl2onnx import to_onnx
    from sklearn import (
        cluster,
        decomposition,
        ensemble,
        linear_model,
        mixture,
        naive_bayes,
        neighbors,
        neural_network,
        preprocessing,
        svm,
        tree,
    )
    from sklearn.datasets import make_classification, make_regression
    from sklearn.pipeline import make_pipeline

    def export(model: Any, x: np.ndarray, y: np.ndarray) -> Callable[[], Any]:
        return lambda: to_onnx(model.fit(x, y), x[:1], target_opset=OPSETS)

    classifiers = {
        "LogisticRegression": lambda: linear_model.LogisticRegression(),
        "SGDClassifier": lambda: linear_model.SGDClassifier(random_state=0),
        "LinearSVC": lambda: svm.LinearSVC(),
        "SVC": lambda: svm.SVC(),
        "SVC(probability)": lambda: svm.SVC(probability=True, random_state=0),
        "NuSVC": lambda: svm.NuSVC(),
        "DecisionTree": lambda: tree.DecisionTreeClassifier(max_depth=4),
        "RandomForest": lambda: ensemble.RandomForestClassifier(5, max_depth=4, random_state=0),
        "ExtraTrees": lambda: ensemble.ExtraTreesClassifier(4, max_depth=3, random_state=0),
        "GradientBoosting": lambda: ensemble.GradientBoostingClassifier(n_estimators=5),
        "AdaBoost": lambda: ensemble.AdaBoostClassifier(n_estimators=3),
        "Bagging": lambda: ensemble.BaggingClassifier(n_estimators=3, random_state=0),
        "GaussianNB": lambda: naive_bayes.GaussianNB(),
        "KNeighbors": lambda: neighbors.KNeighborsClassifier(),
        "MLP": lambda: neural_network.MLPClassifier(max_iter=50, random_state=0),
        "Scaler+LogisticRegression": lambda: make_pipeline(preprocessing.StandardScaler(),
                                                           linear_model.LogisticRegression()),
    }
    for k in (2, 3):
        x, y = make_classification(200, 6, n_informative=4, n_classes=k, random_state=0)
        x = x.astype(np.float32)
        for name, make in classifiers.items():
            yield f"{name} {k} classes", export(make(), x, y), x[:rows]
    x, y = make_regression(200, 5, random_state=0)
    x = x.astype(np.float32)
    regressors = {
        "LinearRegression": linear_model.LinearRegression(), "Ridge": linear_model.Ridge(),
        "DecisionTreeRegressor": tree.DecisionTreeRegressor(max_depth=4),
        "RandomForestRegressor": ensemble.RandomForestRegressor(4, max_depth=3, random_state=0),
        "GradientBoostingRegressor": ensemble.GradientBoostingRegressor(n_estimators=4),
        "SVR": svm.SVR(), "KNeighborsRegressor": neighbors.KNeighborsRegressor(),
        "MLPRegressor": neural_network.MLPRegressor(max_iter=30, random_state=0),
        "PCA": decomposition.PCA(3), "KMeans": cluster.KMeans(3, n_init=1, random_state=0),
        "GaussianMixture": mixture.GaussianMixture(2, random_state=0),
        "IsolationForest": ensemble.IsolationForest(n_estimators=3, random_state=0),
    }
    for name, model in regressors.items():
        yield name, export(model, x, y), x[:rows]


def _text_models(rows: int) -> Iterator[tuple[str, Callable[[], Any], np.ndarray]]:
    """Text vectorizers on short sentences without one-letter words (skl2onnx's exports count those as
    tokens, where scikit-learn's default pattern does not), as a [N, 1] string input."""
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import StringTensorType
    from sklearn.feature_extraction.text import CountVectorizer, TfidfVectorizer

    words = "the cat sat on mat dog ran far fast cats and dogs play all day long".split()  # noqa: SIM905
    rng = np.random.default_rng(0)
    texts = np.array([" ".join(rng.choice(words, rng.integers(2, 9))) for _ in range(max(rows, 40))], object)
    types = [("X", StringTensorType([None, 1]))]
    for name, model in (("CountVectorizer", CountVectorizer()), ("TfidfVectorizer", TfidfVectorizer()),
                        ("TfidfVectorizer bigrams", TfidfVectorizer(ngram_range=(1, 2)))):
        yield (name, lambda m=model: to_onnx(m.fit(texts), initial_types=types, target_opset=OPSETS),
               texts[:rows].reshape(-1, 1))


def _with_c_locale(data: bytes) -> bytes:
    """The model with its StringNormalizer nodes naming the C.UTF-8 locale (onnxruntime builds the locale a
    node names, and a machine may lack en_US.UTF-8; onnxtrain's kernel reads none)."""
    import onnx

    model = onnx.load_from_string(data)
    for node in model.graph.node:
        if node.op_type == "StringNormalizer":
            kept = [a for a in node.attribute if a.name != "locale"]
            del node.attribute[:]
            node.attribute.extend([*kept, onnx.helper.make_attribute("locale", "C.UTF-8")])
    return model.SerializeToString()


def _boosting_models(rows: int) -> Iterator[tuple[str, Callable[[], Any], np.ndarray]]:
    try:
        import lightgbm
        import xgboost
        from onnxmltools import convert_lightgbm, convert_xgboost
        from onnxmltools.convert.common.data_types import FloatTensorType
    except ImportError as e:
        print(f"(LightGBM and XGBoost skipped: {e})")
        return
    from sklearn.datasets import make_classification, make_regression

    types = [("X", FloatTensorType([None, 6]))]
    for k in (2, 3):
        x, y = make_classification(300, 6, n_informative=4, n_classes=k, random_state=0)
        x = x.astype(np.float32)
        x[::17, 2] = np.nan  # missing values
        lgb = lightgbm.LGBMClassifier(n_estimators=10, num_leaves=8, verbose=-1)
        xgb = xgboost.XGBClassifier(n_estimators=10, max_depth=3)
        yield (f"LightGBM {k} classes", lambda m=lgb, x=x, y=y: convert_lightgbm(
            m.fit(x, y), initial_types=types, target_opset=15, zipmap=True), x[:rows])
        yield (f"XGBoost {k} classes", lambda m=xgb, x=x, y=y: convert_xgboost(
            m.fit(x, y), initial_types=types, target_opset=15), x[:rows])
    x, y = make_regression(300, 6, random_state=0)
    x = x.astype(np.float32)
    yield ("LightGBM regressor", lambda: convert_lightgbm(
        lightgbm.LGBMRegressor(n_estimators=10, num_leaves=8, verbose=-1).fit(x, y), initial_types=types,
        target_opset=15), x[:rows])
    yield ("XGBoost regressor", lambda: convert_xgboost(
        xgboost.XGBRegressor(n_estimators=10, max_depth=3).fit(x, y), initial_types=types, target_opset=15),
        x[:rows])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50, help="rows to run each model on (default 50)")
    rows = parser.parse_args().rows
    import onnxruntime

    import onnxtrain

    warnings.filterwarnings("ignore")  # the small fits' convergence warnings
    failed = 0
    for name, make, x in (*_sklearn_models(rows), *_text_models(rows), *_boosting_models(rows)):
        try:
            onx = make()
        except Exception as e:  # the converter's own failure
            print(f"SKIP {name}: the converter failed: {str(e)[:100]}")
            continue
        data = onx.SerializeToString()
        ops = ", ".join(sorted({n.op_type for n in onx.graph.node}))
        feeds = {onx.graph.input[0].name: x}
        try:
            reference = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
        except Exception as e:  # a locale this machine lacks
            if "locale" not in str(e):
                raise
            reference = onnxruntime.InferenceSession(_with_c_locale(data), providers=["CPUExecutionProvider"])
        want = reference.run(None, feeds)
        try:
            got = onnxtrain.InferenceSession(data).run(None, feeds)
        except Exception as e:
            print(f"FAIL {name}: {str(e)[:200]} [{ops}]")
            failed += 1
            continue
        gaps = [_gap(w, g) for w, g in zip(want, got)]
        ok = all(g <= 1e-5 for g in gaps)
        failed += not ok
        print(f"{'OK  ' if ok else 'DIFF'} {name}: {', '.join(f'{g:.1e}' for g in gaps)} [{ops}]")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
