"""Scripts written the way legacy onnxruntime-training clients wrote them run with only the import changed."""

from __future__ import annotations

import numpy as np
import pytest

from tests.session.helpers import mlp_model

LEGACY_SCRIPT = """
import numpy as np
from {module} import TrainingParameters, TrainingSession, RunOptions, OrtValue

def train(model_bytes, X, Y, batch, lr, epochs):
    params = TrainingParameters()
    params.loss_output_name = "loss"
    params.training_optimizer_name = "SGDOptimizer"
    params.weights_to_train = {{"W1", "b1", "W2", "b2"}}
    params.optimizer_attributes_map = {{n: {{}} for n in params.weights_to_train}}
    params.optimizer_int_attributes_map = {{n: {{}} for n in params.weights_to_train}}
    sess = TrainingSession(model_bytes, params, providers=["CPUExecutionProvider"])
    lr_value = OrtValue.ortvalue_from_numpy(np.array([lr], dtype=np.float32))
    bind = sess.io_binding()
    item = X.dtype.itemsize * X.shape[1]
    losses = []
    for epoch in range(epochs):
        for start in range(0, X.shape[0], batch):
            n = min(batch, X.shape[0] - start)
            # slices of the one big array, bound by raw pointer offsets as legacy clients did
            bind.bind_input("x", "cpu", 0, np.float32, [n, X.shape[1]], X.ctypes.data + start * item)
            bind.bind_input("y", "cpu", 0, np.int64, [n], Y.ctypes.data + start * Y.dtype.itemsize)
            bind.bind_ortvalue_input("Learning_Rate", lr_value)
            bind.bind_output("loss")
            sess.run_with_iobinding(bind)
            losses.append(float(bind.copy_outputs_to_cpu()[0]))
    state = sess.get_state()
    fresh = TrainingSession(model_bytes, params)
    fresh.load_state(state)
    return losses, state, fresh.get_state()
"""


def _run(module: str):
    ns: dict = {}
    exec(LEGACY_SCRIPT.format(module=module), ns)  # noqa: S102 - the script is the test's subject
    rng = np.random.default_rng(0)
    X = rng.standard_normal((96, 8)).astype(np.float32)
    Y = rng.integers(0, 4, 96).astype(np.int64)
    return ns["train"](mlp_model().SerializeToString(), X, Y, 16, 0.1, 5), X, Y


def test_legacy_script_runs_with_only_the_import_changed() -> None:
    (losses, state, reloaded), X, Y = _run("onnxtrain")
    assert losses[-1] < losses[0] * 0.8  # it learns
    for k in state:
        np.testing.assert_array_equal(state[k], reloaded[k])
    # the same script through the binding-module path
    (losses2, _, _), _, _ = _run("onnxtrain.capi._pybind_state")
    assert losses2 == losses


def test_eval_through_iobinding_with_training_mode_false_does_not_update() -> None:
    import onnxtrain

    p = onnxtrain.TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    sess = onnxtrain.TrainingSession(mlp_model().SerializeToString(), p)
    before = sess.get_state()
    ro = onnxtrain.RunOptions()
    ro.training_mode = False
    ro.only_execute_path_to_fetches = True
    b = sess.io_binding()
    x = np.ones((4, 8), np.float32)
    b.bind_cpu_input("x", x)
    b.bind_cpu_input("y", np.zeros(4, np.int64))
    b.bind_output("logits")
    sess.run_with_iobinding(b, ro)
    assert b.copy_outputs_to_cpu()[0].shape == (4, 4)
    after = sess.get_state()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k])
    with pytest.raises(ValueError, match="Learning_Rate"):
        sess.run(["loss"], {"x": x, "y": np.zeros(4, np.int64)})
