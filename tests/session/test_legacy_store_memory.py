"""A legacy session holds its weights and moments once: where a step gives a state tensor a new array (the
numpy engine's update of a small weight is not written in place), the array it replaced is freed. Once held
(now fixed): ``StepGraphs.initial_state``, of which the session's store was a copy, kept every replaced array
of the first step (the bench's LeNet 0.71 MiB, its MLP 0.07 MiB, measured with weak references after 6
steps)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import onnxtrain
from tests.session.helpers import batches, mlp_model, params


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_replaced_weights_and_moments_are_freed(backend: str) -> None:
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", backend)
    sess = onnxtrain.TrainingSession(mlp_model().SerializeToString(), params("AdamOptimizer"), so)
    weights = sess._graphs.trainable
    shapes = {w: sess._store[w].shape for w in weights}
    # the weights and their moments (float arrays of a weight's shape; the step counts are one value)
    tracked = {k: (weakref.ref(a), id(a)) for k, a in sess._store.items()
               if a.dtype.kind == "f" and any(k == w or k.endswith(f"_{w}") and a.shape == shapes[w]
                                              for w in weights)}
    assert len(tracked) == 3 * len(weights)
    for x, y in batches(3, 4):
        sess.run(["loss"], {"x": x, "y": y, "Learning_Rate": np.array([0.01], np.float32)})
    gc.collect()
    held = [k for k, (ref, ident) in tracked.items() if ref() is not None and id(sess._store[k]) != ident]
    assert held == []
