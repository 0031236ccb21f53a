"""``use_fp16_moments``: Adam's and Lamb's moments kept in float16, the update in float32 (spec §8.5)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnxtrain import TrainingSession
from tests.session.helpers import adam_ref, batches, lamb_ref, mlp_model, params, weights_of
from tests.session.test_training_session import LR, assert_rel, feeds, follow

NAMES = ["W1", "W2", "b1", "b2"]
F16, F32 = np.float16, np.float32


def _half(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to float16, back in float64."""
    return x.astype(F16).astype(np.float64)


def _half_positive(x: np.ndarray) -> np.ndarray:
    """A second moment as kept in float16: at least float16's smallest positive value, rounded."""
    return _half(np.maximum(x, float(np.finfo(F16).smallest_subnormal)))


def _follow(p, update) -> TrainingSession:
    """12 steps of a session with float16 moments next to a float64 reference that rounds its moments to
    float16 after each step (the second ones at least float16's smallest positive value), the update itself
    using the unrounded ones; weights and moments must agree."""
    sess, w, m1, m2 = follow(mlp_model(act="Tanh"), p, update, steps=12, keep=_half,
                             keep_second=_half_positive)
    state = sess.get_state()
    for k in w:
        assert state[f"Moment_1_{k}"].dtype == F16 and state[f"Moment_2_{k}"].dtype == F16
        assert state[k].dtype == F32
        # float16 rounding of values computed in float32 and in float64 may part by one float16 ulp (6e-8
        # among the subnormals below 6.1e-5)
        np.testing.assert_allclose(state[f"Moment_1_{k}"], m1[k], rtol=2e-3, atol=1e-7, err_msg=k)
        np.testing.assert_allclose(state[f"Moment_2_{k}"], m2[k], rtol=2e-3, atol=6e-8, err_msg=k)
        assert_rel(state[k], w[k], 1e-4, k)
    return sess


def test_adam_with_fp16_moments_against_float64_reference() -> None:
    p = params("AdamOptimizer", use_fp16_moments=True, enable_grad_norm_clip=False,
               optimizer_attributes_map={n: {"lambda": 0.01} for n in NAMES},
               optimizer_int_attributes_map={n: {"weight_decay_mode": 1} for n in NAMES})
    _follow(p, lambda w, g, m1, m2, t: adam_ref(w, g, m1, m2, t, float(LR[0]), lam=0.01, mode=1))


def test_lamb_with_fp16_moments_against_float64_reference() -> None:
    p = params("LambOptimizer", use_fp16_moments=True, enable_grad_norm_clip=False,
               optimizer_attributes_map={n: {"lambda": 0.01} for n in NAMES})
    _follow(p, lambda w, g, m1, m2, t: lamb_ref(w, g, m1, m2, t, float(LR[0]), lam=0.01))


def test_moments_are_the_float32_values_rounded_to_float16() -> None:
    """One step from stored moments: each new moment is α·m + (1−α)·g computed in float32 from the float16
    moment and the step's float32 gradient, then rounded to float16: the same bits as numpy's."""
    model = mlp_model(act="Tanh")
    p = params("AdamOptimizer", use_fp16_moments=True, enable_grad_norm_clip=False,
               set_gradients_as_graph_outputs=True)
    sess = TrainingSession(model.SerializeToString(), p)
    rng = np.random.default_rng(4)
    w = weights_of(model)
    old = {}
    for k, v in w.items():
        old[k] = ((rng.standard_normal(v.shape) * 1e-2).astype(F16), (rng.random(v.shape) * 1e-4).astype(F16))
    sess.load_state({f"Moment_{i + 1}_{k}": m[i] for k, m in old.items() for i in (0, 1)})
    x, y = batches(1, 16)[0]
    grads = dict(zip(NAMES, sess.run([f"{k}_grad" for k in NAMES], feeds(x, y))))
    state = sess.get_state()
    a, b = F32(0.9), F32(0.999)
    for k, g in grads.items():
        m1, m2 = (m.astype(F32) for m in old[k])
        want1 = (m1 * a + g * F32(1 - 0.9)).astype(F16)
        want2 = np.maximum(m2 * b + g * g * F32(1 - 0.999), np.finfo(F16).smallest_subnormal).astype(F16)
        np.testing.assert_array_equal(state[f"Moment_1_{k}"], want1, err_msg=k)
        np.testing.assert_array_equal(state[f"Moment_2_{k}"], want2, err_msg=k)


def test_fp16_moments_graph_passes_the_checker_and_runs_on_onnxruntime(tmp_path) -> None:
    ort = pytest.importorskip("onnxruntime")
    path = str(tmp_path / "train.onnx")
    p = params("AdamOptimizer", use_fp16_moments=True, model_with_training_graph_path=path)
    sess = TrainingSession(mlp_model().SerializeToString(), p)
    train = onnx.load(path)
    onnx.checker.check_model(train, full_check=True)
    moments = [i for i in train.graph.input if i.name.startswith("Moment_")]
    assert moments and all(i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 for i in moments)
    x, y = batches(1, 16)[0]
    state = {i.name: sess._store[i.name] for i in train.graph.input if i.name in sess._store}
    feed = {**feeds(x, y), **state}
    names = [o.name for o in train.graph.output]
    want = dict(zip(names, ort.InferenceSession(train.SerializeToString()).run(None, feed)))
    sess.run(["loss"], feeds(x, y))
    for k, v in sess.get_state().items():
        out = sess._graphs.updates["full"][k]
        assert v.dtype == want[out].dtype, k
        np.testing.assert_allclose(v.astype(np.float64), want[out].astype(np.float64), rtol=1e-3, atol=1e-7,
                                   err_msg=k)


def test_fp16_moments_state_round_trip_and_dtype_errors() -> None:
    model = mlp_model()
    p = params("AdamOptimizer", use_fp16_moments=True)
    sess = TrainingSession(model.SerializeToString(), p)
    for x, y in batches(3, 16):
        sess.run(["loss"], feeds(x, y))
    state = sess.get_state()
    other = TrainingSession(model.SerializeToString(), params("AdamOptimizer", use_fp16_moments=True))
    other.load_state(state, strict=True)
    x, y = batches(1, 16, seed=9)[0]
    np.testing.assert_array_equal(sess.run(["loss"], feeds(x, y))[0], other.run(["loss"], feeds(x, y))[0])
    for k, v in sess.get_state().items():
        np.testing.assert_array_equal(v, other.get_state()[k], err_msg=k)
    assert sess.get_optimizer_state()["W1"]["Moment_1"].dtype == F16
    with pytest.raises(TypeError, match="Moment_1_W1.*float16.*float32"):
        other.load_state({"Moment_1_W1": state["Moment_1_W1"].astype(F32)})
    # SGD keeps no moments: the option changes nothing there
    sgd = TrainingSession(model.SerializeToString(), params(use_fp16_moments=True))
    assert set(sgd.get_state()) == set(weights_of(model))
