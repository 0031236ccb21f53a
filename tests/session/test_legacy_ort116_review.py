"""Legacy TrainingSession behaviours found in a review against onnxruntime-training 1.16.3 (the oracle runs in
tests/ortt.py's legacy venv, through tests/session/legacy_peer.py, with its session options of
legacy_peer.PEER_CONFIG): each case runs the same model, parameters and feeds on both sides, and every step's
outputs, get_state() and get_optimizer_state() are compared to float32 rounding
(test_legacy_ort116_numerics._compare).

* ``weights_to_train`` whose every name nothing in the model reads (names of a torch module that its export
  renamed, a parameter the export left out): 1.16.3 drops each such name with a warning, as for some of
  them, and then, the set being empty, finds the trained weights as without ``weights_to_train`` (every float
  initializer that reaches the loss; the spec's §2, steps 2 and 6). onnxtrain refused the session ("no
  trainable weight reaches the loss").
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import numpy_helper

import onnxtrain
from tests.session.legacy_peer import Case, Step, run_cases
from tests.session.test_legacy_ort116_numerics import CPU_ADAM, LRS, MLP_WEIGHTS, _compare, mlp, mlp_feeds

MAPPED = (*MLP_WEIGHTS, "unused", "fc.weight")  # (1.16.3 wants an entry for every weight it trains)


def _with_unused() -> object:
    """test_legacy_ort116_numerics.mlp() with one more float initializer that no node reads."""
    m = mlp()
    m.graph.initializer.append(numpy_helper.from_array(np.ones((4, 5), np.float32), "unused"))
    return m


def _params(opt: str, wanted: set[str], **kw) -> dict:
    return {"loss_output_name": "loss", "training_optimizer_name": opt, "weights_to_train": wanted,
            "optimizer_attributes_map": {w: {} for w in MAPPED},
            "optimizer_int_attributes_map": {w: {} for w in MAPPED}, **kw}


CASES = {
    "sgd_unused_name_only": (_with_unused, "SGDOptimizer", {"unused"}),
    "sgd_names_the_model_lacks": (_with_unused, "SGDOptimizer", {"fc.weight", "unused"}),
    "adam_name_the_model_lacks": (mlp, "AdamOptimizer", {"fc.weight"}),
}


@pytest.fixture(scope="module")
def traces() -> dict:
    cases = {name: Case(model(), _params(opt, wanted), [Step(f) for f in mlp_feeds(3, LRS)],
                        ours=CPU_ADAM if opt == "AdamOptimizer" else {})
             for name, (model, opt, wanted) in CASES.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peer, ours = run_cases(list(cases.values()))
    return {name: (p, o) for name, p, o in zip(cases, peer, ours)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_weights_to_train_of_unread_names_only_trains_what_discovery_finds(traces: dict, name: str) -> None:
    peer, ours = traces[name]
    _compare(name, peer, ours)
    trained = set(MLP_WEIGHTS)
    assert set(peer.state[0]) >= trained and "unused" not in peer.state[0]  # (the oracle's own answer)
    w0 = {t.name: numpy_helper.to_array(t) for t in mlp().graph.initializer}
    for w in trained:
        assert not np.array_equal(ours.state[0][w], w0[w]), f"{name}: {w} did not move"


def test_the_fallback_is_named_in_a_warning() -> None:
    p = onnxtrain.TrainingParameters()
    for k, v in _params("SGDOptimizer", {"fc.weight"}).items():
        setattr(p, k, v)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = onnxtrain.TrainingSession(mlp().SerializeToString(), p)
    messages = [str(w.message) for w in caught]
    assert any("fc.weight" in m and "no consumer" in m for m in messages), messages
    assert any("every float initializer that reaches the loss" in m for m in messages), messages
    assert sorted(s.get_state()) == sorted(MLP_WEIGHTS)
