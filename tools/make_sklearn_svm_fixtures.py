"""Write the scikit-learn SVM fixtures of tests/engine/test_ml_svm_classifier.py into tests/data/sklearn_svm/.

    python tools/make_sklearn_svm_fixtures.py [--out DIR]

Needs scikit-learn and skl2onnx (not in CI: the test reads the files this writes). For 2 and 3 classes it
fits SVC with each kernel (rbf, linear, poly, sigmoid), with and without probability=True, and NuSVC (rbf)
with and without, on a small make_classification set (60 rows, 4 features, fixed seeds), and writes each
model as skl2onnx exports it without ZipMap (``<model>_<kernel>[_proba]_<k>c.onnx``, a few KB each) and the
rows as float32 (``x_<k>c.npy``).
"""

from __future__ import annotations

import os
import warnings

import numpy as np
from sklearn_fixtures import OPSETS, out_dir, save_model

ROWS, FEATURES = 60, 4


def main() -> None:
    out = out_dir(__doc__, "sklearn_svm")
    from skl2onnx import to_onnx
    from sklearn.datasets import make_classification
    from sklearn.svm import SVC, NuSVC

    warnings.filterwarnings("ignore", category=FutureWarning)  # probability=True is deprecated in 1.9
    for k in (2, 3):
        x, y = make_classification(n_samples=ROWS, n_features=FEATURES, n_informative=3, n_redundant=0,
                                   n_classes=k, n_clusters_per_class=1, class_sep=0.8, random_state=10 + k)
        x = x.astype(np.float32)
        np.save(os.path.join(out, f"x_{k}c.npy"), x)
        models = [(f"svc_{kernel}", SVC(kernel=kernel, probability=proba, random_state=0), proba)
                  for kernel in ("rbf", "linear", "poly", "sigmoid") for proba in (False, True)]
        models += [("nusvc_rbf", NuSVC(nu=0.4, probability=proba, random_state=0), proba)
                   for proba in (False, True)]
        for name, model, proba in models:
            model.fit(x, y)
            onx = to_onnx(model, x[:1], target_opset=OPSETS, options={id(model): {"zipmap": False}})
            save_model(onx, os.path.join(out, f"{name}{'_proba' if proba else ''}_{k}c.onnx"))


if __name__ == "__main__":
    main()
