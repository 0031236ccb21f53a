"""float16 mixed precision with float32 graph inputs beyond float16's range (regression targets of 1e5):
cast to float16 as onnxruntime cast them, they are inf, every step is non-finite and skipped; the dynamic
loss scaler says so once it has reached its smallest scale, and the same targets scaled down train."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from onnxtrain import TrainingSession
from onnxtrain.graph_transforms.loss_scaler import DynamicLossScaler
from tests.session.helpers import mlp_model, params

LR = np.array([0.01], np.float32)


def _steps(targets_scale: float, n: int = 6):
    sess = TrainingSession(mlp_model(loss="mse").SerializeToString(),
                           params("AdamOptimizer", use_mixed_precision=True))
    before = sess.get_state()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 8)).astype(np.float32)
    y = (rng.standard_normal((8, 4)) * targets_scale).astype(np.float32)
    scaler = DynamicLossScaler(loss_scale=4.0, min_loss_scale=1.0)
    finite = []
    for _ in range(n):
        ok, = sess.run(["all_gradients_finite"], {"x": x, "y": y, "Learning_Rate": LR,
                                                  sess.loss_scale_input_name: scaler.feed()})
        finite.append(bool(ok))
        scaler.update_loss_scale(bool(ok))
    return before, sess.get_state(), finite, y


def test_targets_beyond_float16_skip_every_step_and_the_scaler_says_why() -> None:
    with pytest.warns(UserWarning, match=r"not finite at the smallest loss scale \(1\).*±65504.*float16"):
        before, after, finite, y = _steps(1e5)
    assert np.isinf(y.astype(np.float16)).any()  # the oracle: numpy's float16 cast of the targets
    assert finite == [False] * 6
    np.testing.assert_array_equal(after["W1"], before["W1"])  # no update applied


def test_targets_within_float16_train_without_the_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        before, after, finite, y = _steps(1.0)
    assert not np.isinf(y.astype(np.float16)).any()
    assert all(finite) and not np.array_equal(after["W1"], before["W1"])
