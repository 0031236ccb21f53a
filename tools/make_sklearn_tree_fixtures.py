"""Write the scikit-learn tree fixtures of tests/engine/test_tree_classifier.py into
tests/data/sklearn_trees/.

    python tools/make_sklearn_tree_fixtures.py [--out DIR]

Needs scikit-learn and skl2onnx (not in CI: the test reads the files this writes). It fits binary
classifiers on a small make_classification set (40 rows, 4 features, fixed seeds): a DecisionTreeClassifier
(depth 3), a RandomForestClassifier and an ExtraTreesClassifier (3 trees of depth 3) and a
GradientBoostingClassifier (3 estimators of depth 2), with the labels 0 and 1, and a RandomForestClassifier
and a GradientBoostingClassifier with the labels "no" and "yes". Each is written as skl2onnx exports it
without ZipMap (``<model>.onnx``, a few KB), and the rows as float32 (``x.npy``: the training rows, the
last eight with one feature each set to NaN).
"""

from __future__ import annotations

import os

import numpy as np
from sklearn_fixtures import OPSETS, out_dir, save_model

ROWS, FEATURES = 40, 4


def main() -> None:
    out = out_dir(__doc__, "sklearn_trees")
    from skl2onnx import to_onnx
    from sklearn.datasets import make_classification
    from sklearn.ensemble import ExtraTreesClassifier, GradientBoostingClassifier, RandomForestClassifier
    from sklearn.tree import DecisionTreeClassifier

    x, y = make_classification(n_samples=ROWS, n_features=FEATURES, n_informative=3, n_redundant=0,
                               n_clusters_per_class=1, class_sep=0.8, random_state=7)
    x = x.astype(np.float32)
    rows = x.copy()
    for i in range(8):  # rows with a missing feature (scikit-learn's trees send NaN down one branch)
        rows[ROWS - 1 - i, i % FEATURES] = np.nan
    np.save(os.path.join(out, "x.npy"), rows)
    words = np.where(y == 1, "yes", "no")
    models = [
        ("decision_tree", DecisionTreeClassifier(max_depth=3, random_state=0), y),
        ("random_forest", RandomForestClassifier(n_estimators=3, max_depth=3, random_state=0), y),
        ("extra_trees", ExtraTreesClassifier(n_estimators=3, max_depth=3, random_state=0), y),
        ("gradient_boosting", GradientBoostingClassifier(n_estimators=3, max_depth=2, random_state=0), y),
        ("random_forest_strings", RandomForestClassifier(n_estimators=3, max_depth=3, random_state=1), words),
        ("gradient_boosting_strings", GradientBoostingClassifier(n_estimators=3, max_depth=2, random_state=1),
         words),
    ]
    for name, model, target in models:
        model.fit(x, target)
        onx = to_onnx(model, x[:1], target_opset=OPSETS, options={id(model): {"zipmap": False}})
        save_model(onx, os.path.join(out, f"{name}.onnx"))


if __name__ == "__main__":
    main()
