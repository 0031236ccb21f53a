"""What onnxruntime-training's Python frontends (``ort_trainer.py``, ``onnxruntime.training._utils``) did
with a legacy session: found the special outputs by searching ``session._outputs_meta``, and bound
``Group_Accumulated_Gradients`` and ``all_gradients_finite`` to bool buffers of shape [1], the shape
onnxruntime's ``Group`` and ``IsAllFinite`` kernels wrote."""

from __future__ import annotations

import numpy as np

from onnxtrain import RunOptions, TrainingSession
from tests.session.helpers import batches, mlp_model, params

LR = np.array([0.1], np.float32)


def _named(sess: TrainingSession, part: str) -> str:
    """The frontends' search: the first output whose name holds ``part``."""
    return next(o.name for o in sess._outputs_meta if part in o.name)


def _bind(sess: TrainingSession, feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray]):
    """An IOBinding of ``feeds`` and of ``outputs`` to the given arrays' memory, by pointer."""
    bind = sess.io_binding()
    for name, a in feeds.items():
        bind.bind_input(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
    for name, a in outputs.items():
        bind.bind_output(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
    return bind


def test_micro_step_binds_the_group_output_to_a_one_value_buffer() -> None:
    sess = TrainingSession(mlp_model().SerializeToString(), params(gradient_accumulation_steps=2))
    group = _named(sess, "Group_Accumulated_Gradients")
    assert group == "Group_Accumulated_Gradients"
    assert [o.shape for o in sess.get_outputs() if o.name == group] == [[1]]
    (x, y), (x2, y2) = batches(2, 8)
    before = sess.get_state()
    loss, flag = np.zeros((), np.float32), np.zeros([1], bool)
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    bind = _bind(sess, {"x": x, "y": y, "Learning_Rate": LR}, {"loss": loss, group: flag})
    sess.run_with_iobinding(bind, ro)
    assert flag.tolist() == [True]  # onnxruntime's Group wrote true
    assert loss > 0
    after = sess.get_state()
    for k in ("W1", "b1", "W2", "b2"):
        np.testing.assert_array_equal(after[k], before[k])  # a micro-step: no update yet
    # run() gives the same shape
    out = sess.run([group], {"x": x2, "y": y2, "Learning_Rate": LR}, ro)[0]
    assert out.shape == (1,) and out.dtype == bool


def test_mixed_precision_binds_all_gradients_finite_to_a_one_value_buffer() -> None:
    sess = TrainingSession(mlp_model().SerializeToString(), params("AdamOptimizer", use_mixed_precision=True))
    finite_name = _named(sess, "all_gradients_finite")
    assert [o.shape for o in sess.get_outputs() if o.name == finite_name] == [[1]]
    ((x, y),) = batches(1, 8)
    feeds = {"x": x, "y": y, "Learning_Rate": LR, sess.loss_scale_input_name: np.array([4.0], np.float32)}
    flag, norm = np.zeros([1], bool), np.zeros((), np.float32)
    sess.run_with_iobinding(_bind(sess, feeds, {finite_name: flag, "global_gradient_norm": norm}))
    assert flag.tolist() == [True] and np.isfinite(norm) and norm > 0
    # an overflowing loss scale: the flag is false, as isfinite of the norm, and the weights are kept
    before = sess.get_state()
    feeds[sess.loss_scale_input_name] = np.array([3e38], np.float32)
    got, norm = sess.run([finite_name, "global_gradient_norm"], feeds)
    assert got.shape == (1,) and got.tolist() == [bool(np.isfinite(norm))] == [False]
    after = sess.get_state()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])


def test_the_meta_lists_are_the_sessions_own() -> None:
    sess = TrainingSession(mlp_model().SerializeToString(), params())
    assert [a.name for a in sess._inputs_meta] == [a.name for a in sess.get_inputs()] == ["x", "y",
                                                                                          "Learning_Rate"]
    assert [a.name for a in sess._outputs_meta] == [a.name for a in sess.get_outputs()]
    assert sess._model_meta.graph_name == "mlp"
    assert sess._overridable_initializers == sess.get_overridable_initializers()
