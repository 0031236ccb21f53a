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
* An Adam ``do_bias_correction`` or ``weight_decay_mode`` other than 0 or 1: 1.16.3's AdamOptimizer kernel
  refuses it when the session is made, a ``RuntimeException``; onnxtrain refused it as a ``Fail`` (and a
  ValueError), so a ported ``except RuntimeException`` missed it. It is now both: an instance of 1.16.3's
  class, by name, as tests/session/test_legacy_ort116_surface.py compares every refusal.
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


SWITCHES = {"do_bias_correction": 2, "weight_decay_mode": 2}

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
    for key, value in SWITCHES.items():
        p = _params("AdamOptimizer", set(MLP_WEIGHTS))
        p["optimizer_int_attributes_map"] = {**p["optimizer_int_attributes_map"], "W2": {key: value}}
        cases[key] = Case(mlp(), p, [Step(f) for f in mlp_feeds(1, LRS)], ours=CPU_ADAM)
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


@pytest.mark.parametrize("key", sorted(SWITCHES))
def test_an_adam_switch_out_of_range_is_refused_as_1_16_3s_class(traces: dict, key: str) -> None:
    peer, _ = traces[key]
    assert peer.error is not None and f"{key}" in peer.error, peer.error  # (its kernel's check)
    expected = peer.error.split(":", 1)[0]
    p = onnxtrain.TrainingParameters()
    for k, v in _params("AdamOptimizer", set(MLP_WEIGHTS)).items():
        setattr(p, k, v)
    p.optimizer_int_attributes_map = {**p.optimizer_int_attributes_map, "W2": {key: SWITCHES[key]}}
    with pytest.raises(Exception) as caught:
        onnxtrain.TrainingSession(mlp().SerializeToString(), p)
    classes = [c.__name__ for c in type(caught.value).__mro__]
    assert expected in classes, (expected, classes)
    assert "ValueError" in classes and "Fail" in classes  # (what onnxtrain raised before, kept)
    assert f"optimizer_int_attributes_map['W2'][{key!r}] must be 0 or 1, got 2" in str(caught.value)
