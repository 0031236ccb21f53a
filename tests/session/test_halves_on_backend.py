"""A legacy session on the onnxruntime backend with large weights steps as two graphs, the update in pieces
(``onnxtrain/session_halves.py``): the same losses, weights and fetched values as the single graph on the
backend and as the numpy engine (the reference), the global norm fetched from the update half. "Large" is
made small here (pieces of 50 values from weights of 100)."""

from __future__ import annotations

import numpy as np
import pytest

import onnxtrain
from onnxtrain.engine import ort_chunks
from tests.session.helpers import mlp_model, params


def _session(backend: str, opt: str, **kw) -> onnxtrain.TrainingSession:
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", backend)
    model = mlp_model(din=12, dh=20, dout=5)  # W1 has 240 values, W2 100
    return onnxtrain.TrainingSession(model.SerializeToString(), params(opt, **kw), so)


def _train(sess: onnxtrain.TrainingSession, fetch: list[str], steps: int = 4) -> tuple[list, dict]:
    rng = np.random.default_rng(5)
    got = []
    for _ in range(steps):
        x = rng.standard_normal((6, 12)).astype(np.float32)
        y = rng.integers(0, 5, 6).astype(np.int64)
        feeds = {"x": x, "y": y, "Learning_Rate": np.array([0.05], np.float32)}
        if sess.loss_scale_input_name:
            feeds[sess.loss_scale_input_name] = np.array([1024.0], np.float32)
        got.append(sess.run(fetch, feeds))
    return got, sess.get_state()


@pytest.mark.parametrize("opt,kw", [("AdamOptimizer", {}),
                                    ("AdamOptimizer", {"enable_grad_norm_clip": False}),
                                    ("SGDOptimizer", {}), ("LambOptimizer", {}),
                                    ("AdamOptimizer", {"use_mixed_precision": True}),
                                    ("AdamOptimizer", {"gradient_accumulation_steps": 2,
                                                       "gradient_accumulation_mode": "auto"}),
                                    ("AdamOptimizer", {"gradient_accumulation_steps": 3}),
                                    ("SGDOptimizer", {"gradient_accumulation_steps": 2,
                                                      "gradient_accumulation_mode": "auto"})],
                         ids=["adam", "adam-unclipped", "sgd", "lamb", "adam-mixed-precision",
                              "adam-accumulating-2-auto", "adam-accumulating-3-legacy",
                              "sgd-accumulating-2-auto"])
def test_two_graph_steps_train_as_the_single_graph(monkeypatch, opt: str, kw: dict) -> None:
    monkeypatch.setattr(ort_chunks, "CHUNK_VALUES", 50)
    monkeypatch.setattr(ort_chunks, "CHUNK_FROM", 100)
    halves = _session("onnxruntime", opt, **kw)
    assert halves._halves and "full" not in halves._plans
    # onnxtrain's rewrites for onnxruntime give Lamb's update an If: it runs whole
    assert (halves._get_plan("update")._chunks is None) == (opt == "LambOptimizer")
    mixed = "use_mixed_precision" in kw
    fetch = ["loss", "logits"] + (["all_gradients_finite"] if mixed else [])
    got, state = _train(halves, fetch, steps=6)
    monkeypatch.setenv("ONNXTRAIN_ORT_PIECES", "0")
    single = _session("onnxruntime", opt, **kw)
    assert not single._halves
    want, want_state = _train(single, fetch, steps=6)
    # the numpy engine computes float16 products in float16, onnxruntime in float32: compared without them
    reference, ref_state = (_train(_session("numpy", opt, **kw), fetch, steps=6) if not mixed
                            else (want, want_state))
    for a, b, c in zip(got, want, reference):
        for x, y, z in zip(a, b, c):
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(x, z, rtol=1e-5, atol=1e-6)
    assert state.keys() == want_state.keys() == ref_state.keys()
    for k in state:
        np.testing.assert_allclose(state[k], want_state[k], rtol=1e-6, atol=1e-7, err_msg=k)
        np.testing.assert_allclose(state[k], ref_state[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert got[-1][0] != got[0][0]  # it trained


def test_the_update_halfs_outputs_are_fetched(monkeypatch) -> None:
    monkeypatch.setattr(ort_chunks, "CHUNK_VALUES", 50)
    monkeypatch.setattr(ort_chunks, "CHUNK_FROM", 100)
    sess = _session("onnxruntime", "AdamOptimizer")
    assert sess._halves
    fetched = [o.name for o in sess.get_outputs()]
    norm = next(n for n in fetched if n.startswith("global_gradient_norm"))
    got, _ = _train(sess, ["loss", norm], steps=2)  # the norm: the update half's
    assert "full" not in sess._plans and all(np.isfinite(g[1]).all() for g in got)
    # the step's peak: its larger half's, the update's, which holds at least the whole state
    held = sum(v.nbytes for v in sess.get_state().values())
    assert sess.peak_bytes >= held
    ref, _ = _train(_session("numpy", "AdamOptimizer"), ["loss", norm], steps=2)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a[1], b[1], rtol=1e-5)


def test_a_session_over_a_weight_of_2_to_the_20_values_steps_in_halves_by_default() -> None:
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array((np.random.default_rng(0).standard_normal((1024, 1024)) * 0.03)
                                .astype(np.float32), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"]), helper.make_node("Mul", ["y", "y"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 1024])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    x = np.full((2, 1024), 0.5, np.float32)
    losses = {}
    for backend in ("numpy", "onnxruntime"):
        so = onnxtrain.SessionOptions()
        so.add_session_config_entry("onnxtrain.backend", backend)
        sess = onnxtrain.TrainingSession(m.SerializeToString(), params("AdamOptimizer"), so)
        assert sess._halves == (backend == "onnxruntime")
        lr = np.array([1e-3], np.float32)
        losses[backend] = [float(sess.run(["loss"], {"x": x, "Learning_Rate": lr})[0]) for _ in range(3)]
    np.testing.assert_allclose(losses["onnxruntime"], losses["numpy"], rtol=1e-5)
    assert losses["numpy"][-1] < losses["numpy"][0]


def test_a_step_of_any_size_runs_as_two_graphs_its_gradients_and_state_kept_in_their_arrays() -> None:
    """The default on the backend, small weights included: the single graph is never made, each step's
    gradients are written into the arrays of the step before (onnxruntime's arena does not hold them beside
    the update's intermediates) and the weights and moments are updated in their own arrays; the losses
    are the numpy engine's."""
    sess = _session("onnxruntime", "AdamOptimizer")
    assert sess._halves
    got, _ = _train(sess, ["loss"], steps=2)
    grads = dict(sess._grad_arrays)
    state = dict(sess._store)
    assert sorted(grads) == sorted(f"{w}_grad" for w in sess._graphs.trainable)
    more, _ = _train(sess, ["loss"], steps=2)
    assert all(sess._grad_arrays[n] is a for n, a in grads.items())
    moments = [k for k in state if k.startswith(("Moment_1_", "Moment_2_"))]
    assert moments and all(sess._store[k] is state[k] for k in [*sess._graphs.trainable, *moments])
    assert "full" not in sess._plans
    ref, _ = _train(_session("numpy", "AdamOptimizer"), ["loss"], steps=2)
    np.testing.assert_allclose([g[0] for g in got], [r[0] for r in ref], rtol=1e-5)


def test_fetched_gradients_are_not_overwritten_by_the_next_step() -> None:
    """``set_gradients_as_graph_outputs``: a fetched gradient is the caller's array, not the one the next
    step's gradients are written into; each step's equals the numpy engine's."""
    kw = {"set_gradients_as_graph_outputs": True}
    sess = _session("onnxruntime", "AdamOptimizer", **kw)
    assert sess._halves
    got, _ = _train(sess, ["loss", "W1_grad"], steps=3)
    firsts = [g[1].copy() for g in got]
    ref, _ = _train(_session("numpy", "AdamOptimizer", **kw), ["loss", "W1_grad"], steps=3)
    for g, kept, r in zip(got, firsts, ref):
        np.testing.assert_array_equal(g[1], kept)
        np.testing.assert_allclose(g[1], r[1], rtol=1e-5, atol=1e-7)
    assert not np.array_equal(firsts[0], firsts[-1])
    assert not any(np.shares_memory(g[1], a) for g in got for a in sess._grad_arrays.values())
