"""The legacy session's flat update holds each merged weight and moment once: the arrays the session's state
held before the merge (the model's weights as read, the moments' initial zeros) are freed once the state
lives in the groups' buffers. Once held twice (now fixed): the weights, by the closure that builds the step's
two halves (``training_graph``'s ``slots_for`` read the shapes from the initial ``state`` dict it kept):
2.04 MiB of the bench transformer's 2.04 MiB of weights (tracemalloc after 60 steps: 32.59 against 30.51 MiB
with the shapes read beforehand)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import onnxtrain
from onnxtrain import session_flat, session_halves
from tests.session.helpers import batches, mlp_model, params


def _session_and_replaced(monkeypatch, backend: str) -> tuple[onnxtrain.TrainingSession, dict]:
    """A session whose weights all merge, and weak references to the arrays its flat update replaced by the
    views of its buffers (weight or state name → reference)."""
    replaced: dict[str, weakref.ref] = {}
    real = session_flat.FlatLegacyUpdate._gather

    def spy(self, grp, store):
        self._allocate(grp)
        for n in grp.weights + [s for key in self.elementwise for s in grp.state[key]]:
            if store[n] is not grp.views[n]:
                replaced.setdefault(n, weakref.ref(store[n]))
        return real(self, grp, store)

    monkeypatch.setattr(session_flat.FlatLegacyUpdate, "_gather", spy)
    monkeypatch.setattr(session_halves, "NUMPY_MIN_MERGED", 2)  # (4 weights: the numpy engine steps flat too)
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", backend)
    sess = onnxtrain.TrainingSession(mlp_model().SerializeToString(),
                                     params("AdamOptimizer", enable_grad_norm_clip=False), so)
    return sess, replaced


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_the_arrays_before_the_merge_are_freed(monkeypatch, backend: str) -> None:
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    sess, replaced = _session_and_replaced(monkeypatch, backend)
    assert sess._flat is not None and [len(g.weights) for g in sess._flat.groups] == [4]
    assert len(replaced) == 12  # 4 weights, 2 moments each
    for x, y in batches(2, 4):
        sess.run(["loss"], {"x": x, "y": y, "Learning_Rate": np.array([0.01], np.float32)})
    gc.collect()
    assert sorted(n for n, r in replaced.items() if r() is not None) == []
