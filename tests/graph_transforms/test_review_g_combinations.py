"""Review G: the legacy TrainingSession's options in combination, against a float64 oracle and 1.16.3.

The sweep (``review_g_sweep.py``) draws per seed a model (an MLP with Gelu, a conv net, a regression with a
loss of generic ops), SGD / Adam / Lamb with attributes per weight, 1-4 accumulation steps (the legacy
protocol or ``auto``), clipping, float16 / bfloat16 mixed precision fed by a dynamic loss scaler with
micro-steps whose loss overflows, recompute options, a weight selection, gradient / norm / finite-flag
fetches, a learning rate fed per update, evaluations, initial optimizer state and loads of other weights and
state mid-accumulation, and checks every step against its float64 oracle (the spec's formulas, onnxruntime's
loss scaler). A second sweep runs the combinations 1.16.3's CPU build takes in it and in onnxtrain.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from onnxtrain import TrainingParameters, TrainingSession
from tests.graph_transforms import review_g_sweep as sweep
from tests.tiers import extended

torch = pytest.importorskip("torch")

DEFAULT_SEEDS = range(0, 12)
EXTENDED_SEEDS = range(12, 300)


@pytest.mark.parametrize("seed", [*DEFAULT_SEEDS, *(extended(s) for s in EXTENDED_SEEDS)])
def test_option_combinations_against_float64(seed: int) -> None:
    """One drawn combination, every micro-step's loss, gradients, norm and finite flag and every update's
    weights, moments, counts, loss scale, get_optimizer_state() and get_model_state() against the oracle."""
    if sweep.draw(seed).backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    sweep.run_case(sweep.draw(seed))


def test_option_combinations_against_onnxruntime_training_116() -> None:
    """SGD and Adam (its CPU Adam does not clip: legacy_cpu_adam on our side) with attributes per weight,
    clipping on and off, weight selections, gradient and norm outputs, initial state, a learning rate fed per
    step and loads of other weights and counts between steps: 24 drawn sessions, every step's outputs, state
    and optimizer state as 1.16.3's."""
    from tests.session.legacy_peer import run_cases

    drawn = [sweep.peer_case(seed) for seed in range(24)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peer, ours = run_cases([c for c, _ in drawn])
    for seed, ((case, trained), p, o) in enumerate(zip(drawn, peer, ours)):
        assert p.error is None and o.error is None, (seed, p.error, o.error)
        for k in range(len(case.steps)):
            assert set(p.outputs[k]) == set(o.outputs[k]) and set(p.state[k]) == set(o.state[k]), (seed, k)
            assert sorted(p.optimizer[k]) == sorted(o.optimizer[k]), (seed, k)
            for kind, theirs, mine in (("output", p.outputs[k], o.outputs[k]),
                                       ("state", p.state[k], o.state[k]),
                                       ("optimizer", p.optimizer[k], o.optimizer[k])):
                for n, v in theirs.items():
                    assert mine[n].dtype == v.dtype, (seed, k, kind, n)
                    np.testing.assert_allclose(mine[n], v, rtol=1e-4, atol=1e-5,
                                               err_msg=f"seed {seed} step {k} {kind} {n}")
        assert sorted(w for w in p.state[-1] if not w.startswith(("Moment", "Update"))) == trained, seed


@pytest.mark.parametrize("scaled_by_client", [False, True])
def test_learning_rate_named_as_the_loss_scale_is_refused(scaled_by_client: bool) -> None:
    """lr_params_feed_name naming the loss-scale input of mixed precision (the session's ``loss_scale``, or
    the input a client's scaled loss reads): the session took the one feed as both, so the loss scale fed
    (1024) was the learning rate too: one SGD step moved the weights by hundreds (float64 oracle: by
    lr·gradient, below 0.1). Refused, naming the property and the input."""
    from onnx import TensorProto, helper

    model = sweep.mlp_model()
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    p.use_mixed_precision = True
    p.lr_params_feed_name = "loss_scale"
    if scaled_by_client:  # onnxruntime 1.2-1.3's clients: loss · an input of their own
        model.graph.node.append(helper.make_node("Mul", ["loss", "client_scale"], ["scaled"]))
        model.graph.input.append(helper.make_tensor_value_info("client_scale", TensorProto.FLOAT, [1]))
        p.scaled_loss_output_name = "scaled"
        p.lr_params_feed_name = "client_scale"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"lr_params_feed_name .*loss scale"):
            TrainingSession(model.SerializeToString(), p)


def test_max_norm_clip_under_legacy_cpu_adam_is_named() -> None:
    """legacy_cpu_adam (onnxruntime's CPU Adam, which does not clip) with a max_norm_clip in the attribute
    map: the session ignored the bound without a word (it warned only under enable_grad_norm_clip=False).
    It warns now, and the step is the unclipped one (float64 oracle: a gradient of norm > 0.01 clipped to
    0.01 would give other moments)."""
    model = sweep.mlp_model()
    weights = ["W1", "W2", "b1", "b2"]
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "AdamOptimizer"
    p.legacy_cpu_adam = True
    p.optimizer_attributes_map = {w: {"max_norm_clip": 0.01} for w in weights}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sess = TrainingSession(model.SerializeToString(), p)
    said = [str(w.message) for w in caught if "max_norm_clip" in str(w.message)]
    assert len(said) == 1 and "legacy_cpu_adam" in said[0] and "'W1'" in said[0], said
    feed = sweep.batch("mlp", np.random.default_rng(5))
    case = sweep.draw(0)  # (only its fields the oracle reads are set below)
    case.kind, case.opt, case.trained, case.steps = "mlp", "AdamOptimizer", weights, 1
    case.clip, case.cpu_adam, case.fp16_moments = True, True, False
    case.fattrs, case.iattrs = dict(p.optimizer_attributes_map), {}
    oracle = sweep.Oracle(case, model)
    _, g = oracle.grads(feed, 1.0)
    oracle.accumulate(g, False)
    assert oracle.norm() > 0.1  # (clipping to 0.01 would change the step)
    oracle.update(0.05, 1.0)
    sess.run(["loss"], {**feed, "Learning_Rate": np.array([0.05], np.float32)})
    got = sess.get_state()
    for name, v in oracle.state().items():
        np.testing.assert_allclose(got[name].astype(np.float64), v, rtol=2e-4, atol=2e-6, err_msg=name)


def test_mixed_precision_of_a_float64_model_names_the_option_and_the_type() -> None:
    """use_mixed_precision on a float64 model: the error said only "mixed_precision: the loss 'loss' must be a
    float32 value"; it names the option and the loss's type now."""
    from onnx import TensorProto, numpy_helper

    model = sweep.mse_model()
    for i, t in enumerate(model.graph.initializer):
        model.graph.initializer[i].CopyFrom(numpy_helper.from_array(
            numpy_helper.to_array(t).astype(np.float64), t.name))
    for v in [*model.graph.input, *model.graph.output]:
        v.type.tensor_type.elem_type = TensorProto.DOUBLE
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "AdamOptimizer"
    p.use_mixed_precision = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"use_mixed_precision.*the loss 'loss' is double, not float32"):
            TrainingSession(model.SerializeToString(), p)
    p.use_mixed_precision = False  # (the same model trains in float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sess = TrainingSession(model.SerializeToString(), p)
    feed = {k: v.astype(np.float64) for k, v in sweep.batch("mse", np.random.default_rng(1)).items()}
    loss, = sess.run(["loss"], {**feed, "Learning_Rate": np.array([0.01], np.float32)})
    weights = {t.name: torch.from_numpy(numpy_helper.to_array(t)) for t in model.graph.initializer}
    want, _ = sweep.forward("mse", weights, feed)
    assert loss.dtype == np.float64 and abs(float(loss) - float(want)) < 1e-12
