"""``load_state(strict=True)`` as onnxruntime's ``SetStateTensors``: every name given must be a state tensor;
names left out keep their values."""

from __future__ import annotations

import numpy as np
import pytest

from onnxtrain import TrainingSession
from tests.session.helpers import batches, mlp_model, params


def _trained(steps: int) -> TrainingSession:
    sess = TrainingSession(mlp_model().SerializeToString(), params("AdamOptimizer"))
    for x, y in batches(steps, 4):
        sess.run(["loss"], {"x": x, "y": y, "Learning_Rate": np.array([0.01], np.float32)})
    return sess


def test_strict_load_of_the_weights_alone_keeps_the_optimizer_state() -> None:
    source, target = _trained(3), _trained(1)
    before = target.get_state()
    weights = source.get_model_state()["full_precision"]
    target.load_state(weights, strict=True)  # a checkpoint saved without the optimizer state
    after = target.get_state()
    for name, value in after.items():
        want = weights[name] if name in weights else before[name]
        np.testing.assert_array_equal(value, want, err_msg=name)
    assert any(k.startswith("Moment_1_") for k in after)


def test_strict_load_refuses_a_name_that_is_no_state_tensor() -> None:
    sess = _trained(1)
    state = sess.get_state()
    with pytest.raises(KeyError, match="'W3' is not a state tensor"):
        sess.load_state({**state, "W3": np.zeros(2, np.float32)}, strict=True)
    sess.load_state({**state, "W3": np.zeros(2, np.float32)})  # not strict: skipped
