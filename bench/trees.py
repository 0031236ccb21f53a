"""Tree-ensemble inference (``ai.onnx.ml`` TreeEnsembleClassifier, what scikit-learn's forests and boosting
export to) in onnxtrain's engine against onnxruntime on the same model.

    python -m bench.trees [--repeats 7] [--quick]

The forests are random and complete, built with onnx.helper (no scikit-learn needed): a random forest of
100 trees of depth 10 over 20 features and 3 classes (each leaf scoring every class), and a boosted model
of 150 trees of depth 3 (each leaf scoring one class, as gradient boosting's trees do), run on 1 and 1,000
rows. Both results are checked against each other first (labels equal, scores within 1e-5); figures are
medians of interleaved runs, as ms and as onnxtrain's time over onnxruntime's (onnxruntime with its default
threads).
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import onnx
from onnx import TensorProto, helper

from bench.common import add_repo_to_path, timed_against_onnxruntime

add_repo_to_path()
from onnxtrain.engine import compile_model  # noqa: E402

FEATURES, CLASSES = 20, 3


def forest(trees: int, depth: int, one_class: bool, seed: int = 0) -> onnx.ModelProto:
    """A TreeEnsembleClassifier of ``trees`` complete trees of ``depth`` levels (BRANCH_LEQ), random
    features and thresholds; each leaf scores every class, or (``one_class``) its tree's class."""
    rng = np.random.default_rng(seed)
    names = ("nodes_treeids", "nodes_nodeids", "nodes_featureids", "nodes_values", "nodes_modes",
             "nodes_truenodeids", "nodes_falsenodeids", "class_treeids", "class_nodeids", "class_ids",
             "class_weights")
    a: dict[str, list] = {k: [] for k in names}
    inner = 2 ** depth - 1
    for t in range(trees):
        for k in range(2 * inner + 1):
            leaf = k >= inner
            a["nodes_treeids"].append(t)
            a["nodes_nodeids"].append(k)
            a["nodes_featureids"].append(0 if leaf else int(rng.integers(FEATURES)))
            a["nodes_values"].append(0.0 if leaf else float(rng.standard_normal()))
            a["nodes_modes"].append("LEAF" if leaf else "BRANCH_LEQ")
            a["nodes_truenodeids"].append(0 if leaf else 2 * k + 1)
            a["nodes_falsenodeids"].append(0 if leaf else 2 * k + 2)
            if leaf:
                for c in ([t % CLASSES] if one_class else range(CLASSES)):
                    a["class_treeids"].append(t)
                    a["class_nodeids"].append(k)
                    a["class_ids"].append(c)
                    a["class_weights"].append(float(rng.uniform(-1, 1) if one_class else rng.uniform(0, 1)))
    node = helper.make_node("TreeEnsembleClassifier", ["X"], ["label", "scores"], domain="ai.onnx.ml",
                            classlabels_int64s=list(range(CLASSES)), post_transform="NONE", **a)
    g = helper.make_graph([node], "forest", [helper.make_tensor_value_info("X", TensorProto.FLOAT,
                                                                           [None, FEATURES])],
                          [helper.make_tensor_value_info("label", TensorProto.INT64, [None]),
                           helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, CLASSES])])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)]
    return helper.make_model(g, opset_imports=opsets, ir_version=9)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="smaller forests, fewer rounds")
    args = p.parse_args(argv)
    import onnxruntime as ort

    cases = [("random forest, 100 trees of depth 10", 100, 10, False),
             ("boosting, 150 trees of depth 3", 150, 3, True)]
    if args.quick:
        cases = [("random forest, 10 trees of depth 6", 10, 6, False)]
    x_all = np.random.default_rng(1).standard_normal((1000, FEATURES)).astype(np.float32)
    for label, trees, depth, one_class in cases:
        model = forest(trees, depth, one_class)
        theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        ours = compile_model(model)
        for rows in (1, 1000):
            feeds = {"X": x_all[:rows]}
            want, got = theirs.run(None, feeds), ours.run(feeds)
            assert np.array_equal(want[0], got[0]), "labels differ"
            np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
            print(timed_against_onnxruntime(f"{label}, {rows} row{'s' if rows > 1 else ''}", ours, theirs,
                                            feeds, args.repeats, 0.02 if args.quick else 0.05))
    return 0


if __name__ == "__main__":
    sys.exit(main())
