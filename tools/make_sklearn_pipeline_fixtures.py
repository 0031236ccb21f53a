"""Write the scikit-learn pipeline fixtures of tests/engine/test_sklearn_pipelines.py into
tests/data/sklearn_pipelines/.

    python tools/make_sklearn_pipeline_fixtures.py [--out DIR]

Needs scikit-learn and skl2onnx (not in CI: the test reads the files this writes). Each fixture is a fitted
classifier exported by skl2onnx as users get it by default (its probabilities through ZipMap), written as
``<name>.onnx``, and ``<name>.npz`` with the input rows (``in_<input name>``; strings as fixed-width unicode)
and scikit-learn's own ``predict`` and ``predict_proba`` on them (``label``, ``proba``, the columns in
``classes_`` order). The models: a scaler + logistic regression of three classes, a binary logistic
regression with string labels, an MLP of three classes, a Gaussian naive Bayes, and a column transformer
that one-hot encodes two string columns beside two scaled numeric ones before a logistic regression (fitted
on a pandas frame: one graph input per column).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np
from sklearn_fixtures import OPSETS, out_dir, save_model


def _numeric(classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import make_classification

    x, y = make_classification(n_samples=80, n_features=5, n_informative=3, n_redundant=0,
                               n_classes=classes, n_clusters_per_class=1, random_state=seed)
    return x.astype(np.float32), y


def _fixtures() -> list[tuple[str, Any, Any, np.ndarray]]:
    """(name, estimator, its training rows (an array, or a frame of named columns), labels)."""
    import pandas as pd
    from sklearn.compose import ColumnTransformer
    from sklearn.linear_model import LogisticRegression
    from sklearn.naive_bayes import GaussianNB
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    x3, y3 = _numeric(3, 1)
    x2, y2 = _numeric(2, 2)
    rng = np.random.default_rng(3)
    frame = pd.DataFrame({"colour": rng.choice(["red", "green", "blue"], size=80),
                          "size": np.where(x3[:, 0] > 0, "large", rng.choice(["small", "medium"], size=80)),
                          "f1": x3[:, 1], "f2": x3[:, 2]})
    mixed = ColumnTransformer([("cat", OneHotEncoder(handle_unknown="ignore"), ["colour", "size"]),
                               ("num", StandardScaler(), ["f1", "f2"])])
    return [
        ("scaled_logreg_3c", make_pipeline(StandardScaler(), LogisticRegression()), x3, y3),
        ("logreg_strings_2c", LogisticRegression(), x2, np.array(["no", "yes"])[y2]),
        ("mlp_3c", MLPClassifier(hidden_layer_sizes=(8,), max_iter=300, random_state=0), x3, y3),
        ("gaussian_nb_3c", GaussianNB(), x3, y3),
        ("onehot_logreg_3c", make_pipeline(mixed, LogisticRegression(max_iter=500)), frame, y3),
    ]


def main() -> None:
    out = out_dir(__doc__, "sklearn_pipelines")
    from skl2onnx import to_onnx

    warnings.filterwarnings("ignore")  # convergence warnings of the small fits
    for name, est, x, y in _fixtures():
        est.fit(x, y)
        onx = to_onnx(est, x[:1], target_opset=OPSETS)  # a frame: one input per column, as skl2onnx names
        if isinstance(x, np.ndarray):
            inputs = {onx.graph.input[0].name: x}
        else:
            inputs = {c: x[[c]].to_numpy().astype(np.float32 if x[c].dtype.kind == "f" else str) for c in x}
        save_model(onx, os.path.join(out, f"{name}.onnx"))
        np.savez(os.path.join(out, f"{name}.npz"), **{f"in_{k}": v for k, v in inputs.items()},
                 label=np.asarray(est.predict(x)), proba=est.predict_proba(x).astype(np.float32),
                 classes=np.asarray(est.classes_))


if __name__ == "__main__":
    main()
